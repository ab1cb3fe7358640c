"""The KV offloading benchmark on a tiny fp32 Llama: four conversations of ~30 tokens
through a device cache of 64 tokens, so every second turn finds its history evicted. The
host pool and the shared storage load what the device lost, and every mode's greedy
tokens are the same (the timings are never asserted)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedlm.benchmarks import kv_offloading
from tiny_checkpoints import save_random_model

TINY = ["--load-format", "auto", "--dtype", "float32", "--block-size", "4",
        "--num-kv-blocks", "16", "--max-model-len", "64", "--kv-offloading-size", "0.001",
        "--conversations", "4", "--turns", "2", "--prefix-len", "20", "--question-len", "3",
        "--output-len", "2", "--repeats", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kv-offloading-llama")
    save_random_model(path, "LlamaConfig", {})
    return str(path)


def test_offloading_loads_what_the_device_lost_with_the_same_tokens(model, tmp_path):
    output = tmp_path / "figures.json"
    modes = "device-only,offloading,shared-storage"
    returned = kv_offloading.main(
        ["--model", model, *TINY, "--modes", modes, "--output-json", str(output)]
    )
    figures = json.loads(output.read_text())
    assert figures == json.loads(json.dumps(returned))
    assert figures["tokens_identical"] is True
    assert figures["workload"]["conversations"] == 4 and figures["repeats"] == 2
    assert figures["history_tokens"] == 4 * (20 + 2 * 3 + 2 + 2) > figures["device_cache_tokens"]
    device, offloading, storage = (figures["modes"][mode] for mode in modes.split(","))
    for result in (device, offloading, storage):
        assert result["prompt_tokens"] == 4 * (20 + 3) + 4 * (20 + 3 + 2 + 3)
        assert result["computed_prompt_tokens"] + result["cached_tokens"] == result["prompt_tokens"]
        assert result["cached_tokens"] >= result["loaded_tokens"]
        assert result["failed_load_tokens"] == 0
        assert len(result["total_s_runs"]) == len(result["load_averages"]) == 2
        assert len(result["ttft_mean_by_turn_s"]) == 2
        assert 0 < result["ttft_mean_s"] <= result["total_s"]
        assert result["ttft_p90_s"] >= min(result["ttft_mean_by_turn_s"])
    assert device["loaded_tokens"] == 0
    # The second turns' histories: 6 blocks of 4 of each 28-token prompt, evicted from the
    # device, come back from the pool and the storage.
    assert offloading["loaded_tokens"] > 0 and storage["loaded_tokens"] > 0
    assert offloading["computed_prompt_tokens"] < device["computed_prompt_tokens"]
    assert storage["computed_prompt_tokens"] < device["computed_prompt_tokens"]


def test_different_tokens_end_the_benchmark_with_an_error(model, monkeypatch, capsys):
    converse = kv_offloading.converse

    def one_token_off(llm, workload, seed):
        run = converse(llm, workload, seed)
        if llm.llm_engine.engine_core.scheduler.external is None:
            return run
        first, *rest = run.token_ids
        return dataclasses.replace(run, token_ids=[[first[0] + 1, *first[1:]], *rest])

    monkeypatch.setattr(kv_offloading, "converse", one_token_off)
    with pytest.raises(SystemExit, match="greedy tokens differ"):
        kv_offloading.main(["--model", model, *TINY, "--repeats", "1"])
    assert "device-only, offloading: DIFFERENT" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--modes", "offloading"], "name two or more"),
        (["--modes", "device-only,disk"], "name two or more"),
        (["--max-model-len", "16"], "the last turn needs 30 tokens"),
        (["--kv-transfer-config", "{}"], "each mode sets its own connector"),
    ],
)
def test_flags_that_cannot_run_are_refused_before_any_engine(flags, message, capsys):
    with pytest.raises(SystemExit):
        kv_offloading.main(["--model", "qwen3-0.6b", *TINY, *flags])
    assert message in capsys.readouterr().err
