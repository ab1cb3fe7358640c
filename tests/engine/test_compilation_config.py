"""vLLM's compilation_config and optimization level (-cc, -O): which steps replay from CUDA
graphs, at which sizes. Resolution and refusals, the flags, and the CUDA platform's graph
runner on the CPU (graphs emulated, tests/spec_decode/triton_cpu.py) capturing what the
config says with the same tokens."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.config import CompilationConfig
from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli
from pagedlm.engine.compilation_args import resolve_compilation
from spec_decode.tiny_heads import write_llama

INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton under the interpreter: the CPU only (the GPU runs the kernels)",
)


@pytest.mark.parametrize(
    ("level", "mode"),
    [(0, "NONE"), (1, "PIECEWISE"), (2, "FULL_AND_PIECEWISE"), (3, "FULL_AND_PIECEWISE")],
)
def test_optimization_levels_give_vllms_graph_modes(level: int, mode: str) -> None:
    assert resolve_compilation(None, level).cudagraph_mode == mode


def test_the_config_wins_over_the_level_and_enforce_eager_over_both() -> None:
    assert resolve_compilation({"cudagraph_mode": "full_decode_only"}, 0).cudagraph_mode == (
        "FULL_DECODE_ONLY"
    )
    assert resolve_compilation({"cudagraph_mode": "FULL"}, 2, enforce_eager=True) == (
        CompilationConfig("NONE")
    )
    config = resolve_compilation('{"cudagraph_capture_sizes": [8, 1, 4, 4]}')
    assert config.cudagraph_capture_sizes == (1, 4, 8)
    assert config.cudagraph_mode == "FULL_AND_PIECEWISE"


def test_sizes_are_cut_at_the_platforms_bound() -> None:
    ladder = [1, 2, 4, 8, 16, 24, 32]
    assert CompilationConfig().sizes(ladder) == ladder
    assert CompilationConfig(max_cudagraph_capture_size=10).sizes(ladder) == [1, 2, 4, 8]
    assert CompilationConfig(cudagraph_capture_sizes=(3, 5, 64)).sizes(ladder) == [3, 5]
    assert CompilationConfig().sizes([]) == []


def test_the_compile_mode_is_accepted_and_logged(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedlm.engine.compilation_args"):
        assert resolve_compilation({"mode": 3}).cudagraph_mode == "FULL_AND_PIECEWISE"
        resolve_compilation(3)  # vLLM's older integer form
    assert sum("VLLM_COMPILE has no effect" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(
    ("value", "level", "match"),
    [
        ({"pass_config": {}}, 2, r"\['pass_config'\] are not supported.*drop the others"),
        ({"cudagraph_mode": "ALL"}, 2, "cudagraph_mode='ALL' is unknown; use one of NONE"),
        ({"cudagraph_capture_sizes": [1, 0]}, 2, "must be positive integers"),
        ({"cudagraph_capture_sizes": 8}, 2, "must be a list of positive integers"),
        ({"max_cudagraph_capture_size": -1}, 2, "must be a positive integer"),
        ({"mode": "FAST"}, 2, "mode='FAST' is unknown"),
        ("{not json", 2, "not valid JSON"),
        ("[1, 2]", 2, "must be a JSON object"),
        (None, 4, r"optimization_level must be 0, 1, 2 or 3 \(-O0 .. -O3\)"),
    ],
)
def test_refusals_name_the_fix(value, level, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_compilation(value, level)


def test_the_flags() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_cli(parser.parse_args(["-O0"]))
    assert args.optimization_level == 0
    args = engine_args_from_cli(parser.parse_args(["-cc", '{"cudagraph_mode": "PIECEWISE"}']))
    assert args.compilation_config == {"cudagraph_mode": "PIECEWISE"}
    args = engine_args_from_cli(parser.parse_args([]))
    assert (args.optimization_level, args.compilation_config) == (2, None)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(write_llama(tmp_path_factory.mktemp("compilation") / "llama", 1, seed=0))


def _run(target: str, **kwargs):
    """Greedy tokens on the CUDA platform's step path (graphs emulated), and the graph
    runner it captured (None: none)."""
    from spec_decode.triton_cpu import NAME, triton_cpu_platform

    with triton_cpu_platform() as platform:
        llm = LLM(
            target,
            platform=NAME,
            skip_tokenizer_init=True,
            max_model_len=64,
            max_num_seqs=4,
            block_size=16,
            num_kv_blocks=16,
            dtype="float32",
            **kwargs,
        )
        prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9] * 11, [3, 1, 4, 1, 5])]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        runners = list(platform.graph_runners)
    return [o.outputs[0].token_ids for o in outputs], (runners[0] if runners else None)


@INTERPRETER_ONLY
def test_graph_modes_and_sizes_on_the_step_path(target) -> None:
    tokens, runner = _run(target)  # the default: the ladder up to max_num_seqs
    assert runner is not None and runner.sizes == [1, 2, 4] and runner.num_replays(1) > 0
    eager, runner = _run(target, optimization_level=0)
    assert runner is None and eager == tokens
    sized, runner = _run(target, compilation_config={"cudagraph_capture_sizes": [2, 8]})
    assert runner.sizes == [2] and sized == tokens  # 8 > max_num_seqs: dropped
    capped, runner = _run(target, compilation_config='{"max_cudagraph_capture_size": 1}')
    assert runner.sizes == [1] and capped == tokens
    # Piecewise only: no whole-step graphs (the emulation captures no pieces).
    piecewise, runner = _run(target, compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert runner is None and piecewise == tokens
