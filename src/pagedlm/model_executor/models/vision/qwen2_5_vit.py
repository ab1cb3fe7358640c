"""Qwen2.5-VL's vision transformer: patches of ``temporal_patch_size`` x ``patch_size`` x
``patch_size`` pixels, 2D rotary positions, window attention with a few full-attention
blocks, and the patch merger that turns each ``spatial_merge_size``-squared group of
patches into one decoder token.

Input (the processor's own layout): ``pixel_values`` [num_patches, C * T * P * P], every
image's patches one after another, and ``grid_thw`` [num_images, 3] (temporal, height and
width in patches). Output: [num_patches / merge^2, out_hidden_size], image after image, in
the row-major order of each image's merged grid (the order of its placeholder tokens).

Window attention: the merged grid is cut into ``window_size / patch_size / merge`` squared
windows; blocks attend within a window, except ``fullatt_block_indexes``, which attend
within a frame. The tower runs on windows in window order (patches regrouped once at the
start, restored after the merger). Attention is torch SDPA over the segments padded to the
longest one (key padding masked), so any device runs it; it never uses the paged cache.

Few ops per block (exactly transformers' math): the residual add inside each RMSNorm, q and
k rotated together in float32 (``VisionRotary``), gate and up as one GEMM into
``SiluAndMul`` (platforms fuse both), the hidden size padded with zero weights to aligned
GEMM rows, and every index, mask and padding buffer built once per forward on the host
and copied without waiting for the device.

Parameter names follow transformers' ``Qwen2_5_VisionTransformerPretrainedModel``, except
each block's ``mlp.gate_up_proj`` (the checkpoint's ``gate_proj`` and ``up_proj``, loaded
by ``VisionMLP.load``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.models.vision.clip import vision_activation


def patch_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """[num_patches, 2] (row, column) of every patch, in the processor's patch order:
    each ``merge`` x ``merge`` group's patches together, groups row-major, frame by frame."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out)


