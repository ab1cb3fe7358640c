"""Hub ids resolved through huggingface_hub's cache, offline (HF_HUB_OFFLINE=1, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from pagedlm.model_executor.loader.hub import looks_like_hub_id

TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
MAIN_COMMIT = "a" * 40
V2_COMMIT = "b" * 40


def add_snapshot(hub_cache: Path, repo_id: str, commit: str, ref: str, seed: int) -> None:
    """The layout huggingface_hub writes: refs/<branch> -> commit, snapshots/<commit>/files."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    add_snapshot(home / "hub", "tiny-org/tiny-llama", MAIN_COMMIT, "main", seed=0)
    add_snapshot(home / "hub", "tiny-org/tiny-llama", V2_COMMIT, "v2", seed=1)
    return home


_QUERIES = [
    ("tiny-org/tiny-llama", None),
    ("tiny-org/tiny-llama", "v2"),
    ("tiny-org/tiny-llama", V2_COMMIT),
    ("tiny-org/not-downloaded", None),
    ("tiny-org/tiny-llama", "no-such-branch"),
]
_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.model_executor.loader import load_model

    answers = []
    for model, revision in json.loads(sys.argv[1]):
        try:
            config, _ = EngineArgs(model=model, revision=revision).create_engine_config()
        except ValueError as error:
            answers.append({"error": str(error)})
            continue
        loaded = load_model(config.model, torch.device("cpu"))
        weight = loaded.get_parameter("model.layers.0.mlp.down_proj.weight")
        answers.append({"path": config.model.model, "revision": config.model.revision,
                        "checksum": float(weight.double().sum())})
    print(json.dumps(answers))
    """
)


@pytest.fixture(scope="module")
def resolved(hf_home: Path) -> dict[tuple[str, str | None], dict]:
    """Every query of ``_QUERIES`` answered by one fresh interpreter (HF_HOME read at import)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    # A dead proxy: offline mode must not need the network at all.
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HTTPS_PROXY="http://127.0.0.1:9")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(_QUERIES)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    return dict(zip(_QUERIES, answers, strict=True))


def expected_checksum(hf_home: Path, commit: str) -> float:
    from safetensors.torch import load_file

    path = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / commit
    weight = load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    return float(weight.double().sum())


def test_hub_id_resolves_offline_from_the_cache(hf_home: Path, resolved: dict) -> None:
    got = resolved[("tiny-org/tiny-llama", None)]
    assert got["path"].endswith(f"snapshots/{MAIN_COMMIT}")
    assert got["checksum"] == pytest.approx(expected_checksum(hf_home, MAIN_COMMIT), rel=1e-12)


@pytest.mark.parametrize("revision", ["v2", V2_COMMIT])
def test_revision_by_branch_or_commit(hf_home: Path, resolved: dict, revision: str) -> None:
    got = resolved[("tiny-org/tiny-llama", revision)]
    assert got["path"].endswith(f"snapshots/{V2_COMMIT}")
    assert got["revision"] == revision
    assert got["checksum"] == pytest.approx(expected_checksum(hf_home, V2_COMMIT), rel=1e-12)


def test_uncached_hub_id_while_offline_names_the_fix(resolved: dict) -> None:
    got = resolved[("tiny-org/not-downloaded", None)]
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in got["error"]
    got = resolved[("tiny-org/tiny-llama", "no-such-branch")]
    assert "at revision 'no-such-branch' is not in the local Hugging Face cache" in got["error"]


def test_hub_only_downloads_what_pagedlm_reads(hf_home: Path) -> None:
    from pagedlm.model_executor.loader.hub import HUB_ALLOW_PATTERNS

    assert "*.safetensors" in HUB_ALLOW_PATTERNS and "*.json" in HUB_ALLOW_PATTERNS
    assert not [p for p in HUB_ALLOW_PATTERNS if p == "*" or p.endswith((".py", ".bin", ".pt"))]
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_COMMIT
    assert json.loads((snapshot / "config.json").read_text())["architectures"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("Qwen/Qwen2.5-0.5B", True),
        ("org_1/model.v2", True),
        ("./model", False),
        ("/abs/path", False),
        ("a/b/c", False),
        ("model.gguf", False),
        ("../up/model", False),
        ("org/-bad", False),
        ("org/bad--name", False),
    ],
)
def test_hub_id_shape(name: str, expected: bool) -> None:
    assert looks_like_hub_id(name) is expected


def test_download_dir_is_the_cache_hub_ids_resolve_from(tmp_path: Path) -> None:
    """vLLM's download_dir: a hub cache of its own (here offline, already filled)."""
    elsewhere = tmp_path / "models"
    add_snapshot(elsewhere, "tiny-org/elsewhere", MAIN_COMMIT, "main", seed=2)
    script = (
        "import sys\nfrom pagedlm.engine.arg_utils import EngineArgs\n"
        "for download_dir in (sys.argv[1], None):\n"
        "    try:\n"
        "        args = EngineArgs(model='tiny-org/elsewhere', download_dir=download_dir)\n"
        "        print(args.create_engine_config()[0].model.model)\n"
        "    except ValueError as error:\n"
        "        print('error:', error)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1", HTTPS_PROXY="http://127.0.0.1:9"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(elsewhere)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    found, default = result.stdout.strip().splitlines()[-2:]
    assert found.startswith(str(elsewhere)) and found.endswith(f"snapshots/{MAIN_COMMIT}")
    assert default.startswith("error:")  # the default cache does not have it
