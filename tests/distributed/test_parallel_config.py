"""ParallelConfig at the edge: vLLM's names and flags, the executor backend's defaulting
rules, start-up errors that name the fix; and the pieces that need no process."""

from __future__ import annotations

import pytest
import torch

from pagedlm.config import ArchConfig, ParallelConfig
from pagedlm.distributed import pipeline_model_parallel_state, set_expert_parallel, setup_checks
from pagedlm.distributed.pipeline import stage_layer_range
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.entrypoints.cli.main import build_parser
from pagedlm.executor import worker_messages as wire
from pagedlm.model_executor.layers.moe import FusedMoE
from pagedlm.platforms import Platform


class DevicePlatform(Platform):
    """A platform with ``count`` devices per node."""

    name = "fakegpu"
    device_type = "cpu"
    default_attention_backend = "none"

    def __init__(self, count: int | None) -> None:
        self.count = count

    @property
    def supported_dtypes(self):
        return (torch.float32,)

    def kv_cache_memory_bytes(self, bytes_per_block=None) -> int:
        return 1 << 20

    def device_count(self) -> int | None:
        return self.count


def _arch(**raw) -> ArchConfig:
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
    )
    return ArchConfig.from_hf_dict({**cfg, **raw})


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_short_and_long_flags_on_every_command(command) -> None:
    parser = build_parser()
    args = engine_args_from_cli(
        parser.parse_args([command, "-tp", "2", "-pp", "3", "-dp", "4", "--enable-expert-parallel"])
    )
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    assert args.data_parallel_size == 4 and args.enable_expert_parallel
    long = engine_args_from_cli(
        parser.parse_args(
            [command, "--tensor-parallel-size", "8", "--distributed-executor-backend", "ray"]
        )
    )
    assert long.tensor_parallel_size == 8 and long.distributed_executor_backend == "ray"


def test_defaults_are_vllms() -> None:
    args = EngineArgs()
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (
        1,
        1,
        1,
    )
    assert args.distributed_executor_backend is None and not args.enable_expert_parallel
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_llm_config_carries_the_parallel_settings(tiny_checkpoint) -> None:
    args = EngineArgs(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2)
    config, _ = args.create_engine_config()
    assert config.parallel.tensor_parallel_size == 2
    assert config.parallel.distributed_executor_backend == "mp"  # CPU: ranks share the host
    one, _ = EngineArgs(model=str(tiny_checkpoint("llama"))).create_engine_config()
    assert one.parallel.distributed_executor_backend == "uni"


@pytest.mark.parametrize(
    ("requested", "world", "dp", "devices", "expected"),
    [
        (None, 1, 1, 8, "uni"),
        (None, 2, 1, 8, "mp"),
        (None, 2, 1, None, "mp"),
        (None, 1, 2, 8, "mp"),  # each replica's worker takes its own device
        (None, 1, 2, None, "uni"),  # replicas share the host
        (None, 16, 1, 8, "ray"),  # the world does not fit the node
        ("ray", 2, 1, 8, "ray"),
        ("my_plugin", 4, 1, 8, "my_plugin"),
    ],
)
def test_backend_defaulting(monkeypatch, requested, world, dp, devices, expected) -> None:
    monkeypatch.setattr(setup_checks, "ray_is_installed", lambda: True)
    platform = DevicePlatform(devices)
    assert setup_checks.resolve_executor_backend(requested, world, dp, platform) == expected


def test_backend_errors_name_the_fix(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"runs one worker.*use 'mp'"):
        setup_checks.resolve_executor_backend("uni", 2, 1, DevicePlatform(8))
    monkeypatch.setattr(setup_checks, "ray_is_installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'pagedlm\[ray\]'"):
        setup_checks.resolve_executor_backend(None, 16, 1, DevicePlatform(8))
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray fails
    with pytest.raises(ValueError, match=r"Ray, which is not installed.*pagedlm\[ray\]"):
        setup_checks.import_ray()


def test_more_ranks_than_devices() -> None:
    parallel = ParallelConfig(
        tensor_parallel_size=2,
        data_parallel_size=2,
        data_parallel_rank=1,
        distributed_executor_backend="mp",
    )
    with pytest.raises(ValueError, match="needs 4 fakegpu devices on this node but 3 are visible"):
        setup_checks.check_devices(parallel, DevicePlatform(3))
    setup_checks.check_devices(parallel, DevicePlatform(4))
    setup_checks.check_devices(parallel, DevicePlatform(None))
    # Rank 0 launches every replica on this node: two replicas of one rank need two devices
    # (a one-GPU host failed inside torch with "invalid device ordinal").
    replicas = ParallelConfig(data_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="needs 2 fakegpu devices on this node but 1 are"):
        setup_checks.check_devices(replicas, DevicePlatform(1))
    setup_checks.check_devices(replicas, DevicePlatform(2))
    shared = ParallelConfig(data_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="every replica on one fakegpu device"):
        setup_checks.check_devices(shared, DevicePlatform(2))
    setup_checks.check_devices(shared, DevicePlatform(None))  # CPU: replicas share the host


