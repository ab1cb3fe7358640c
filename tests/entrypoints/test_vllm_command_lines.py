"""vLLM command lines run under ``pagedlm serve`` unchanged: every current vLLM flag
parses; vLLM's defaults pass silently; a flag without a mechanism here is logged as having
no effect, taken as its replacement (vLLM's deprecated ones), or refused at start naming
the fix when its value would select something pagedlm does not have. Parse-only, no model
loads (except the one test that resolves a tiny checkpoint's config)."""

from __future__ import annotations

import dataclasses
import logging
import shlex
import typing
from types import SimpleNamespace

import pytest

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import HELP_GROUPS, engine_args_from_cli
from pagedlm.engine.compilation_args import resolve_compilation
from pagedlm.engine.vllm_aliases import check_vllm_args, resolve_vllm_args
from pagedlm.engine.vllm_compat_args import (
    DEPRECATED,
    IGNORED,
    UNSUPPORTED,
    VLLM_ONLY,
    VllmCompatArgs,
    is_silent,
)
from pagedlm.entrypoints.cli.main import build_parser, parse_args
from pagedlm.entrypoints.openai.server_args import check_serving_args
from pagedlm.entrypoints.openai.vllm_server_args import check_vllm_server_args

VLLM_SERVE = shlex.split("""serve Qwen/Qwen2.5-1.5B-Instruct --host 0.0.0.0 --port 8000 --disable-log-requests
--enable-log-requests --disable-log-stats --uvicorn-log-level warning --swap-space 16
--enable-chunked-prefill --no-enable-prefix-caching --tokenizer-mode auto --trust-remote-code
--download-dir /tmp/hf --load-format auto --max-num-seqs 128 --block-size 16
--guided-decoding-backend xgrammar -O3 --enforce-eager --kv-cache-dtype auto
--served-model-name qwen qwen-small --chat-template '{{ messages }}' --response-role assistant
--api-key k1 --ssl-keyfile k.pem --ssl-certfile c.pem --ssl-ca-certs ca.pem --ssl-cert-reqs 0
--allowed-origins '["*"]' --root-path /v1-proxy --middleware my.module:Middleware
--tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser deepseek_r1 --seed 0
--max-logprobs 20 --generation-config vllm --override-generation-config '{"temperature": 0.5}'
--limit-mm-per-prompt '{"image": 2}' --mm-processor-kwargs '{"max_pixels": 802816}'
--hf-overrides '{"max_position_embeddings": 4096}' --quantization fp8 --dtype bfloat16
--gpu-memory-utilization 0.85 --max-model-len 32k --tensor-parallel-size 2
--pipeline-parallel-size 1 --data-parallel-size 1 --distributed-executor-backend mp
--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' --max-num-batched-tokens 8192
--disable-custom-all-reduce --api-server-count 1 --cudagraph-capture-sizes 1 2 4 8""")


def test_a_realistic_vllm_serve_command_line_parses_end_to_end(caplog) -> None:
    args = parse_args(VLLM_SERVE)
    check_serving_args(args)
    check_vllm_server_args(args)
    with caplog.at_level(logging.WARNING):
        engine = resolve_vllm_args(engine_args_from_cli(args))
    assert engine.model == "Qwen/Qwen2.5-1.5B-Instruct" and engine.max_model_len == 32_000
    assert (engine.tensor_parallel_size, engine.distributed_executor_backend) == (2, "mp")
    assert engine.enable_prefix_caching is False and engine.trust_remote_code is True
    assert (engine.optimization_level, engine.enforce_eager, engine.quantization) == (
        3,
        True,
        "fp8",
    )
    # --reasoning-parser reaches the engine too: its grammars start after the thought.
    assert engine.structured_outputs_config == {
        "backend": "xgrammar",
        "reasoning_parser": "deepseek_r1",
    }
    assert engine.guided_decoding_backend is None  # moved, so it is not applied twice
    assert engine.cudagraph_capture_sizes == [1, 2, 4, 8] and engine.disable_log_stats is True
    assert args.served_model_name == ["qwen", "qwen-small"] and args.api_key == ["k1"]
    assert args.enable_log_requests is True and args.uvicorn_log_level == "warning"
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "deepseek_r1")
    # The only notes: the deprecated spelling, and the swap space that has no use here.
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2, notes
    assert "--guided-decoding-* flags are deprecated" in notes[0]
    assert "swap_space=16.0 (--swap-space) has no effect in pagedlm" in notes[1]