def window_order(grid_thw: np.ndarray, merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """(merged-token index of each position in window order, window lengths in patches).

    Each frame's merged grid is cut into ``window`` x ``window`` tiles, row-major (edge
    tiles smaller); a tile's tokens stay row-major."""
    order: list[np.ndarray] = []
    lengths: list[int] = []
    first = 0
    for t, h, w in grid_thw.tolist():
        grid_h, grid_w = h // merge, w // merge
        index = first + np.arange(t * grid_h * grid_w).reshape(t, grid_h, grid_w)
        for frame in index:
            for top in range(0, grid_h, window):
                for left in range(0, grid_w, window):
                    tile = frame[top : top + window, left : left + window].reshape(-1)
                    order.append(tile)
                    lengths.append(tile.size * merge * merge)
        first += t * grid_h * grid_w
    return np.concatenate(order), lengths


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for the device: from pageable memory
    the copy is staged before the call returns (a blocking copy would first wait for
    every kernel queued, such as the step still in flight)."""
    return torch.from_numpy(array).to(device, non_blocking=True)


@dataclass(frozen=True)
class Segments:
    """Consecutive runs of rows that attend only among themselves (windows, or frames),
    laid out for one batched SDPA call: ``num`` segments padded to ``longest`` rows.
    Built once per forward and shared by the blocks: the padding indices, the additive
    key mask and the zero-padded q/k/v buffer (its padding rows stay zero; each block
    writes its real rows over the last block's), so a block adds two index ops around
    its attention, or none when all segments are equally long."""

    num: int
    longest: int
    rows: torch.Tensor | None
    """[N] each row's index in the padded [num * longest] layout; None: no padding (all
    segments equally long)."""
    segment_of_row: torch.Tensor | None
    """[N] the segment of each row, and ``position_of_row`` its place in it."""
    position_of_row: torch.Tensor | None
    mask: torch.Tensor | None
    """[num, 1, 1, longest] 0 for real keys, -inf for padding, in the compute dtype."""
    padded: torch.Tensor | None
    """[num * longest, 3, heads, head_dim] zeros, the blocks' q/k/v in padded layout."""

    @classmethod
    def build(
        cls, lengths: list[int], device: torch.device, dtype: torch.dtype, row_shape: tuple
    ) -> Segments:
        """``row_shape``: (3, heads, head_dim) of one row of the blocks' q/k/v."""
        longest = max(lengths)
        if all(length == longest for length in lengths):
            return cls(len(lengths), longest, None, None, None, None, None)
        lens = np.asarray(lengths)
        starts = np.cumsum(lens) - lens
        segment = np.repeat(np.arange(len(lens)), lens)
        position = np.arange(lens.sum()) - np.repeat(starts, lens)
        mask = np.where(np.arange(longest)[None, :] < lens[:, None], 0.0, -np.inf)
        return cls(
            len(lengths),
            longest,
            to_device(segment * longest + position, device),
            to_device(segment, device),
            to_device(position, device),
            to_device(mask, device).to(dtype)[:, None, None, :],
            torch.zeros(len(lengths) * longest, *row_shape, device=device, dtype=dtype),
        )


def segment_attention(qkv: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Bidirectional attention within each segment: qkv [N, 3, heads, head_dim] ->
    [N, heads * head_dim] (padding keys masked, padding queries dropped)."""
    n, _, heads, dim = qkv.shape
    if segments.rows is None:
        shape = (segments.num, segments.longest, heads, dim)
        q, k, v = (qkv[:, i].view(shape).transpose(1, 2) for i in range(3))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, heads * dim)
    assert segments.padded is not None
    padded = segments.padded.index_copy_(0, segments.rows, qkv)
    q, k, v = padded.view(segments.num, segments.longest, 3, heads, dim).unbind(2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=segments.mask
    )
    # [num, heads, longest, dim] -> each real row's [heads, dim], in one gather.
    rows = out.transpose(1, 2)[segments.segment_of_row, segments.position_of_row]
    return rows.reshape(n, heads * dim)


@dataclass(frozen=True)
class VisionRotary:
    """The tower's 2D rotary for every row of one forward, q and k rotated together:
    ``x * cos + swap_halves(x) * signed_sin`` in float32, which is transformers'
    ``x.float() * cos + rotate_half(x.float()) * sin`` term for term (``signed_sin``
    carries the sign ``rotate_half`` gives the first half; a bfloat16 ``x`` times a
    float32 table is computed in float32 on the exactly widened ``x``), in four kernels
    and a copy back instead of two casts, a negation and a concatenation per tensor."""

    cos: torch.Tensor
    """[N, 1, 1, head_dim] float32."""
    signed_sin: torch.Tensor
    """[N, 1, 1, head_dim] float32: -sin on the first half, sin on the second."""

    @classmethod
    def from_angles(cls, angles: torch.Tensor) -> VisionRotary:
        """angles [N, head_dim / 2] float32."""
        cos, sin = angles.cos(), angles.sin()
        return cls(
            torch.cat([cos, cos], dim=-1)[:, None, None, :],
            torch.cat([-sin, sin], dim=-1)[:, None, None, :],
        )

    def rotate_(self, qk: torch.Tensor) -> None:
        """Rotate qk [N, 2, heads, head_dim] (q and k; may be a strided view) in place."""
        half = qk.shape[-1] // 2
        swapped = qk.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        qk.copy_(qk * self.cos + swapped * self.signed_sin)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rotary: VisionRotary, segments: Segments) -> torch.Tensor:
        """x [N, dim] -> [N, dim]."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, -1)
        rotary.rotate_(qkv[:, :2])
        return self.proj(segment_attention(qkv, segments))


HIDDEN_ALIGNMENT = 64
"""The MLP's hidden size is padded to a multiple of this (the 7B's 3,420 to 3,456), so
that its activations' rows start 128-byte aligned in bfloat16, as Hopper's fast GEMM
kernels want; the padding's weights are zero, so the function is unchanged."""


class VisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up as one GEMM: ``gate_up_proj`` holds
    the checkpoint's ``gate_proj`` rows, zeros up to the padded hidden size, then
    ``up_proj``'s and zeros; ``down_proj`` has zero columns for the padding (``load``
    fills them). The padding rows compute ``act(0) * 0 = 0``."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.hidden = hidden
        padded = -(-hidden // HIDDEN_ALIGNMENT) * HIDDEN_ALIGNMENT
        self.gate_up_proj = nn.Linear(dim, 2 * padded)
        self.down_proj = nn.Linear(padded, dim)
        if act == "silu":
            self.act_and_mul: nn.Module = SiluAndMul()  # platforms fuse it
        else:
            self.act_and_mul = _ActAndMul(vision_activation(act))

    def load(self, projection: str, name: str, tensor: torch.Tensor) -> None:
        """Copy the checkpoint's ``{projection}_proj.{name}`` ("gate", "up" or "down";
        "weight" or "bias") into its place, zeroing the padding next to it."""
        if projection == "down":
            param = getattr(self.down_proj, name)
            if name == "weight":
                param[:, self.hidden :].zero_()
                param = param[:, : self.hidden]
            param.copy_(tensor)
            return
        param = getattr(self.gate_up_proj, name)
        half = param.shape[0] // 2
        start = 0 if projection == "gate" else half
        param[start + self.hidden : start + half].zero_()
        param[start : start + self.hidden].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class _ActAndMul(nn.Module):
    def __init__(self, act) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


class VisionBlock(nn.Module):
    """Pre-norm block in the residual-stream form the decoder uses: ``forward(delta,
    residual)`` adds the previous block's output to the residual inside ``norm1`` (one
    fused kernel where the platform gives RMSNorm one) and returns this block's output
    and the new residual; their sum is transformers' hidden state after the block."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim = vision["hidden_size"]
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, vision["num_heads"])
        self.mlp = VisionMLP(dim, vision["intermediate_size"], vision.get("hidden_act", "silu"))

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        rotary: VisionRotary,
        segments: Segments,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``delta`` None: ``residual`` is the block's input as it is."""
        if delta is None:
            h = self.norm1(residual)
        else:
            h, residual = self.norm1(delta, residual)
        h, residual = self.norm2(self.attn(h, rotary, segments), residual)
        return self.mlp(h), residual


class PatchMerger(nn.Module):
    """[N, dim] in merge groups -> [N / merge^2, out_dim]: RMS-normed, each group's
    patches concatenated, then a two-layer GELU MLP."""

    def __init__(self, dim: int, out_dim: int, merge: int) -> None:
        super().__init__()
        self.group_dim = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.group_dim, self.group_dim), nn.GELU(), nn.Linear(self.group_dim, out_dim)
        )

    def forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last block's output and residual (summed inside the norm)."""
        normed, _ = self.ln_q(delta, residual)
        return self.mlp(normed.view(-1, self.group_dim))


