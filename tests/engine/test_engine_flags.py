"""enforce_eager and gpu_memory_utilization: EngineArgs fields with vLLM's names and
defaults, generated CLI flags, validated at the edge, carried in the frozen config."""

from __future__ import annotations

import math

import pytest

from pagedlm import LLM
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.entrypoints.cli.main import build_parser
from pagedlm_cuda.platform import CudaPlatform


def test_defaults_are_vllms() -> None:
    args = EngineArgs()
    assert args.enforce_eager is False
    assert args.gpu_memory_utilization == 0.9


def test_serve_flags_parse_to_engine_args() -> None:
    parser = build_parser()
    defaults = engine_args_from_cli(parser.parse_args(["serve"]))
    assert (defaults.enforce_eager, defaults.gpu_memory_utilization) == (False, 0.9)
    args = engine_args_from_cli(
        parser.parse_args(["serve", "--enforce-eager", "--gpu-memory-utilization", "0.55"])
    )
    assert args.enforce_eager is True
    assert args.gpu_memory_utilization == 0.55
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--gpu-memory-utilization", "most"])


def test_flag_help_says_cpu_ignores_the_fraction(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--gpu-memory-utilization" in help_text
    assert "CPU platforms accept and ignore it" in help_text
    assert "--enforce-eager, --no-enforce-eager" in help_text


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, 90, math.nan, math.inf])
def test_bad_fraction_is_rejected_naming_the_flag(value: float) -> None:
    # Validation comes before the model is resolved: no model is needed to fail.
    with pytest.raises(ValueError, match=r"gpu_memory_utilization.*\(0, 1\].*--gpu-memory-util"):
        EngineArgs(model="/nonexistent", gpu_memory_utilization=value).create_engine_config()


def test_config_carries_the_values_and_cuda_platform_reads_them(tiny_checkpoint) -> None:
    args = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.25,
        platform="cpu",  # a CPU platform accepts and ignores the fraction
    )
    config, platform = args.create_engine_config()
    assert config.model.enforce_eager is True
    assert config.cache.gpu_memory_utilization == 0.25
    assert platform.name == "cpu"
    cuda = CudaPlatform()  # constructing it needs no GPU
    assert cuda.gpu_memory_utilization == 0.9
    cuda.bind_config(config)
    assert cuda.gpu_memory_utilization == 0.25


def test_llm_kwargs_reach_the_config(tiny_checkpoint) -> None:
    llm = LLM(
        str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=8,
        max_model_len=64,
        enforce_eager=True,
        gpu_memory_utilization=1.0,
    )
    config = llm.llm_engine.config
    assert config.model.enforce_eager is True
    assert config.cache.gpu_memory_utilization == 1.0
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        LLM(str(tiny_checkpoint("llama")), gpu_memory_utilization=1.5)


def test_per_parser_defaults_must_name_engine_fields() -> None:
    import argparse

    from pagedlm.engine.cli_args import add_engine_args

    with pytest.raises(ValueError, match="no_such_field"):
        add_engine_args(argparse.ArgumentParser(), defaults={"no_such_field": 1})


def test_disable_sliding_window_caps_the_context_at_the_window(tmp_path) -> None:
    """vLLM's flag: the context stops at the window, where sliding and full attention
    agree; a longer max_model_len names the flag; a model without a window ignores it."""
    from tiny_checkpoints import save_random_model

    save_random_model(tmp_path / "mistral", "MistralConfig", {"sliding_window": 48})
    save_random_model(tmp_path / "llama", "LlamaConfig", {})

    def max_len(path, **kwargs) -> int:
        args = EngineArgs(model=str(path), load_format="dummy", **kwargs)
        return args.create_engine_config()[0].model.max_model_len

    assert max_len(tmp_path / "mistral") == 128
    assert max_len(tmp_path / "mistral", disable_sliding_window=True) == 48
    assert max_len(tmp_path / "llama", disable_sliding_window=True) == 128
    with pytest.raises(ValueError, match="with disable_sliding_window, the sliding window"):
        max_len(tmp_path / "mistral", disable_sliding_window=True, max_model_len=64)
    args = engine_args_from_cli(build_parser().parse_args(["serve", "--disable-sliding-window"]))
    assert args.disable_sliding_window is True


def test_stream_interval_reaches_the_output_processor(tiny_checkpoint) -> None:
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.sampling_params import RequestOutputKind, SamplingParams

    args = engine_args_from_cli(build_parser().parse_args(["serve", "--stream-interval", "4"]))
    assert args.stream_interval == 4 and EngineArgs().stream_interval == 1  # vLLM's default
    engine = LLMEngine.from_engine_args(
        EngineArgs(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=8,
                   max_model_len=64, stream_interval=4)
    )  # fmt: skip
    params = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, params)
    sizes = []
    while engine.has_unfinished_requests():
        sizes += [len(out.outputs[0].token_ids) for out in engine.step()]
    assert sizes == [1, 4, 4, 1], sizes  # the first token, every 4, the rest when finished
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineArgs(str(tiny_checkpoint("llama")), stream_interval=bad).create_engine_config()


def test_num_gpu_blocks_override_is_vllms_name_for_num_kv_blocks() -> None:
    args = EngineArgs(model="unused", num_gpu_blocks_override=12)
    assert args._num_kv_blocks() == 12
    assert (
        EngineArgs(model="unused", num_kv_blocks=12, num_gpu_blocks_override=12)._num_kv_blocks()
        == 12
    )
    with pytest.raises(ValueError, match="num_kv_blocks=8 and num_gpu_blocks_override=12 disagree"):
        EngineArgs(model="unused", num_kv_blocks=8, num_gpu_blocks_override=12)._num_kv_blocks()
    parsed = build_parser().parse_args(["serve", "m", "--num-gpu-blocks-override", "7"])
    assert engine_args_from_cli(parsed).num_gpu_blocks_override == 7