def test_every_current_vllm_flag_parses() -> None:
    flags = {flag for action in _serve_parser()._actions for flag in action.option_strings}
    vllm_only = {"--" + name.replace("_", "-") for name in VLLM_ONLY}
    assert vllm_only <= flags
    for short in ("-q", "-tp", "-pp", "-dp", "-dpn", "-ep", "-O", "-cc", "-ac", "-dcp", "-pcp",
                  "-dpr", "-dpl", "-dpa", "-dpp", "-dpb", "-dph", "-dpe", "-n", "-r", "-asc"):  # fmt: skip
        assert short in flags, short


def _serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]


DEFAULTS_SPELLED_OUT = shlex.split("""serve m --convert auto --config-format auto --safetensors-load-strategy lazy
--use-tqdm-on-load --pt-load-map-location cpu --ignore-patterns 'original/**/*' --nnodes 1
--node-rank 0 --master-addr 127.0.0.1 --master-port 29501 -dcp 1 -pcp 1 -dpb mp
--no-data-parallel-hybrid-lb --no-enable-dbo --dbo-decode-token-threshold 32
--dbo-prefill-token-threshold 512 --no-enable-eplb --expert-placement-strategy linear
--worker-cls auto --swap-space 4 --prefix-caching-hash-algo sha256 --no-kv-sharing-fast-prefill
--mamba-cache-dtype auto --mamba-ssm-cache-dtype auto --mamba-cache-mode none
--no-enable-mm-embeds --mm-processor-cache-gb 4 --mm-processor-cache-type lru
--mm-shm-cache-max-object-size-mb 128 --mm-encoder-tp-mode weights --lora-dtype auto
--no-fully-sharded-loras --kv-cache-metrics-sample 0.01 --max-num-partial-prefills 1
--max-long-partial-prefills 1 --model-loader-extra-config {} --media-io-kwargs {}
--additional-config {} --attention-config {} --disable-cascade-attn
--disable-hybrid-kv-cache-manager --mm-processor-cache-gb 0 --video-pruning-rate 0
--scheduler-cls vllm.v1.core.sched.scheduler.Scheduler -dpl 2 -dp 2 -dpr 0 -asc 1
--h11-max-header-count 256 --no-headless --no-tokens-only""")


def test_vllms_defaults_spelled_out_pass_without_a_word(caplog) -> None:
    args = parse_args(DEFAULTS_SPELLED_OUT)
    with caplog.at_level(logging.WARNING):
        check_vllm_server_args(args)
        check_vllm_args(engine_args_from_cli(args))
    assert caplog.records == []


def _other_value(name: str):
    """A value of the field ``name`` that is not one of its silent ones (None: every value
    is, as for a switch that turns off what pagedlm does not have)."""
    kind = typing.get_type_hints(EngineArgs)[name]
    default = {f.name: f.default for f in dataclasses.fields(EngineArgs)}[name]
    options = [True, 7, 0.5, "something-else", {"key": 1}, ["x"]]
    types = [a for a in typing.get_args(kind) or (kind,) if a is not type(None)]
    for value in options:
        fits = any(
            (t is bool and isinstance(value, bool))
            or (t in (int, float) and type(value) in (int, float) and t is not bool)
            or (t is str and isinstance(value, str))
            or (typing.get_origin(t) in (dict, list) and isinstance(value, typing.get_origin(t)))
            for t in types
        )
        if fits and value != default and not is_silent(name, value):
            return value
    return None


UNSUPPORTED_FIELDS = sorted(n for n, s in VLLM_ONLY.items() if s.kind == UNSUPPORTED)
IGNORED_FIELDS = sorted(
    n for n, s in VLLM_ONLY.items() if s.kind == IGNORED and _other_value(n) is not None
)


@pytest.mark.parametrize("name", UNSUPPORTED_FIELDS)
def test_an_unsupported_value_is_refused_naming_the_flag_and_the_fix(name: str) -> None:
    value = _other_value(name)
    args = EngineArgs(model="m", enable_lora=True, **{name: value})
    with pytest.raises(ValueError) as error:
        check_vllm_args(args)
    message = str(error.value)
    flag = "--" + name.replace("_", "-")
    assert f"{name}={value!r} ({flag}) is vLLM's, and pagedlm does not support it" in message
    assert VLLM_ONLY[name].fix in message


@pytest.mark.parametrize("name", IGNORED_FIELDS)
def test_an_ignored_value_is_taken_and_logged_as_having_no_effect(name: str, caplog) -> None:
    value = _other_value(name)
    with caplog.at_level(logging.WARNING):
        check_vllm_args(EngineArgs(model="m", **{name: value}))
    assert f"{name}={value!r}" in caplog.text and "has no effect in pagedlm" in caplog.text


def test_no_note_when_asked_for_none(caplog) -> None:
    # The engine-core process resolves the same arguments again, quietly.
    with caplog.at_level(logging.WARNING):
        resolve_vllm_args(EngineArgs(model="m", swap_space=8, task="embed"), warn=False)
    assert caplog.records == []


