"""What offloading KV to host memory buys: multi-turn conversations whose histories do not
all fit the device's KV cache, run without a second tier (``device-only``), with
``--kv-offloading-size`` (``offloading``) and optionally with the shared-storage connector
(``shared-storage``, one file per block in a temporary directory).

Each conversation opens with its own ``--prefix-len`` tokens (a document, a system
prompt); every turn appends a ``--question-len``-token question, asks for
``--output-len`` greedy tokens and appends the answer, so the next turn's prompt is the
whole history. Turns go round-robin over the conversations, one request at a time (a
request's time to first token is its own prefill, and load, with no queueing): once the
conversations hold more blocks than ``--num-kv-blocks``, the device cache has given a
conversation's blocks to the others before its next turn, and only a second tier saves
computing them again. Every mode runs the same prompts; the runs are interleaved over
``--repeats`` (new prompts each repeat, caches reset before each run) and the medians
reported, with each run's total and the load average, so machine noise shows. The greedy
tokens of every run must be identical (exit status 1 if not)::

    python -m pagedlm.benchmarks.kv_offloading --model qwen3-0.6b --conversations 4 \\
        --turns 3 --prefix-len 384 --num-kv-blocks 64 --kv-offloading-size 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from pagedlm.benchmarks.cli import bench_parser
from pagedlm.benchmarks.common import BENCH_ENGINE_DEFAULTS
from pagedlm.benchmarks.latency import percentile
from pagedlm.benchmarks.shapes import BUILTIN_SHAPES, resolve_model
from pagedlm.engine import cli_args
from pagedlm.engine.arg_utils import EngineArgs

MODES = ("device-only", "offloading", "shared-storage")

ENGINE_DEFAULTS: dict[str, Any] = {
    **BENCH_ENGINE_DEFAULTS,
    "max_model_len": 1024,
    "block_size": 16,
    # 1024 tokens of device cache: two of the default conversations' final histories.
    "num_kv_blocks": 64,
    "enable_prefix_caching": True,
    "kv_offloading_size": 0.5,
}
"""The benchmark engine defaults, with a device cache too small for the default workload
(four conversations of ~450 tokens each) and a host pool large enough for all of it."""


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    prefix_len: int
    question_len: int
    output_len: int

    @property
    def last_prompt_len(self) -> int:
        return self.prefix_len + self.turns * self.question_len + (self.turns - 1) * self.output_len

    @property
    def history_tokens(self) -> int:
        """Every conversation's tokens after its last answer: what a cache holding them all
        would hold."""
        return self.conversations * (self.last_prompt_len + self.output_len)

    def prompts(self, seed: int, vocab_size: int) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Random ``(prefixes, questions)``: ``prefixes[c]`` opens conversation ``c`` and
        ``questions[t][c]`` is its turn ``t``; the same for the same seed."""
        rng = random.Random(seed)

        def tokens(count: int) -> list[int]:
            return [rng.randrange(vocab_size) for _ in range(count)]

        prefixes = [tokens(self.prefix_len) for _ in range(self.conversations)]
        questions = [
            [tokens(self.question_len) for _ in range(self.conversations)]
            for _ in range(self.turns)
        ]
        return prefixes, questions


@dataclass(frozen=True)
class Run:
    """One mode's run of one repeat's conversations."""

    seconds: float
    time_to_first_token: list[list[float]]
    """Seconds, ``[turn][conversation]``."""
    prompt_tokens: int
    cached_tokens: int
    """Sum of ``RequestOutput.num_cached_tokens``: device prefix-cache hits plus loaded."""
    loaded_tokens: int
    """The scheduler's ``external.num_loaded_tokens`` over the run (0 without a connector)."""
    failed_tokens: int
    token_ids: list[list[int]]
    """Every request's greedy tokens, in the order sent."""
    load_average: float


