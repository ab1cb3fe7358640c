"""The engine-core process started before its arguments: claimed by an engine, or given up."""

from __future__ import annotations

import asyncio
import os

import pytest

from pagedlm import AsyncLLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.entrypoints.cli import main as cli


def test_only_serve_launches_early():
    assert CoreLaunch.for_command_line(["generate", "hi"]) is None
    assert CoreLaunch.for_command_line(["serve", "--help"]) is None
    assert CoreLaunch.for_command_line([]) is None


def test_a_core_without_a_start_message_exits_quietly():
    launch = CoreLaunch()
    assert not launch.settled
    launch.process.stdin.close()  # what a front end that died leaves it
    assert launch.process.wait(120) == 0
    launch.abandon()  # settled already: only cleans up
    launch.abandon()
    assert launch.settled


def test_abandoning_stops_the_core_and_removes_its_sockets_directory():
    launch = CoreLaunch()
    launch.abandon()
    assert launch.process.poll() is not None
    assert not os.path.exists(launch.ipc_dir)


def test_an_engine_claims_an_early_launch(tiny_checkpoint):
    launch = CoreLaunch()
    args = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        max_model_len=128,
    )
    engine = AsyncLLM.from_engine_args(args, launch)
    try:
        assert launch.settled and engine.core_pid == launch.process.pid
        launch.abandon()  # a no-op once the engine has it

        async def generate() -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            async for output in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r"):
                final = output
            return final.outputs[0].token_ids

        assert len(asyncio.run(generate())) == 4
        assert launch.process.poll() is None
    finally:
        engine.shutdown()
    assert launch.process.poll() is not None


def test_a_command_line_error_leaves_no_core_behind(monkeypatch, capsys):
    launches: list[CoreLaunch] = []
    real = CoreLaunch.for_command_line

    def recording(argv: list[str]) -> CoreLaunch | None:
        launch = real(argv)
        launches.append(launch)
        return launch

    monkeypatch.setattr(CoreLaunch, "for_command_line", staticmethod(recording))
    with pytest.raises(SystemExit):
        cli.main(["serve", "--no-such-flag"])
    (launch,) = launches
    assert launch.settled and launch.process.poll() is not None
    assert "--no-such-flag" in capsys.readouterr().err