def test_every_field_has_one_help_group_and_vllm_fields_a_verdict() -> None:
    compat = {f.name for f in dataclasses.fields(VllmCompatArgs)}
    assert set(VLLM_ONLY) == compat
    own = [n for names in HELP_GROUPS.values() for n in names]
    assert len(own) == len(set(own)) and not set(own) & compat
    assert set(own) | compat == EngineArgs.field_names()
    assert {spec.kind for spec in VLLM_ONLY.values()} == {IGNORED, DEPRECATED, UNSUPPORTED}


def test_help_is_grouped_as_vllms(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for title in ("ModelConfig:", "LoadConfig:", "ParallelConfig:", "CacheConfig:",
                  "SchedulerConfig:", "VllmConfig:"):  # fmt: skip
        assert title in text, title
    cache = text[text.index("CacheConfig:") : text.index("MultiModalConfig:")]
    assert "--swap-space" in cache and "--block-size" in cache


# vLLM's deprecated spellings, taken as what replaced them


@pytest.mark.parametrize(
    ("flags", "config"),
    [
        (["--guided-decoding-backend", "outlines"], {"backend": "outlines"}),
        (["--guided-decoding-disable-fallback"], {"disable_fallback": True}),
        (["--guided-decoding-disable-any-whitespace", "true"], {"disable_any_whitespace": True}),
        (["--guided-decoding-disable-additional-properties", "False"],
         {"disable_additional_properties": False}),
        (["--guided-decoding-backend", "xgrammar", "--structured-outputs-config",
          '{"disable_any_whitespace": true}'],
         {"disable_any_whitespace": True, "backend": "xgrammar"}),
    ],
)  # fmt: skip
def test_guided_decoding_flags_become_structured_outputs_config(flags, config) -> None:
    engine = resolve_vllm_args(engine_args_from_cli(parse_args(["serve", "m", *flags])))
    assert engine.structured_outputs_config == config


def test_guided_decoding_given_twice_differently_is_refused() -> None:
    args = EngineArgs(
        "m", guided_decoding_backend="outlines", structured_outputs_config={"backend": "xgrammar"}
    )
    with pytest.raises(ValueError, match=r"structured_outputs_config.backend is given twice"):
        resolve_vllm_args(args)
    with pytest.raises(ValueError, match="takes true or false"):
        resolve_vllm_args(EngineArgs("m", guided_decoding_disable_fallback="maybe"))


@pytest.mark.parametrize(
    ("task", "runner"), [("generate", "generate"), ("embed", "pooling"), ("auto", "auto")]
)
def test_task_is_taken_as_the_runner(task: str, runner: str) -> None:
    assert resolve_vllm_args(EngineArgs("m", task=task)).runner == runner
    with pytest.raises(ValueError, match=r"task='embed' .* means runner='pooling'"):
        resolve_vllm_args(EngineArgs("m", task="embed", runner="generate"))
    with pytest.raises(ValueError, match=r"task='draft' .* is unknown"):
        resolve_vllm_args(EngineArgs("m", task="draft"))


def test_rope_flags_and_the_old_pooler_name_move_to_their_replacements() -> None:
    args = EngineArgs(
        "m",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=5e5,
        hf_overrides={"max_position_embeddings": 64},
        override_pooler_config={"normalize": False},
        cuda_graph_sizes=[1, 2],
    )
    engine = resolve_vllm_args(args)
    assert engine.hf_overrides == {
        "max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_theta": 5e5,
    }
    assert (engine.rope_scaling, engine.rope_theta, engine.override_pooler_config) == (None,) * 3
    assert engine.pooler_config == {"normalize": False}
    assert engine.cudagraph_capture_sizes == [1, 2] and engine.cuda_graph_sizes is None
    with pytest.raises(ValueError, match="rope_theta is given twice"):
        resolve_vllm_args(EngineArgs("m", rope_theta=1.0, hf_overrides={"rope_theta": 2.0}))


def test_vllms_load_formats() -> None:
    bnb = EngineArgs("m", load_format="bitsandbytes", quantization="bitsandbytes")
    assert resolve_vllm_args(bnb).load_format == "auto"
    with pytest.raises(ValueError, match="add --quantization bitsandbytes"):
        resolve_vllm_args(EngineArgs("m", load_format="bitsandbytes"))
    args = engine_args_from_cli(parse_args(["serve", "m", "--load-format", "npcache"]))
    with pytest.raises(ValueError, match=r"load_format='npcache' .* use --load-format pt"):
        resolve_vllm_args(args)


def test_lora_dtype_is_accepted_where_it_is_the_models() -> None:
    check_vllm_args(EngineArgs("m", lora_dtype="bfloat16"))  # without LoRA vLLM reads none
    check_vllm_args(EngineArgs("m", enable_lora=True, dtype="bfloat16", lora_dtype="bf16"))
    with pytest.raises(ValueError, match=r"lora_dtype='float16' \(--lora-dtype\)"):
        check_vllm_args(EngineArgs("m", enable_lora=True, dtype="bfloat16", lora_dtype="float16"))


def test_a_negative_swap_space_is_refused() -> None:
    with pytest.raises(ValueError, match="swap_space must be a number of GiB >= 0"):
        check_vllm_args(EngineArgs("m", swap_space=-1))


# vLLM's graph-size flags, acting


def test_capture_size_flags_reach_the_compilation_config() -> None:
    config = resolve_compilation(None, capture_sizes=[8, 1, 2], max_capture_size=8)
    assert config.cudagraph_capture_sizes == (1, 2, 8) and config.max_cudagraph_capture_size == 8
    merged = resolve_compilation('{"cudagraph_mode": "NONE"}', capture_sizes=[4])
    assert (merged.cudagraph_mode, merged.cudagraph_capture_sizes) == ("NONE", (4,))
    with pytest.raises(ValueError, match="cudagraph_capture_sizes is given twice"):
        resolve_compilation({"cudagraph_capture_sizes": [1]}, capture_sizes=[2])


def test_vllm_arguments_resolve_into_a_tiny_models_config(tiny_checkpoint, caplog) -> None:
    args = EngineArgs(
        str(tiny_checkpoint("llama")),
        platform="cpu",
        skip_tokenizer_init=True,
        swap_space=8,
        task="generate",
        guided_decoding_backend="outlines",
        rope_theta=5000.0,
        cuda_graph_sizes=[1, 2],
        max_cudagraph_capture_size=2,
        disable_log_stats=True,
    )
    with caplog.at_level(logging.WARNING):
        config, _ = args.create_engine_config()
    assert config.structured_outputs_backend == "outlines" and config.model.runner == "generate"
    assert config.model.arch.raw["rope_theta"] == 5000.0
    assert config.compilation.cudagraph_capture_sizes == (1, 2)
    assert config.compilation.max_cudagraph_capture_size == 2
    assert "--task is deprecated in vLLM" in caplog.text and "swap_space=8" in caplog.text
    with pytest.raises(ValueError, match=r"enable_dbo=True \(--enable-dbo\)"):
        EngineArgs(
            str(tiny_checkpoint("llama")), platform="cpu", enable_dbo=True
        ).create_engine_config()


# vLLM's server flags


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--headless"], "--headless is vLLM's, and pagedlm does not support it"),
        (["-asc", "2"], "--api-server-count 2 is vLLM's.* one API server process serves"),
        (["--enable-ssl-refresh"], "restart the server after renewing the certificate"),
        (["--tool-server", "demo"], "no built-in tool servers"),
        (["--tokens-only"], "no tokens-only serving mode"),
    ],
)
def test_unsupported_server_flags_exit_naming_the_fix(flags, message) -> None:
    args = parse_args(["serve", "m", *flags])
    with pytest.raises(SystemExit, match=message):
        check_vllm_server_args(args)


