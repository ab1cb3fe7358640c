"""Deliberately broken backends, samplers and platforms fail the kit, each with a message
naming the promise it breaks; the unbroken ones they derive from pass the same checks."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from pagedlm.attention import AttentionBackend
from pagedlm.plugins import CONTRACT_VERSION, PlatformSpec, hookimpl
from pagedlm.plugins.registry import get_plugin_manager
from pagedlm.testing import (
    BACKEND_CHECKS,
    AttentionTarget,
    ConformanceFailure,
    HeadShape,
    NotApplicable,
)
from pagedlm.testing.parity import check_greedy_parity
from pagedlm.testing.platform_checks import (
    check_argmax_rows,
    check_dtypes,
    check_fused_sampler,
    check_host_mapping,
    check_memory_sizing,
    check_zeros,
)
from pagedlm_cpu.attention import CpuSdpaBackend
from pagedlm_cpu.platform import CpuPlatform
from plugin_kit import EXAMPLE_SRC, kit_checkpoints

if str(EXAMPLE_SRC) not in sys.path:  # the example's backend, without its entry points
    sys.path.append(str(EXAMPLE_SRC))
from pagedlm_example_platform.attention import ExampleAttentionBackend

SMALL = dict(block_sizes=(16,), head_shapes=(HeadShape(4, 2, 32),))


def expect_broken(promise: str, check: str, backend_cls: type, **target) -> str:
    with pytest.raises(ConformanceFailure) as info:
        BACKEND_CHECKS[check](AttentionTarget(backend_cls, **{**SMALL, **target}))
    assert info.value.promise.id == promise
    assert f"breaks promise '{promise}'" in str(info.value)
    return str(info.value)


class SwappedSlots(CpuSdpaBackend):
    """Writes each token's K/V into its neighbour's slot (offset ^ 1)."""

    def build_metadata(self, layout):
        metadata = super().build_metadata(layout)
        return dataclasses.replace(metadata, slot_mapping=metadata.slot_mapping ^ 1)


class IgnoresWindow(CpuSdpaBackend):
    def forward(self, *args, sliding_window=None, logits_soft_cap=None):
        return super().forward(*args, logits_soft_cap=logits_soft_cap)


class IgnoresSoftCap(CpuSdpaBackend):
    def forward(self, *args, sliding_window=None, logits_soft_cap=None):
        return super().forward(*args, sliding_window=sliding_window)


class PaddedBlocks(CpuSdpaBackend):
    """A layout with a spare slot per block: more memory than KV sizing counts."""

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, block_size + 1, num_kv_heads, head_dim)


class ClaimsGraphs(CpuSdpaBackend):
    """Says decode steps can be captured, but writes padding rows' slot -1."""

    def supports_graph(self, query_len: int) -> bool:
        return query_len == 1


class WritesPadding(ExampleAttentionBackend):
    """Claims graphs; slot -1 floor-divides to block -1, offset block_size - 1: its
    padding rows silently overwrite the last slot of the last block."""

    def supports_graph(self, query_len: int) -> bool:
        return query_len == 1


class HostPlannedGraphs(ExampleAttentionBackend):
    """Skips padding rows, but claims graphs while its metadata is a host-side plan made
    at capture time, stale at every replay."""

    def supports_graph(self, query_len: int) -> bool:
        return query_len == 1

    def forward(self, query, key, value, key_cache, value_cache, metadata, scale, **features):
        real = metadata.slot_blocks >= 0  # slot -1 floor-divides to block -1
        metadata = dataclasses.replace(
            metadata,
            slot_blocks=metadata.slot_blocks[real],
            slot_offsets=metadata.slot_offsets[real],
        )
        return super().forward(
            query, key[real], value[real], key_cache, value_cache, metadata, scale, **features
        )


def test_wrong_slot_mapping_fails_slot_mapping() -> None:
    BACKEND_CHECKS["slot_mapping"](AttentionTarget(CpuSdpaBackend, **SMALL))
    message = expect_broken("slot_mapping", "slot_mapping", SwappedSlots)
    assert "request" in message and "relative error" in message


