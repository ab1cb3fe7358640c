"""The CUDA platform's step path on the CPU: the Triton attention backend and sampler
kernels under ``TRITON_INTERPRET=1`` and its CUDA-graph runner with graphs emulated.

``TritonCpuPlatform`` is the CPU platform plus what the CUDA platform changes in a step:
the ``triton`` attention backend (its own KV layout, lengths read on the device only, so
in-flight rejections are corrected on the device), ``CudaGraphRunner`` for uniform steps
(decode and ``1 + k`` verification) over the runner's persistent buffers, the fused
Gumbel/argmax sampler, the fused greedy verification, the in-flight correction kernel and
the step gather kernel. A "graph" here replays by calling its captured step again with the capture's inputs and
metadata objects, writing into the tensor the capture returned: what a replay of a real
graph sees, minus host values a real capture would freeze (the forward reads none: it
could not be captured otherwise).

``triton_cpu_platform()`` registers it for one test. Importing this module first loads
``tests/cuda/triton_env.py`` (the interpreter is chosen when the kernels are decorated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from triton_setup import load_triton_env

ON_GPU = load_triton_env().ON_GPU

from pagedlm import hookimpl  # noqa: E402
from pagedlm.plugins import CONTRACT_VERSION, BackendSpec, PlatformSpec  # noqa: E402
from pagedlm.plugins.registry import get_plugin_manager  # noqa: E402
from pagedlm_cpu.platform import CpuPlatform  # noqa: E402
from pagedlm_cuda.graph_runner import CudaGraphRunner  # noqa: E402

NAME = "triton_cpu"


class _Replay:
    def __init__(self, step: Callable[[], torch.Tensor], hidden: torch.Tensor) -> None:
        self.step, self.hidden = step, hidden
        self.num_replays = 0

    def replay(self) -> None:
        self.hidden.copy_(self.step())
        self.num_replays += 1


class InterpretedGraphRunner(CudaGraphRunner):
    """``CudaGraphRunner`` with its captures emulated (see the module docstring)."""

    def _new_pool(self) -> Any:
        return None

    def _synchronize(self) -> None:
        pass

    def _record(self, step: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        hidden = step().clone()
        return _Replay(step, hidden), hidden

    def _capture_pieces(self, runner: Any) -> None:
        return None  # pieces split one capture at each attention call: no emulation of that

    def num_replays(self, query_len: int) -> int:
        return sum(c.graph.num_replays for (_, q), c in self._graphs.items() if q == query_len)


class TritonCpuPlatform(CpuPlatform):
    name = NAME
    supports_cuda_graphs = True
    default_attention_backend = "triton"
    graph_runners: ClassVar[list[InterpretedGraphRunner]] = []
    """Every runner captured while registered (tests read their replay counts)."""

    def capture_graphs(self, runner: object) -> InterpretedGraphRunner | None:
        graphs = InterpretedGraphRunner.for_model_runner(runner)
        if graphs is not None:
            TritonCpuPlatform.graph_runners.append(graphs)
        return graphs

    def fused_sampler(self):
        from pagedlm_cuda.kernels.sampling import gumbel_sample

        return gumbel_sample

    def fused_greedy_verifier(self):
        from pagedlm_cuda.kernels.greedy_verify import greedy_verify

        return greedy_verify

    def in_flight_corrector(self):
        from pagedlm_cuda.kernels.in_flight import correct_in_flight

        return correct_in_flight

    def step_gatherer(self):
        from pagedlm_cuda.kernels.step_gather import gather_step_inputs

        return gather_step_inputs


class _Plugin:
    PAGEDLM_CONTRACT_VERSION = CONTRACT_VERSION

    @hookimpl
    def pagedlm_register_platforms(self) -> list[PlatformSpec]:
        target = f"{__name__}:TritonCpuPlatform"
        return [PlatformSpec(name=NAME, target=target, priority=-1)]

    @hookimpl
    def pagedlm_register_attention_backends(self, platform: object) -> list[BackendSpec]:
        target = "pagedlm_cuda.attention:TritonAttentionBackend"
        return [BackendSpec(name="triton", target=target, platform=NAME)]


@contextmanager
def triton_cpu_platform() -> Iterator[type[TritonCpuPlatform]]:
    """``LLM(platform="triton_cpu")`` works inside the block."""
    pm = get_plugin_manager()
    plugin = _Plugin()
    pm.register(plugin, name="pagedlm-tests-triton-cpu")
    TritonCpuPlatform.graph_runners = []
    try:
        yield TritonCpuPlatform
    finally:
        pm.unregister(plugin)
        TritonCpuPlatform.graph_runners = []
