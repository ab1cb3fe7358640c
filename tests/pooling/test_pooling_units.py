"""The pooling pieces without a model: runner and pooler-config resolution, the worker's
pooler, ``PoolingParams``, the scheduler's whole-prompt admission and pooled finish, the
attention layer's refusal of a backend without bidirectional attention, and the edge's
errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_checkpoints import write_sentence_transformers_files
from pagedlm.config import ArchConfig, CacheConfig, PoolerConfig, SchedulerConfig
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.pooling import PoolingParams
from pagedlm.pooling.model_config import pooler_config, resolve_runner
from pagedlm.pooling.pooler import Pooler
from pagedlm.pooling.requests import pooling_sampling_params
from pagedlm.step import ModelRunnerOutput

SIZES = dict(
    vocab_size=16,
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=8,
)


def _arch(architecture: str, **extra: object) -> ArchConfig:
    return ArchConfig.from_hf_dict({"architectures": [architecture], **SIZES, **extra})


def _st_dir(path: Path, pooling: str, normalize: bool) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    write_sentence_transformers_files(path, pooling, normalize)
    return path


# ---------------------------------------------------------------- runner and pooler config


def test_auto_runner_pools_embedding_architectures_and_sentence_transformers_dirs(tmp_path):
    assert resolve_runner("auto", _arch("BertModel"), str(tmp_path)) == "pooling"
    assert resolve_runner("auto", _arch("Qwen3Model"), str(tmp_path)) == "pooling"
    assert resolve_runner("auto", _arch("LlamaForCausalLM"), str(tmp_path)) == "generate"
    st = _st_dir(tmp_path / "st", "lasttoken", True)
    assert resolve_runner("auto", _arch("Qwen3ForCausalLM"), str(st)) == "pooling"
    assert resolve_runner("pooling", _arch("LlamaForCausalLM"), str(tmp_path)) == "pooling"


def test_runner_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="--runner pooling"):
        resolve_runner("generate", _arch("BertModel"), str(tmp_path))
    with pytest.raises(ValueError, match=r"runner='embed' is unknown.*'pooling'"):
        resolve_runner("embed", _arch("BertModel"), str(tmp_path))


@pytest.mark.parametrize(
    ("pooling", "normalize", "expected"),
    [("cls", True, "CLS"), ("mean", False, "MEAN"), ("lasttoken", True, "LAST")],
)
def test_pooler_config_follows_the_sentence_transformers_modules(
    tmp_path, pooling, normalize, expected
):
    path = _st_dir(tmp_path, pooling, normalize)
    assert pooler_config(_arch("BertModel"), str(path)) == PoolerConfig(expected, normalize)


def test_pooler_defaults_without_sentence_transformers_config(tmp_path):
    assert pooler_config(_arch("BertModel"), str(tmp_path)) == PoolerConfig("CLS", True)
    assert pooler_config(_arch("LlamaForCausalLM"), str(tmp_path)) == PoolerConfig("LAST", True)
    matryoshka = _arch("Qwen3Model", matryoshka_dimensions=[4, 8])
    assert pooler_config(matryoshka, str(tmp_path)) == PoolerConfig("LAST", True, True, (4, 8))


def test_unsupported_sentence_transformers_setups_are_refused(tmp_path):
    path = _st_dir(tmp_path, "mean", True)
    config_file = path / "1_Pooling" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        pooler_config(_arch("BertModel"), str(path))
    config_file.write_text(json.dumps(config))
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"Dense'? of .* is not supported"):
        pooler_config(_arch("BertModel"), str(path))


# ------------------------------------------------------------------------------- pooler


@pytest.mark.parametrize("pooling_type", ["LAST", "CLS", "MEAN"])
def test_pooler_reads_each_requests_rows(pooling_type):
    hidden = torch.randn(10, 4)
    query_start_loc = np.array([0, 3, 4, 10])  # requests of 3, 1 and 6 tokens
    rows = np.array([0, 2])  # request 1 is a chunk that does not pool this step
    got = Pooler(pooling_type)(hidden, query_start_loc, rows)
    pick = {
        "LAST": lambda s, e: hidden[e - 1],
        "CLS": lambda s, e: hidden[s],
        "MEAN": lambda s, e: hidden[s:e].mean(0),
    }[pooling_type]
    torch.testing.assert_close(got, torch.stack([pick(0, 3), pick(4, 10)]))


def test_pooling_params_cut_then_normalize():
    pooler = PoolerConfig("LAST", True, True, (2, 4))
    vector = [3.0, 4.0, 12.0, 0.0]
    torch.testing.assert_close(
        PoolingParams(dimensions=2).finish(vector, pooler), torch.tensor([0.6, 0.8])
    )
    raw = PoolingParams(normalize=False).finish(vector, pooler)
    torch.testing.assert_close(raw, torch.tensor(vector))
    with pytest.raises(ValueError, match=r"use one of \[2, 4\]"):
        PoolingParams(dimensions=3).validate(pooler, 4)
    with pytest.raises(ValueError, match="Matryoshka"):
        PoolingParams(dimensions=2).validate(PoolerConfig(), 4)
    PoolingParams(dimensions=4).validate(PoolerConfig(), 4)  # the full size is always fine


# ---------------------------------------------------------------------------- scheduler


def _pooling_scheduler(budget: int) -> OneBudgetScheduler:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=budget, whole_prompts=True
    )
    return OneBudgetScheduler(config, CacheConfig(block_size=4, enable_prefix_caching=False), 64)


def _pooling_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), pooling_sampling_params())


def test_whole_prompts_wait_instead_of_being_chunked_and_finish_with_their_vector():
    scheduler = _pooling_scheduler(budget=16)
    for request_id, num_tokens in (("a", 10), ("b", 10), ("c", 6)):
        scheduler.add_request(_pooling_request(request_id, num_tokens))
    first = scheduler.schedule()
    # "b" does not fit after "a" (6 tokens left): FCFS, so "c" waits behind it too.
    assert first.num_scheduled_tokens == {"a": 10}
    outputs = scheduler.update_from_output(
        first,
        ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]], pooler_output={"a": [0.5]}),
    )
    assert [(o.req_id, o.finish_reason, o.pooled, o.new_token_ids) for o in outputs] == [
        ("a", "stop", [0.5], [])
    ]
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"b": 10, "c": 6}
    assert second.finished_req_ids == {"a"}


# ---------------------------------------------------------------------------- attention


class _CausalOnlyBackend:
    name = "causal_only"
    supports_non_causal = False

    def forward(self, *args, **kwargs):
        raise AssertionError("the layer must refuse this backend before calling it")


class _Cache:
    def layer(self, index):
        return torch.zeros(1), torch.zeros(1)


def test_bidirectional_layer_refuses_a_backend_without_it():
    layer = Attention(0, num_heads=2, num_kv_heads=2, head_dim=4, scale=0.5, causal=False)
    ctx = ForwardContext(_CausalOnlyBackend(), None, _Cache())
    q = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"causal=False.*causal_only"):
        layer(q, q, q, ctx)


def test_pooler_config_turns_a_classifiers_activation_off():
    from pagedlm.pooling.model_config import with_pooler_overrides

    classifier = PoolerConfig("CLS", False, labels=("a", "b"), activation="softmax")
    raw = with_pooler_overrides(classifier, {"use_activation": False, "seq_pooling_type": "LAST"})
    assert (raw.activation, raw.pooling_type, raw.labels) == ("identity", "LAST", ("a", "b"))
    assert with_pooler_overrides(classifier, {"use_activation": True}) == classifier
    with pytest.raises(ValueError, match="applies to embedding models"):
        with_pooler_overrides(classifier, {"normalize": True})
    with pytest.raises(ValueError, match="different values"):
        with_pooler_overrides(classifier, {"pooling_type": "CLS", "seq_pooling_type": "LAST"})
