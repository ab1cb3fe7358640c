"""Hub ids resolved through huggingface_hub's cache, offline (HF_HUB_OFFLINE=1, no network)."""

from __future__ import annotations

import json
import logging
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
    from pagedlm.model_executor.loader.hub import CACHED_WEIGHT_PATTERNS, HUB_ALLOW_PATTERNS

    assert "*.json" in HUB_ALLOW_PATTERNS and CACHED_WEIGHT_PATTERNS == ("*.safetensors",)
    weights_or_code = (".py", ".bin", ".pt", ".safetensors")
    assert not [p for p in HUB_ALLOW_PATTERNS if p == "*" or p.endswith(weights_or_code)]
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


# ---- repositories with PyTorch .bin weights only (load_format "auto"'s fallback, "pt") ----

BIN_REPO = ["config.json", "generation_config.json", "pytorch_model.bin", "training_args.bin",
            "optimizer.pt", "scheduler.pt", "README.md", "checkpoint-500/pytorch_model.bin"]  # fmt: skip
SHARDED_BIN_REPO = ["config.json", "pytorch_model.bin.index.json",
                    "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]  # fmt: skip
BOTH_REPO = ["config.json", "model.safetensors", "pytorch_model.bin", "tf_model.h5"]


SHARDED_BIN_INDEX = {"pytorch_model.bin.index.json": SHARDED_BIN_REPO[2:]}


@pytest.mark.parametrize(
    ("files", "load_format", "weights"),
    [
        (BIN_REPO, "auto", ["pytorch_model.bin"]),
        (BIN_REPO, "pt", ["pytorch_model.bin"]),
        (SHARDED_BIN_REPO, "auto", SHARDED_BIN_REPO[2:]),
        (BOTH_REPO, "auto", ["model.safetensors"]),
        (BOTH_REPO, "pt", ["pytorch_model.bin"]),
        (BOTH_REPO, "safetensors", ["model.safetensors"]),
        (BIN_REPO, None, []),  # a tokenizer's files
        (BOTH_REPO, "dummy", []),  # random weights
        (None, "auto", ["*.safetensors"]),  # not listed (offline): the cache decides
    ],
)
def test_hub_fetches_the_weight_files_the_format_reads(files, load_format, weights) -> None:
    from pagedlm.model_executor.loader.hub import HUB_ALLOW_PATTERNS, hub_allow_patterns

    patterns = hub_allow_patterns(files, load_format, "org/m", SHARDED_BIN_INDEX.__getitem__)
    assert patterns == list(HUB_ALLOW_PATTERNS) + weights


def test_a_repository_without_weights_fails_before_downloading() -> None:
    from pagedlm.model_executor.loader.hub import hub_allow_patterns

    trainer_state = ["config.json", "optimizer.pt", "training_args.bin"]
    with pytest.raises(ValueError, match=r"org/t on the Hugging Face hub has no weights"):
        hub_allow_patterns(trainer_state, "auto", "org/t")


def test_pt_on_a_repository_without_pickles_fails_before_downloading() -> None:
    from pagedlm.model_executor.loader.hub import hub_allow_patterns

    with pytest.raises(ValueError, match=r"org/st on the Hugging Face hub has none \(it has \*"):
        hub_allow_patterns(["config.json", "model.safetensors"], "pt", "org/st")


def test_the_listing_chooses_what_snapshot_download_fetches(monkeypatch, tmp_path) -> None:
    """Online: the repository is listed first and only its weights are fetched; a hub that
    does not answer leaves the cache to snapshot_download, as it would without the listing."""
    import huggingface_hub

    from pagedlm.model_executor.loader.hub import resolve_hub_model

    calls: list[dict] = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    listing: list = [BIN_REPO]

    def list_repo_files(repo_id, revision=None, token=None):
        if isinstance(listing[0], Exception):
            raise listing[0]
        return listing[0]

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    assert resolve_hub_model("org/bin-only") == str(tmp_path)
    assert "pytorch_model.bin" in calls[-1]["allow_patterns"]
    assert not {"*.safetensors", "training_args.bin", "optimizer.pt"} & set(
        calls[-1]["allow_patterns"]
    )
    assert calls[-1]["local_files_only"] is False
    listing[0] = ConnectionError("connection refused")
    resolve_hub_model("org/bin-only")
    assert calls[-1]["local_files_only"] is True and "*.safetensors" in calls[-1]["allow_patterns"]
    listing[0] = ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match=r"org/st-only on the Hugging Face hub has none"):
        resolve_hub_model("org/st-only", load_format="pt")
    assert len(calls) == 2  # nothing was downloaded for it


