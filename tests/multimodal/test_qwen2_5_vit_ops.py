"""The Qwen2.5-VL tower's block in few ops: the rotary equals transformers' float32
formula exactly, the fused gate/up GEMM loads the checkpoint's two projections, the CUDA
platform's fused norm (residual add inside) and SiLU-and-mul kernels (Triton, interpreted
on CPU) give the torch path's result, and one 1024x768 image costs a bounded number of
torch ops (counted with torch.profiler; the H200 profile of session 10 had 930 kernels)."""

from __future__ import annotations

import collections
import copy

from triton_setup import load_triton_env

load_triton_env()

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from pagedlm.model_executor.layers.activation import SiluAndMul  # noqa: E402
from pagedlm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from pagedlm.model_executor.models.vision.qwen2_5_vit import (  # noqa: E402
    Qwen2_5_VisionTransformer,
    VisionMLP,
    VisionRotary,
)

TINY = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=32,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
    hidden_act="silu",
)
"""Two blocks (windows, then the whole frame) of 2 heads of 16."""
SEVEN_B_LAYOUT = {**TINY, "depth": 32, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
"""Qwen2.5-VL-7B's block layout (32 blocks, windows of 4x4 merged tokens), narrow."""


def _tower(vision: dict, dtype: torch.dtype = torch.float32) -> Qwen2_5_VisionTransformer:
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformer(vision).to(dtype).eval()
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    return tower


def _image(grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(grid_h * grid_w, 3 * 2 * 14 * 14), torch.tensor([[1, grid_h, grid_w]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_transformers_formula(dtype) -> None:
    def rotate_half(x):
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)

    torch.manual_seed(0)
    angles = torch.rand(10, 8) * 40
    qkv = torch.randn(10, 3, 2, 16).to(dtype)
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]
    expected = [
        (x.float() * emb.cos() + rotate_half(x.float()) * emb.sin()).to(dtype)
        for x in (qkv[:, 0], qkv[:, 1])
    ]
    value = qkv[:, 2].clone()
    VisionRotary.from_angles(angles).rotate_(qkv[:, :2])  # a strided view, in place
    assert torch.equal(qkv[:, 0], expected[0]) and torch.equal(qkv[:, 1], expected[1])
    assert torch.equal(qkv[:, 2], value)


def test_mlp_loads_the_checkpoint_projections_into_padded_ones() -> None:
    mlp = VisionMLP(4, 3, "silu")
    assert mlp.down_proj.in_features == 64  # 3 padded to the alignment
    with torch.no_grad():
        for param in mlp.parameters():
            param.fill_(float("nan"))  # loading must overwrite the padding too
        gate, up, down = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), torch.nn.Linear(3, 4)
        for projection, layer in (("gate", gate), ("up", up), ("down", down)):
            mlp.load(projection, "weight", layer.weight)
            mlp.load(projection, "bias", layer.bias)
        x = torch.randn(5, 4)
        expected = down(torch.nn.functional.silu(gate(x)) * up(x))
        torch.testing.assert_close(mlp(x), expected, rtol=1e-6, atol=1e-6)


def test_platform_fused_kernels_give_the_torch_result() -> None:
    from pagedlm_cuda.fused_layers import install_fused_kernels

    tower = _tower(TINY)
    fused = copy.deepcopy(tower)
    # 2 blocks x (norm1, norm2, SiLU-and-mul) + the merger's norm.
    assert install_fused_kernels(fused) == 7
    pixels, grid = _image(6, 10)  # 3x5 merged: four windows, three of them partial
    with torch.inference_mode():
        torch.testing.assert_close(fused(pixels, grid), tower(pixels, grid), rtol=1e-5, atol=1e-5)


VIEW_OPS = {
    "aten::" + name
    for name in [
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "transpose",
        "t",
        "permute",
        "unbind",
        "select",
        "slice",
        "as_strided",
        "expand",
        "chunk",
        "split",
        "split_with_sizes",
        "narrow",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "detach",
        "alias",
        "to",
        "lift_fresh",
        "contiguous",
        "empty",
        "resolve_conj",
        "resolve_neg",
    ]
}
"""Ops that launch nothing unless they copy (a cast, a clone): those count as their copy."""


def _ops_per_call(tower, pixels, grid) -> collections.Counter:
    """Ops one forward launches, with each RMSNorm and SiLU-and-mul counted once (the CUDA
    platform runs each as one kernel)."""

    def one_op(module, name):
        def kernel(*args):
            with record_function(name):
                module.kernel = None
                try:
                    return module(*args[:2]) if name == "rms_norm" else module(args[0])
                finally:
                    module.kernel = kernel

        module.set_kernel(kernel)

    for module in tower.modules():
        if isinstance(module, RMSNorm):
            one_op(module, "rms_norm")
        elif isinstance(module, SiluAndMul):
            one_op(module, "silu_and_mul")
    with torch.inference_mode():
        tower(pixels, grid)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tower(pixels, grid)
    counts: collections.Counter = collections.Counter()

    def visit(event) -> None:
        if event.name in ("rms_norm", "silu_and_mul"):
            counts[event.name] += 1
        elif event.name in VIEW_OPS:
            for child in event.cpu_children:
                visit(child)
        elif event.name.startswith("aten::"):
            counts[event.name] += 1

    for event in prof.events():
        parent = event.cpu_parent
        if parent is None or not (
            parent.name.startswith("aten::") or parent.name in ("rms_norm", "silu_and_mul")
        ):
            visit(event)
    return counts


def test_one_image_costs_few_ops_per_block() -> None:
    # bfloat16 as on the GPU (float32 skips the casts), one 1024x768 image: 54x74 patches.
    counts = _ops_per_call(_tower(SEVEN_B_LAYOUT, torch.bfloat16), *_image(54, 74))
    per_block = {name: count / 32 for name, count in counts.items() if count >= 32}
    # qkv, proj, gate_up, down; two norms; rotary flip, 2 mul, add, copy back; SDPA;
    # SiLU-and-mul; around window attention one index_copy_ and one gather.
    assert counts["aten::linear"] == 4 * 32 + 3  # + the patch embedding and merger MLP
    assert counts["rms_norm"] == 2 * 32 + 1
    assert counts["aten::_to_copy"] <= 4, "no casts per block"
    assert sum(counts.values()) <= 15 * 32 + 20, per_block  # 490 now; 1,106 before


def test_the_encoder_runner_keeps_grids_on_the_host() -> None:
    from pagedlm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from pagedlm.multimodal.encoder_runner import EncoderRunner
    from pagedlm.multimodal.tensors import to_tensor_data
    from pagedlm.step.multimodal import MultiModalFeature

    seen: dict[str, torch.device] = {}

    class Model(torch.nn.Module):
        host_multimodal_inputs = Qwen2_5_VLForConditionalGeneration.host_multimodal_inputs
        packed_multimodal_inputs = True

        def embed_multimodal(self, tensors):
            seen.update({name: t.device for name, t in tensors.items()})
            return torch.zeros(sum(int(g.prod()) for g in tensors["image_grid_thw"]) // 4, 8)

    def feature(identifier: str, grid_h: int) -> MultiModalFeature:
        pixels, grid = _image(grid_h, 2)
        tensors = {"pixel_values": pixels, "image_grid_thw": grid}
        return MultiModalFeature(
            "image",
            identifier,
            offset=0,
            length=grid_h // 2,
            tensors={name: to_tensor_data(t) for name, t in tensors.items()},
        )

    runner = EncoderRunner(Model(), torch.device("meta"))  # "the device": never the host
    runner._encode([feature("a", 2), feature("b", 4)])
    assert seen == {"pixel_values": torch.device("meta"), "image_grid_thw": torch.device("cpu")}
    assert runner.num_encoder_calls == 1 and set(runner.cache) == {"a", "b"}