def test_disable_log_requests_is_vllms_deprecated_no_op(caplog) -> None:
    from pagedlm.entrypoints.openai.api_server import serving_context

    engine = SimpleNamespace(
        config=SimpleNamespace(
            lora=None,
            model=SimpleNamespace(max_model_len=64, runner="generate", sampling_defaults={}),
            structured_outputs_backend="xgrammar",
            structured_outputs_reasoning=None,
        ),
        get_tokenizer=lambda: None,
    )
    for flags, logged in (
        (["--enable-log-requests", "--disable-log-requests"], True),  # vLLM logs them
        (["--disable-log-requests"], False),
        (["--no-disable-log-requests"], False),  # deprecated: only warned about
    ):
        args = parse_args(["serve", "m", *flags])
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            limits = check_serving_args(args)
        assert serving_context(args, engine, ["m"], limits, None).log_requests is logged
        deprecated = "argument 'disable_log_requests' is deprecated" in caplog.text
        assert deprecated is (flags == ["--no-disable-log-requests"])


def test_llm_takes_vllms_engine_keywords() -> None:
    for name in ("swap_space", "disable_log_stats", "task", "guided_decoding_backend",
                 "disable_custom_all_reduce", "cudagraph_capture_sizes", "enable_dbo"):  # fmt: skip
        assert name in EngineArgs.field_names(), name


def test_the_docs_table_lists_every_vllm_only_flag() -> None:
    from pathlib import Path

    table = (Path(__file__).parents[2] / "docs" / "vllm_flags.md").read_text()
    for name in VLLM_ONLY:
        assert f"| `--{name.replace('_', '-')}`" in table, name
