"""``pagedlm bench throughput|latency`` take every engine flag of ``pagedlm serve`` (same
names, generated from EngineArgs), with the benchmark defaults that differ on purpose."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from pagedlm.benchmarks import latency, throughput
from pagedlm.benchmarks.common import BENCH_ENGINE_DEFAULTS, build_llm
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.entrypoints.cli.main import build_parser

BENCH_ONLY = ["--bandwidth", "--flops", "--profile-steps", "--compare-transformers"]
DATASET_FLAGS = ["--dataset", "--input-len", "--output-len", "--num-prompts", "--range-ratio"]


def _options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("bench", ["throughput", "latency"])
def test_bench_has_every_engine_flag_with_serve_defaults_except_the_bench_ones(bench) -> None:
    parser = build_parser()
    serve = engine_args_from_cli(parser.parse_args(["serve"]))
    ours = engine_args_from_cli(parser.parse_args(["bench", bench]))
    for field in dataclasses.fields(EngineArgs):
        expected = BENCH_ENGINE_DEFAULTS.get(field.name, getattr(serve, field.name))
        assert getattr(ours, field.name) == expected, field.name
    assert ours.load_format == "dummy" and ours.model == "qwen3-0.6b"
    assert (ours.dtype, ours.max_num_seqs) == ("bfloat16", 256)
    assert (ours.max_num_batched_tokens, ours.max_model_len) == (16384, 4096)
    flags = ["--enforce-eager", "--gpu-memory-utilization", "0.5", "--max-model-len", "128"]
    parsed = engine_args_from_cli(parser.parse_args(["bench", bench, *flags]))
    assert (parsed.enforce_eager, parsed.gpu_memory_utilization) == (True, 0.5)
    assert parsed.max_model_len == 128


@pytest.mark.parametrize("module", [throughput, latency])
def test_module_parser_has_engine_and_benchmark_flags(module) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    module.add_args(parser)
    options = _options(parser)
    for field in dataclasses.fields(EngineArgs):
        assert "--" + field.name.replace("_", "-") in options
    assert set(BENCH_ONLY) <= options
    if module is throughput:
        assert set(DATASET_FLAGS) <= options
    else:
        assert {"--batch-size", "--input-len", "--output-len", "--num-iters"} <= options


@pytest.mark.parametrize("bench", ["throughput", "latency"])
def test_cli_help_works(bench, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", bench, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu-memory-utilization" in out and "--bandwidth" in out
    assert "(default: dummy)" in out and "(default: qwen3-0.6b)" in out


def test_python_m_help_works() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pagedlm.benchmarks.throughput", "--help"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "--enforce-eager" in done.stdout and "--num-prompts" in done.stdout


def test_engine_flags_reach_the_engine_and_latency_runs_on_cpu(tmp_path, capsys) -> None:
    import transformers

    # Only a config.json (load_format dummy), with room for the benchmark's ids < 10001.
    transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=10240, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128,
    ).save_pretrained(tmp_path)  # fmt: skip
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "latency", "--model", str(tmp_path), "--dtype", "float32",
         "--max-model-len", "64", "--max-num-batched-tokens", "64", "--num-kv-blocks", "16",
         "--enforce-eager", "--gpu-memory-utilization", "0.5", "--platform", "cpu"]
    )  # fmt: skip
    llm, _ = build_llm(args)
    config = llm.llm_engine.config
    assert config.model.enforce_eager is True
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.model.load_format == "dummy"
    assert (config.scheduler.max_model_len, config.cache.num_kv_blocks) == (64, 16)
    del llm
    args.input_len, args.output_len, args.num_iters, args.num_iters_warmup = 8, 4, 1, 0
    result = latency.run(args)
    assert result["tok_per_s"] > 0
    # The run splits into its first token and the three after it.
    assert 0 < result["ttft_s"] < result["mean_s"]
    assert 0 < result["decode_s_per_token"] * 3 < result["mean_s"]
    out = capsys.readouterr().out
    assert "latency [" in out and "time to first token" in out
    assert "speed of light" not in out  # the H200's ceilings say nothing about a CPU
    args.bandwidth, args.flops = 1e11, 1e12
    latency.run(args)
    assert "speed of light" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, dataset, num_prompts",
    [([], "nanovllm", 256), (["--num-prompts", "7"], "random", 7),
     (["--dataset", "random"], "random", 256), (["--input-len", "9"], "random", 256)],
)  # fmt: skip
def test_a_size_flag_means_the_random_dataset(flags, dataset, num_prompts) -> None:
    args = build_parser().parse_args(["bench", "throughput", *flags])
    throughput.resolve_dataset(args)
    assert (args.dataset, args.num_prompts) == (dataset, num_prompts)


def test_sizes_with_the_nanovllm_dataset_are_refused() -> None:
    args = build_parser().parse_args(["bench", "throughput", "--dataset", "nanovllm",
                                      "--output-len", "5"])  # fmt: skip
    with pytest.raises(SystemExit, match="--output-len size the random dataset"):
        throughput.resolve_dataset(args)


def test_builtin_shape_directories_are_removed_at_exit(tmp_path) -> None:
    code = "from pagedlm.benchmarks.shapes import resolve_model; print(resolve_model('qwen3-0.6b'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    directory = done.stdout.strip()
    assert directory and not os.path.exists(directory)