def converse(llm, workload: Workload, seed: int) -> Run:
    """Run the conversations of ``seed`` on ``llm`` from cold caches, turn by turn."""
    from pagedlm import SamplingParams

    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    vocab_size = llm.llm_engine.config.model.arch.vocab_size
    histories, questions = workload.prompts(seed, vocab_size)
    if not llm.reset_prefix_cache():  # the host pool goes with it
        raise RuntimeError("The prefix cache could not be reset: a request still holds KV.")
    external = llm.llm_engine.engine_core.scheduler.external
    loaded_before = external.num_loaded_tokens if external is not None else 0
    failed_before = external.num_failed_tokens if external is not None else 0
    ttfts: list[list[float]] = []
    token_ids: list[list[int]] = []
    prompt_tokens = cached_tokens = 0
    started = time.perf_counter()
    for turn_questions in questions:
        ttfts.append([])
        for history, question in zip(histories, turn_questions, strict=True):
            history.extend(question)
            (output,) = llm.generate([{"prompt_token_ids": list(history)}], params, use_tqdm=False)
            answer = list(output.outputs[0].token_ids)
            history.extend(answer)
            token_ids.append(answer)
            ttfts[-1].append(output.metrics["time_to_first_token"])
            prompt_tokens += len(output.prompt_token_ids)
            cached_tokens += output.num_cached_tokens
    seconds = time.perf_counter() - started
    return Run(
        seconds=seconds,
        time_to_first_token=ttfts,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        loaded_tokens=(external.num_loaded_tokens - loaded_before) if external else 0,
        failed_tokens=(external.num_failed_tokens - failed_before) if external else 0,
        token_ids=token_ids,
        load_average=os.getloadavg()[0],
    )


def mode_engine_args(mode: str, base: EngineArgs, storage_path: str) -> EngineArgs:
    """``base`` with the second tier of ``mode``."""
    if mode == "offloading":
        return base
    if mode == "device-only":
        return dataclasses.replace(base, kv_offloading_size=None)
    transfer = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    return dataclasses.replace(base, kv_offloading_size=None, kv_transfer_config=transfer)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """The medians over repeats of each run's figures, and every run's total."""

    def median(figure) -> float:
        return statistics.median(figure(run) for run in runs)

    def flat(run: Run) -> list[float]:
        return [ttft for turn in run.time_to_first_token for ttft in turn]

    turns = range(len(runs[0].time_to_first_token))
    return {
        "total_s": round(median(lambda run: run.seconds), 3),
        "ttft_mean_s": round(median(lambda run: statistics.mean(flat(run))), 4),
        "ttft_p90_s": round(median(lambda run: percentile(flat(run), 90)), 4),
        "ttft_mean_by_turn_s": [
            round(median(lambda run, t=t: statistics.mean(run.time_to_first_token[t])), 4)
            for t in turns
        ],
        "prompt_tokens": int(median(lambda run: run.prompt_tokens)),
        "computed_prompt_tokens": int(median(lambda run: run.prompt_tokens - run.cached_tokens)),
        "cached_tokens": int(median(lambda run: run.cached_tokens)),
        "loaded_tokens": int(median(lambda run: run.loaded_tokens)),
        "failed_load_tokens": int(median(lambda run: run.failed_tokens)),
        "total_s_runs": [round(run.seconds, 3) for run in runs],
        "load_averages": [round(run.load_average, 2) for run in runs],
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Workload, list[str]]:
    parser = bench_parser(__doc__)
    cli_args.add_engine_args(
        parser,
        defaults=ENGINE_DEFAULTS,
        help_texts={
            "model": f"A built-in shape ({', '.join(BUILTIN_SHAPES)}; no download) or a model "
            "directory.",
            "kv_offloading_size": "GiB of host memory for the offloading mode's pool.",
        },
    )
    group = parser.add_argument_group("benchmark arguments")
    group.add_argument("--conversations", type=int, default=4, help="(default: %(default)s)")
    group.add_argument("--turns", type=int, default=3, help="(default: %(default)s)")
    group.add_argument("--prefix-len", type=int, default=384, help="(default: %(default)s)")
    group.add_argument("--question-len", type=int, default=16, help="(default: %(default)s)")
    group.add_argument("--output-len", type=int, default=4, help="(default: %(default)s)")
    group.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    group.add_argument(
        "--modes",
        default="device-only,offloading",
        help=f"comma-separated, of {', '.join(MODES)} (default: %(default)s)",
    )
    group.add_argument("--output-json", default=None, help="where the figures go")
    args = parser.parse_args(argv)
    workload = Workload(
        args.conversations, args.turns, args.prefix_len, args.question_len, args.output_len
    )
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    check(parser, args, workload, modes)
    return args, workload, modes