class PatchEmbed(nn.Module):
    """[N, C * T * P * P] -> [N, dim]: the checkpoint's Conv3d kernel (stride = kernel) as
    one matrix product."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        patch, temporal = vision.get("patch_size", 14), vision.get("temporal_patch_size", 2)
        channels = vision.get("in_channels", vision.get("in_chans", 3))  # published: in_chans
        dim = vision["hidden_size"]
        self.proj = nn.Conv3d(
            channels, dim, (temporal, patch, patch), (temporal, patch, patch), bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(x.to(weight.dtype), weight.view(weight.shape[0], -1))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = vision["hidden_size"], vision["num_heads"]
        self.num_heads = heads
        self.merge = vision.get("spatial_merge_size", 2)
        self.window = vision.get("window_size", 112) // self.merge // vision.get("patch_size", 14)
        self.full_attention = set(vision.get("fullatt_block_indexes", ()))
        self.patch_embed = PatchEmbed(vision)
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        half = dim // heads // 2  # rotary features per axis (rows, then columns)
        inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision["depth"]))
        self.merger = PatchMerger(dim, vision["out_hidden_size"], self.merge)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, C * T * P * P], grid_thw [num_images, 3] ->
        [num_patches / merge^2, out_hidden_size]."""
        grid = grid_thw.detach().cpu().numpy().astype(np.int64)
        unit = self.merge * self.merge
        order, window_lengths = window_order(grid, self.merge, self.window)
        frame_lengths = [int(h * w) for t, h, w in grid.tolist() for _ in range(t)]
        device, dtype = pixel_values.device, self.patch_embed.proj.weight.dtype
        # Every host-built index first, before any kernel is queued behind them.
        order_t = to_device(order, device)
        restore = to_device(np.argsort(order), device)
        positions = to_device(patch_positions(grid, self.merge), device)
        row_shape = (3, self.num_heads, self.blocks[0].attn.head_dim)
        windows = Segments.build(window_lengths, device, dtype, row_shape)
        frames = Segments.build(frame_lengths, device, dtype, row_shape)
        x = self.patch_embed(pixel_values)
        x = x.view(-1, unit, x.shape[-1]).index_select(0, order_t).flatten(0, 1)
        angles = (positions[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = angles.view(-1, unit, angles.shape[-1]).index_select(0, order_t).flatten(0, 1)
        rotary = VisionRotary.from_angles(angles)
        delta: torch.Tensor | None = None
        for index, block in enumerate(self.blocks):
            segments = frames if index in self.full_attention else windows
            delta, x = block(delta, x, rotary, segments)
        assert delta is not None, "the tower has no blocks"
        return self.merger(delta, x).index_select(0, restore)
