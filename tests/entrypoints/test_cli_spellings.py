"""Command lines written for vLLM parse here: long flags with underscores, counts such as
``32k``, ``--max-model-len auto``, and vLLM's short flags."""

from __future__ import annotations

import pytest

from pagedlm.engine.cli_args import engine_args_from_cli, human_readable_int
from pagedlm.engine.vllm_aliases import check_vllm_args
from pagedlm.entrypoints.cli.main import dashed_flags, parse_args


def test_underscored_flags_parse_and_values_keep_their_underscores() -> None:
    args = parse_args(
        ["serve", "my_model", "--max_model_len", "64", "--served_model_name=tiny_one",
         "--enable_prefix_caching", "--tool_call_parser", "hermes"]
    )  # fmt: skip
    engine = engine_args_from_cli(args)
    assert engine.model == "my_model" and engine.max_model_len == 64
    assert args.served_model_name == ["tiny_one"] and args.tool_call_parser == "hermes"


def test_nothing_after_a_bare_double_dash_is_rewritten() -> None:
    assert dashed_flags(["serve", "--max_num_seqs=2", "--", "--keep_me"]) == [
        "serve", "--max-num-seqs=2", "--", "--keep_me",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("32k", 32_000), ("25.6k", 25_600), ("16K", 16_384), ("1G", 2**30),
     ("1.5g", 1_500_000_000), ("2M", 2 * 2**20)],
)  # fmt: skip
def test_counts_take_vllms_suffixes(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_the_count_flags_take_suffixes_and_the_model_length_takes_auto() -> None:
    args = parse_args(
        ["serve", "m", "--max-model-len", "32K", "--max-num-batched-tokens", "8k",
         "--kv-cache-memory-bytes", "2G"]
    )  # fmt: skip
    assert (args.max_model_len, args.max_num_batched_tokens) == (32_768, 8_000)
    assert args.kv_cache_memory_bytes == 2 * 2**30
    for spelling in ("auto", "-1", "none"):
        assert parse_args(["serve", "m", "--max-model-len", spelling]).max_model_len is None


@pytest.mark.parametrize("text", ["1.5K", "12x", "k", "-3"])
def test_a_bad_count_names_the_flag(text: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--max-num-batched-tokens", text])
    assert "--max-num-batched-tokens" in capsys.readouterr().err


def test_vllms_short_flags() -> None:
    args = engine_args_from_cli(parse_args(["serve", "m", "-q", "fp8", "-ep", "-dpn", "1",
                                            "-dp", "2"]))  # fmt: skip
    assert args.quantization == "fp8" and args.enable_expert_parallel
    assert (args.data_parallel_size, args.data_parallel_rank) == (2, 1)


def test_dpr_is_vllms_start_rank_and_refused_but_for_zero() -> None:
    # vLLM's -dpr is --data-parallel-start-rank: taking it as the rank would run the wrong
    # replica without a word.
    args = engine_args_from_cli(parse_args(["serve", "m", "-dp", "2", "-dpr", "1"]))
    assert (args.data_parallel_start_rank, args.data_parallel_rank) == (1, 0)
    with pytest.raises(ValueError, match=r"data_parallel_start_rank=1 \(--data-parallel-start"):
        check_vllm_args(args)
    check_vllm_args(engine_args_from_cli(parse_args(["serve", "m", "-dpr", "0"])))


def test_server_switches_have_vllms_no_forms_and_the_host_defaults_to_every_interface() -> None:
    args = parse_args(["serve", "m", "--enable-log-requests", "--no-enable-log-requests",
                       "--no-enable-request-id-headers", "--enable-sleep-mode"])  # fmt: skip
    assert args.enable_log_requests is False and args.enable_request_id_headers is False
    assert args.enable_sleep_mode is True and args.return_tokens_as_token_ids is False
    assert args.host is None  # bound as 0.0.0.0, as vLLM binds it


def test_vllms_dotted_json_flags() -> None:
    """``-cc.key=value`` and ``--flag.key value`` build the flag's JSON object, nested on
    dots and merged over the flag's own JSON; values read as JSON where they parse."""
    args = engine_args_from_cli(
        parse_args(
            ["serve", "m", "-cc.cudagraph_mode=NONE", "-cc.cudagraph_capture_sizes", "[1, 2]",
             "--speculative-config", '{"method": "ngram"}',
             "--speculative-config.num_speculative_tokens=3", "--max-num-seqs", "4"]
        )
    )  # fmt: skip
    assert args.compilation_config == {"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2]}
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.max_num_seqs == 4
    args = engine_args_from_cli(
        parse_args(["serve", "m", "--hf-overrides.rope_scaling.factor", "2.0"])
    )
    assert args.hf_overrides == {"rope_scaling": {"factor": 2.0}}


def test_a_dotted_flag_without_a_value_is_an_error(capsys) -> None:
    with pytest.raises(SystemExit, match=r"-cc.cudagraph_mode needs a value"):
        parse_args(["serve", "m", "-cc.cudagraph_mode"])


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["serve", "--use-v2-block-manager"], "--use-v2-block-manager is vLLM's, which "
         "pagedlm does not take: removed in vLLM's V1 engine"),
        (["generate", "--num-scheduler-steps=8"], "--num-scheduler-steps is vLLM's"),
        (["serve", "--eplb-window-size", "8"], "pagedlm has no expert-parallel load balancer"),
        (["run-batch", "-i", "a", "-o", "b", "--speculative-model", "m"], "--speculative-config"),
        (["serve", "--device", "cpu"], "PAGEDLM_PLATFORM=cpu"),
        (["serve", "--max-model-length", "4096"], "--max-model-length: did you mean --max-model-len?"),
        (["bench", "latency", "--max-num-seqz", "4"], "did you mean --max-num-seqs?"),
    ],
)  # fmt: skip
def test_an_unknown_flag_names_the_fix(argv, hint, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: " in err and hint in err