def check(parser, args: argparse.Namespace, workload: Workload, modes: list[str]) -> None:
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or len(set(modes)) < 2 or len(set(modes)) != len(modes):
        parser.error(f"--modes {args.modes!r}: name two or more of {', '.join(MODES)}, once each.")
    if args.kv_transfer_config is not None:
        parser.error("--kv-transfer-config: each mode sets its own connector; leave it out.")
    if "offloading" in modes and not args.kv_offloading_size:
        parser.error("the offloading mode needs a pool: give --kv-offloading-size (GiB).")
    sizes = dataclasses.astuple(workload)
    if min(sizes) < 1 or args.repeats < 1:
        parser.error("--conversations, --turns, --*-len and --repeats must be 1 or more.")
    needed = workload.last_prompt_len + workload.output_len
    if args.max_model_len not in (None, "auto", -1) and needed > int(args.max_model_len):
        parser.error(
            f"the last turn needs {needed} tokens but --max-model-len is {args.max_model_len}; "
            "raise it or shorten --prefix-len, --turns, --question-len or --output-len."
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from pagedlm import LLM

    args, workload, modes = parse_args(argv)
    base = cli_args.engine_args_from_cli(args)
    base = dataclasses.replace(base, model=resolve_model(base.model or ENGINE_DEFAULTS["model"]))
    storage_path = tempfile.mkdtemp(prefix="pagedlm-kv-storage-")
    engines = {
        mode: LLM(**dataclasses.asdict(mode_engine_args(mode, base, storage_path)))
        for mode in modes
    }
    try:
        for llm in engines.values():  # first calls and kernel choices out of the timed runs
            converse(llm, dataclasses.replace(workload, conversations=1, turns=2), seed=-1)
        runs: dict[str, list[Run]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode, llm in engines.items():
                runs[mode].append(converse(llm, workload, seed=repeat))
    finally:
        for llm in engines.values():
            llm.llm_engine.shutdown()
        shutil.rmtree(storage_path, ignore_errors=True)
    device_tokens = (args.num_kv_blocks or 0) * args.block_size
    figures: dict[str, Any] = {
        "model": args.model,
        "workload": dataclasses.asdict(workload),
        "history_tokens": workload.history_tokens,
        "device_cache_tokens": device_tokens or None,
        "kv_offloading_size_gib": args.kv_offloading_size if "offloading" in modes else None,
        "repeats": args.repeats,
        "modes": {mode: summarize(mode_runs) for mode, mode_runs in runs.items()},
    }
    reference = runs[modes[0]]
    identical = all(
        [run.token_ids for run in mode_runs] == [run.token_ids for run in reference]
        for mode_runs in runs.values()
    )
    figures["tokens_identical"] = identical
    report(figures, modes)
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(figures, file, indent=1)
    if not identical:
        raise SystemExit(f"greedy tokens differ between the modes ({', '.join(modes)}).")
    return figures


def report(figures: dict[str, Any], modes: list[str]) -> None:
    workload, results = figures["workload"], figures["modes"]
    print(
        f"kv offloading [{figures['model']}]: {workload['conversations']} conversations x "
        f"{workload['turns']} turns, {figures['history_tokens']} history tokens, device cache "
        f"{figures['device_cache_tokens']} tokens; medians of {figures['repeats']} interleaved "
        "repeats",
        flush=True,
    )
    baseline = results[modes[0]]["total_s"]
    for mode in modes:
        result = results[mode]
        print(
            f"  {mode:>14}: total {result['total_s']:.3f} s ({baseline / result['total_s']:.2f}x "
            f"{modes[0]}), ttft mean {result['ttft_mean_s'] * 1e3:.1f} ms, p90 "
            f"{result['ttft_p90_s'] * 1e3:.1f} ms, by turn "
            f"{[round(t * 1e3, 1) for t in result['ttft_mean_by_turn_s']]} ms; prompt tokens "
            f"{result['prompt_tokens']}: computed {result['computed_prompt_tokens']}, loaded "
            f"{result['loaded_tokens']}, device hits "
            f"{result['cached_tokens'] - result['loaded_tokens']}; runs "
            f"{result['total_s_runs']} s, load {result['load_averages']}",
            flush=True,
        )
    same = "identical" if figures["tokens_identical"] else "DIFFERENT"
    print(f"greedy tokens across {', '.join(modes)}: {same}", flush=True)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