def test_ignoring_the_window_fails_sliding_window() -> None:
    message = expect_broken("sliding_window", "sliding_window", IgnoresWindow)
    assert "it matches attention without ['sliding_window']: they are ignored" in message


def test_ignoring_the_soft_cap_fails_logits_soft_cap() -> None:
    message = expect_broken("logits_soft_cap", "logits_soft_cap", IgnoresSoftCap)
    assert "logits_soft_cap" in message


class DefaultBlockView(ExampleAttentionBackend):
    """Its own layout, read through the default layout's block view."""

    @classmethod
    def kv_block_view(cls, layer_cache, block_size, num_kv_heads, head_dim):
        return layer_cache.view(-1, block_size, num_kv_heads, head_dim)


class NoBlockView(ExampleAttentionBackend):
    """Its own layout and no block view of it (the base class refuses)."""

    kv_block_view = AttentionBackend.__dict__["kv_block_view"]  # the classmethod, unbound


def test_a_block_view_of_another_layout_fails_kv_block_view() -> None:
    BACKEND_CHECKS["kv_block_view"](AttentionTarget(ExampleAttentionBackend, **SMALL))
    message = expect_broken("kv_block_view", "kv_block_view", DefaultBlockView)
    assert "slot // block_size" in message


def test_a_layout_without_a_block_view_is_refused_not_misread() -> None:
    with pytest.raises(NotApplicable, match="kv_block_view"):
        BACKEND_CHECKS["kv_block_view"](AttentionTarget(NoBlockView, **SMALL))


def test_padded_layout_fails_kv_cache_shape() -> None:
    expect_broken("kv_cache_shape", "kv_cache_shape", PaddedBlocks)


def test_padding_rows_that_write_fail_padding_rows() -> None:
    message = expect_broken("padding_rows", "graph_replay", ClaimsGraphs)
    assert "forward raised IndexError" in message


def test_padding_rows_that_write_silently_fail_padding_rows() -> None:
    message = expect_broken("padding_rows", "graph_replay", WritesPadding)
    assert "left the KV cache different from the same step without padding" in message


def test_capture_time_metadata_fails_graph_metadata() -> None:
    expect_broken("graph_metadata", "graph_replay", HostPlannedGraphs)


def test_missing_feature_flag_means_refused_and_checked_as_such() -> None:
    # The example backend has no soft-cap: the check passes by seeing the layer refuse.
    BACKEND_CHECKS["logits_soft_cap"](AttentionTarget(ExampleAttentionBackend, **SMALL))


def ignoring_temperature(logits, temperature, noise_scale, seed):
    return exponential_race(logits, None, noise_scale, seed)


def ignoring_noise_scale(logits, temperature, noise_scale, seed):
    return exponential_race(logits, temperature, None, seed)


def last_index_on_ties(logits, temperature, noise_scale, seed):
    return logits.size(1) - 1 - logits.flip(1).argmax(dim=1)


def writing_the_logits(logits, temperature, noise_scale, seed):
    return exponential_race(logits.add_(1.0), temperature, noise_scale, seed)


def exponential_race(logits, temperature, noise_scale, seed):
    """A correct FusedRandomSampler in torch (the sampler's own method)."""
    if seed is None:
        return logits.argmax(dim=-1)
    generator = torch.Generator(device=logits.device).manual_seed(int(seed.item()))
    scaled = logits if temperature is None else logits / temperature[:, None]
    probs = scaled.float().softmax(dim=-1)
    sampled = (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)
    if noise_scale is not None:
        sampled = torch.where(noise_scale == 0, logits.argmax(dim=-1), sampled)
    return sampled


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        (ignoring_temperature, "temperature 0.5"),
        (ignoring_noise_scale, "noise_scale 0"),
        (last_index_on_ties, "argmax"),
        (writing_the_logits, "logits"),
    ],
)
def test_broken_fused_samplers_fail(sampler, expected) -> None:
    check_fused_sampler(exponential_race, torch.device("cpu"), rows_per_temperature=2048)
    with pytest.raises(ConformanceFailure, match=rf"breaks promise 'fused_sampler'.*{expected}"):
        check_fused_sampler(
            sampler, torch.device("cpu"), sampler.__name__, rows_per_temperature=2048
        )