def test_a_cached_bin_only_repository_loads_offline(monkeypatch, tmp_path) -> None:
    from safetensors.torch import load_file

    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.model_executor.loader import load_model

    add_snapshot(tmp_path, "tiny-org/bin-only", MAIN_COMMIT, "main", seed=3)
    snapshot = tmp_path / "models--tiny-org--bin-only" / "snapshots" / MAIN_COMMIT
    state = load_file(snapshot / "model.safetensors")
    (snapshot / "model.safetensors").unlink()
    torch.save(state, snapshot / "pytorch_model.bin")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = EngineArgs(model="tiny-org/bin-only", download_dir=str(tmp_path), dtype="float32")
    config, _ = args.create_engine_config()
    assert config.model.model == str(snapshot)
    model = load_model(config.model, torch.device("cpu"))
    weight = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(model.get_parameter(weight), state[weight])


# ---- what is fetched, through a fake hub (no network) ----


class FakeHub:
    """Repositories in memory behind huggingface_hub's ``list_repo_files``,
    ``hf_hub_download`` and ``snapshot_download``: each call is recorded (function, repo,
    keyword arguments), and the files a download fetches are written under ``root``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        import huggingface_hub

        self.root = root
        self.repos: dict[str, dict[str, bytes]] = {}
        self.calls: list[tuple[str, str, dict]] = []
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        for name in ("list_repo_files", "hf_hub_download", "snapshot_download"):
            monkeypatch.setattr(huggingface_hub, name, getattr(self, name))

    def add(self, repo_id: str, files: dict[str, bytes | str]) -> None:
        self.repos[repo_id] = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}

    def snapshot(self, repo_id: str) -> Path:
        return self.root / repo_id.replace("/", "--")

    def fetched(self, repo_id: str) -> set[str]:
        snapshot = self.snapshot(repo_id)
        return {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}

    def _write(self, repo_id: str, name: str) -> Path:
        path = self.snapshot(repo_id) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.repos[repo_id][name])
        return path

    def list_repo_files(self, repo_id: str, **kwargs) -> list[str]:
        self.calls.append(("list_repo_files", repo_id, kwargs))
        return sorted(self.repos[repo_id])

    def hf_hub_download(self, repo_id: str, filename: str, **kwargs) -> str:
        self.calls.append(("hf_hub_download", repo_id, {"filename": filename, **kwargs}))
        return str(self._write(repo_id, filename))

    def snapshot_download(self, repo_id: str, **kwargs) -> str:
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(("snapshot_download", repo_id, kwargs))
        patterns = kwargs.get("allow_patterns")
        for name in filter_repo_objects(self.repos[repo_id], allow_patterns=patterns):
            self._write(repo_id, name)
        self.snapshot(repo_id).mkdir(parents=True, exist_ok=True)
        return str(self.snapshot(repo_id))


TINY_CONFIG = json.dumps({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
NOT_WEIGHTS = {
    "config.json": TINY_CONFIG,
    "generation_config.json": json.dumps({"temperature": 0.6}),
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "chat_template.jinja": "{{ messages }}",
    "README.md": "not read",
    "modeling_custom.py": "never fetched",
}
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
BIN_SHARDS = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
FETCHED_NOT_WEIGHTS = {name for name in NOT_WEIGHTS if not name.endswith((".md", ".py"))}


def index_of(shards: list[str]) -> str:
    return json.dumps({"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}})


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    return FakeHub(monkeypatch, tmp_path / "hub")


DRAFT = {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 2}


def test_dummy_weights_fetch_no_weight_file(hub: FakeHub) -> None:
    """Random weights need the config, tokenizer and generation config, of the model and of
    its draft model, and no weight file of either."""
    from pagedlm.engine.arg_utils import EngineArgs

    weights = {"model.safetensors": "w", "pytorch_model.bin": "w", "consolidated.safetensors": "w"}
    for repo_id in ("org/tiny", "org/draft"):
        hub.add(repo_id, {**NOT_WEIGHTS, **weights})
    args = EngineArgs(model="org/tiny", load_format="dummy", speculative_config=DRAFT)
    config, _ = args.create_engine_config()
    assert config.model.model == str(hub.snapshot("org/tiny"))
    assert config.speculative.draft_model.model == str(hub.snapshot("org/draft"))
    assert hub.fetched("org/tiny") == hub.fetched("org/draft") == FETCHED_NOT_WEIGHTS
    assert config.model.sampling_defaults["temperature"] == 0.6  # generation_config.json came


@pytest.mark.parametrize(
    ("weights", "load_format", "expected"),
    [
        # An index decides: neither the single file nor Mistral's consolidated copy comes.
        ({"model.safetensors": "w", "consolidated.safetensors": "w",
          "model.safetensors.index.json": index_of(SHARDS), **dict.fromkeys(SHARDS, "w")},
         "auto", {"model.safetensors.index.json", *SHARDS}),
        ({"pytorch_model.bin": "w", "pytorch_model.bin.index.json": index_of(BIN_SHARDS),
          "training_args.bin": "w", **dict.fromkeys(BIN_SHARDS, "w")},
         "pt", {"pytorch_model.bin.index.json", *BIN_SHARDS}),
        ({"pytorch_model.bin": "w", "pytorch_model.bin.index.json": index_of(BIN_SHARDS),
          **dict.fromkeys(BIN_SHARDS, "w")},
         "auto", {"pytorch_model.bin.index.json", *BIN_SHARDS}),
        # No index: the single file of the shards' name (transformers reads it first).
        ({"model.safetensors": "w", "consolidated.safetensors": "w",
          **dict.fromkeys(SHARDS, "w")}, "safetensors", {"model.safetensors"}),
    ],
)  # fmt: skip
def test_a_repository_holding_its_weights_twice_fetches_one_copy(
    hub: FakeHub, weights: dict, load_format: str, expected: set[str]
) -> None:
    from pagedlm.model_executor.loader.hub import resolve_hub_model

    hub.add("org/twice", {**NOT_WEIGHTS, **weights})
    path = resolve_hub_model("org/twice", load_format=load_format)
    assert hub.fetched("org/twice") == FETCHED_NOT_WEIGHTS | expected
    from pagedlm.model_executor.loader.weight_files import checkpoint_files

    files = checkpoint_files(path, load_format)
    assert {p.name for p in files.files} == {n for n in expected if not n.endswith(".json")}


def test_an_index_naming_missing_shards_fails_before_any_weight_comes(hub: FakeHub) -> None:
    from pagedlm.model_executor.loader.hub import resolve_hub_model

    listed = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    index = index_of([*listed, "model-00003-of-00003.safetensors"])
    files = {**NOT_WEIGHTS, "model.safetensors.index.json": index, **dict.fromkeys(listed, "w")}
    hub.add("org/broken", files)
    with pytest.raises(ValueError, match=r"lists shard files the repository does not have: mod"):
        resolve_hub_model("org/broken")
    assert "snapshot_download" not in [call[0] for call in hub.calls]


# ---- hf_token (vLLM's --hf-token): sent with every hub call, never shown ----

SECRET = "hf_NotARealToken1234567890"
SHARDED_REPO = {**NOT_WEIGHTS, "model.safetensors.index.json": index_of(SHARDS),
                **dict.fromkeys(SHARDS, "w")}  # fmt: skip


def test_hf_token_flag_parses_as_vllms() -> None:
    """``--hf-token`` alone: the stored token (True); with a value: that token."""
    import argparse

    from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli

    parser = add_engine_args(argparse.ArgumentParser())
    for argv, expected in (([], None), (["--hf-token"], True), (["--hf-token", SECRET], SECRET),
                           ([f"--hf-token={SECRET}", "--revision", "v2"], SECRET)):  # fmt: skip
        assert engine_args_from_cli(parser.parse_args(argv)).hf_token == expected, argv


def test_hf_token_goes_with_every_hub_call_and_is_never_shown(hub: FakeHub, caplog) -> None:
    """Listing, the index, the snapshot: of the model, the tokenizer and the draft model."""
    from pagedlm.engine.arg_utils import EngineArgs

    for repo_id in ("org/private", "org/draft"):
        hub.add(repo_id, SHARDED_REPO)
    hub.add("org/tokenizer", NOT_WEIGHTS)
    args = EngineArgs(model="org/private", tokenizer="org/tokenizer", hf_token=SECRET,
                      speculative_config=DRAFT)  # fmt: skip
    with caplog.at_level(logging.DEBUG):
        config, _ = args.create_engine_config()
    assert config.model.tokenizer == str(hub.snapshot("org/tokenizer"))
    asked = {(function, repo_id) for function, repo_id, _ in hub.calls}
    for repo_id in ("org/private", "org/draft"):
        for function in ("list_repo_files", "hf_hub_download", "snapshot_download"):
            assert (function, repo_id) in asked
    assert ("snapshot_download", "org/tokenizer") in asked
    assert [kwargs.get("token") for _, _, kwargs in hub.calls] == [SECRET] * len(hub.calls)
    assert SECRET not in caplog.text and SECRET not in repr(args) and SECRET not in str(config)


def test_hf_token_true_sends_the_stored_token(hub: FakeHub, monkeypatch) -> None:
    import huggingface_hub

    from pagedlm.engine.arg_utils import EngineArgs

    hub.add("org/private", SHARDED_REPO)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match=r"none is stored and HF_TOKEN is unset; log in, or pass"):
        EngineArgs(model="org/private", hf_token=True).create_engine_config()
    assert hub.calls == []  # nothing asked of the hub
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "stored")
    EngineArgs(model="org/private", hf_token=True).create_engine_config()
    assert hub.calls and all(kwargs["token"] is True for _, _, kwargs in hub.calls)