@pytest.mark.parametrize(
    ("arch", "parallel", "message"),
    [
        (_arch(), ParallelConfig(tensor_parallel_size=3), "num_attention_heads=4"),
        (
            _arch(num_attention_heads=6, num_key_value_heads=3),
            ParallelConfig(tensor_parallel_size=2),
            "num_key_value_heads=3",
        ),
        (
            _arch(intermediate_size=50),
            ParallelConfig(tensor_parallel_size=4),
            "intermediate_size=50",
        ),
        (_arch(), ParallelConfig(pipeline_parallel_size=5), "exceeds the model's 4 layers"),
        (
            _arch(num_experts=6),
            ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True),
            "6 experts",
        ),
        (
            _arch(num_experts=8, moe_intermediate_size=6),
            ParallelConfig(tensor_parallel_size=4),
            "moe_intermediate_size=6.*enable_expert_parallel",
        ),
        (_arch(), ParallelConfig(enable_expert_parallel=True), "needs a mixture-of-experts"),
    ],
)
def test_model_must_split(arch, parallel, message) -> None:
    with pytest.raises(ValueError, match=message):
        setup_checks.check_model_fits(arch, parallel)


def test_kv_heads_may_be_replicated_over_ranks() -> None:
    setup_checks.check_model_fits(_arch(), ParallelConfig(tensor_parallel_size=4))


def test_bad_sizes_rejected_at_the_edge(tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineArgs(model=model, tensor_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_rank=2 is outside"):
        EngineArgs(model=model, data_parallel_size=2, data_parallel_rank=2).create_engine_config()


def test_stage_partition_gives_the_remainder_before_the_last_stage() -> None:
    assert [stage_layer_range(4, s, 2) for s in range(2)] == [(0, 2), (2, 4)]
    assert [stage_layer_range(5, s, 2) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layer_range(7, s, 3) for s in range(3)] == [(0, 2), (2, 5), (5, 7)]
    with pytest.raises(ValueError, match="at most one pipeline stage per layer"):
        stage_layer_range(2, 0, 3)


def test_stage_holds_only_its_layers(tiny_checkpoint) -> None:
    from pagedlm.model_executor.models.llama import LlamaForCausalLM
    from pagedlm.model_executor.models.stages import PPMissingLayer

    arch = ArchConfig.from_directory(tiny_checkpoint("llama"))
    with pipeline_model_parallel_state(0, 2):
        first = LlamaForCausalLM(arch)
    with pipeline_model_parallel_state(1, 2):
        last = LlamaForCausalLM(arch)
    assert isinstance(first.lm_head, PPMissingLayer) and isinstance(
        first.model.layers[1], PPMissingLayer
    )
    assert isinstance(last.model.embed_tokens, PPMissingLayer) and isinstance(
        last.model.layers[0], PPMissingLayer
    )
    assert first.is_other_stage("model.layers.1.mlp.down_proj.weight")
    assert not first.is_other_stage("model.layers.0.mlp.down_proj.weight")
    assert last.is_other_stage("model.embed_tokens.weight") and not last.is_other_stage(
        "lm_head.weight"
    )
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in LlamaForCausalLM(arch).named_parameters()}


def test_expert_parallel_layer_holds_whole_experts() -> None:
    from pagedlm.distributed import tensor_model_parallel_state

    set_expert_parallel(True)
    try:
        with tensor_model_parallel_state(1, 2):
            moe = FusedMoE(6, 2, 16, 24, renormalize=True)
    finally:
        set_expert_parallel(False)
    assert (moe.expert_start, moe.num_local_experts, moe.intermediate_per_rank) == (3, 3, 24)
    with tensor_model_parallel_state(1, 2):
        sliced = FusedMoE(6, 2, 16, 24, renormalize=True)
    assert (sliced.num_local_experts, sliced.intermediate_per_rank) == (6, 12)


def test_worker_config_round_trips(tiny_checkpoint) -> None:
    config, _ = EngineArgs(
        model=str(tiny_checkpoint("llama")), dtype="bfloat16"
    ).create_engine_config()
    decoded = wire.decode_config(wire.encode_config(config))
    assert decoded == config and decoded.model.dtype is torch.bfloat16
    assert decoded.model.arch.raw == config.model.arch.raw


def test_worker_processes_need_zmq_and_msgspec(monkeypatch) -> None:
    real = setup_checks.importlib.util.find_spec
    monkeypatch.setattr(
        setup_checks.importlib.util, "find_spec", lambda name: None if name == "zmq" else real(name)
    )
    with pytest.raises(ValueError, match=r"needs zmq; .*pagedlm\[distributed\]"):
        setup_checks.check_worker_transport("mp")
    setup_checks.check_worker_transport("uni")


def test_workers_split_the_cores_they_may_run_on(monkeypatch) -> None:
    from types import SimpleNamespace

    from pagedlm.executor.multiproc import THREADS_ENV, MultiprocExecutor

    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    executor = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    monkeypatch.setattr(
        "pagedlm.executor.multiproc.os.sched_getaffinity", lambda pid: set(range(10))
    )
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert MultiprocExecutor._worker_env(executor)[THREADS_ENV] == "2"  # 10 cores, 4 ranks
    monkeypatch.setenv(THREADS_ENV, "7")
    assert MultiprocExecutor._worker_env(executor)[THREADS_ENV] == "7"  # the user's