def argmax_last_on_ties(logits: torch.Tensor) -> torch.Tensor:
    return logits.shape[-1] - 1 - logits.flip(-1).max(dim=-1).indices


def argmax_without_nan(logits: torch.Tensor) -> torch.Tensor:
    return logits.nan_to_num(nan=-float("inf")).max(dim=-1).indices


def argmax_in_place(logits: torch.Tensor) -> torch.Tensor:
    return logits.clamp_(max=30.0).max(dim=-1).indices  # the kit plants 40s


def argmax_as_int32(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices.int()


@pytest.mark.parametrize(
    ("argmax", "expected"),
    [
        (argmax_last_on_ties, "torch.max's indices"),
        (argmax_without_nan, "torch.max's indices"),
        (argmax_in_place, "wrote into the logits"),
        (argmax_as_int32, "torch.int32"),
    ],
)
def test_broken_argmaxes_fail(argmax, expected) -> None:
    check_argmax_rows(CpuPlatform().argmax_rows(), torch.device("cpu"))
    with pytest.raises(ConformanceFailure, match=rf"breaks promise 'argmax_rows'.*{expected}"):
        check_argmax_rows(argmax, torch.device("cpu"), argmax.__name__)


class LaxPlatform(CpuPlatform):
    def check_dtype(self, dtype: torch.dtype) -> None:
        pass

    def kv_cache_memory_bytes(self, bytes_per_block=None):
        return 4.0 * 2**30

    def zeros(self, shape, dtype):
        return torch.ones(shape, dtype=dtype)


class CopyingHostPlatform(CpuPlatform):
    """Its "view" of host memory is a copy: writes do not reach the host tensor."""

    def map_host_tensor(self, host):
        return host.clone()


@pytest.mark.parametrize(
    ("check", "promise"),
    [(check_dtypes, "dtype"), (check_memory_sizing, "memory_sizing"), (check_zeros, "zeros")],
)
def test_broken_platform_methods_fail(check, promise) -> None:
    check(CpuPlatform())
    with pytest.raises(ConformanceFailure, match=rf"breaks promise '{promise}'"):
        check(LaxPlatform())


def test_a_host_mapping_that_copies_fails() -> None:
    with pytest.raises(NotApplicable, match="maps no host memory"):
        check_host_mapping(CpuPlatform())
    check_host_mapping(
        type(
            "AliasingPlatform", (CpuPlatform,), {"map_host_tensor": lambda self, h: h.view(h.shape)}
        )()
    )
    with pytest.raises(ConformanceFailure, match=r"breaks promise 'host_mapping'.*does not show"):
        check_host_mapping(CopyingHostPlatform())


class SkewedPlatform(CpuPlatform):
    """Its prepare_model changes the results far beyond rounding."""

    name = "skewed_cpu"

    def prepare_model(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "embed" in name:
                    param.mul_(-1.0)


class SkewedPlugin:
    PAGEDLM_CONTRACT_VERSION = CONTRACT_VERSION

    @hookimpl
    def pagedlm_register_platforms(self):
        return [PlatformSpec(name="skewed_cpu", target=f"{__name__}:SkewedPlatform", priority=-1)]

    @hookimpl
    def pagedlm_register_attention_backends(self, platform):
        from pagedlm.plugins import BackendSpec

        return [BackendSpec("cpu_sdpa", "pagedlm_cpu.attention:CpuSdpaBackend", "skewed_cpu")]


def test_changed_results_fail_greedy_parity(tmp_path_factory) -> None:
    pm = get_plugin_manager()
    pm.register(SkewedPlugin(), name="skewed_test_plugin")
    try:
        with pytest.raises(ConformanceFailure, match=r"breaks promise 'greedy_parity'.*diverges"):
            check_greedy_parity(SkewedPlatform(), "llama", kit_checkpoints(tmp_path_factory))
    finally:
        pm.unregister(name="skewed_test_plugin")
