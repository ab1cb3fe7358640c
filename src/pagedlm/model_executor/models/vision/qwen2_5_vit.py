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

Parameter names follow transformers' ``Qwen2_5_VisionTransformerPretrainedModel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

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


@dataclass(frozen=True)
class Segments:
    """Consecutive runs of rows that attend only among themselves (windows, or frames),
    laid out for one batched SDPA call: ``num`` segments padded to ``longest`` rows.
    Built once per forward and shared by the blocks (no host work per layer)."""

    num: int
    longest: int
    rows: torch.Tensor | None
    """[N] each row's index in the padded [num * longest] layout; None: no padding (all
    segments equally long)."""
    valid: torch.Tensor | None
    """[num, 1, 1, longest] which padded keys are real."""

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> Segments:
        longest = max(lengths)
        if all(length == longest for length in lengths):
            return cls(len(lengths), longest, None, None)
        lens = np.asarray(lengths)
        starts = np.cumsum(lens) - lens
        rows = np.repeat(np.arange(len(lens)) * longest - starts, lens) + np.arange(lens.sum())
        valid = np.arange(longest)[None, :] < lens[:, None]
        return cls(
            len(lengths),
            longest,
            torch.from_numpy(rows).to(device),
            torch.from_numpy(valid).to(device)[:, None, None, :],
        )


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """Bidirectional attention within each segment: q, k, v [N, heads, head_dim] ->
    [N, heads, head_dim] (padding keys masked, padding queries dropped)."""
    n, heads, dim = q.shape
    shape = (segments.num, segments.longest, heads, dim)
    if segments.rows is None:
        qs, ks, vs = (x.view(shape).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(n, heads, dim)
    rows = segments.rows
    padded = [
        x.new_zeros(segments.num * segments.longest, heads, dim).index_copy_(0, rows, x)
        for x in (q, k, v)
    ]
    qs, ks, vs = (x.view(shape).transpose(1, 2) for x in padded)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=segments.valid)
    return out.transpose(1, 2).reshape(-1, heads, dim).index_select(0, rows)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        """x [N, dim]; cos, sin [N, 1, head_dim] (float32): the rotation is in float32."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, segments).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim = vision["hidden_size"]
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, vision["num_heads"])
        self.mlp = VisionMLP(dim, vision["intermediate_size"], vision.get("hidden_act", "silu"))

    def forward(self, x, cos, sin, segments: Segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))


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
        device = pixel_values.device
        order_t = torch.from_numpy(order).to(device)
        x = self.patch_embed(pixel_values)
        x = x.view(-1, unit, x.shape[-1]).index_select(0, order_t).flatten(0, 1)
        positions = torch.from_numpy(patch_positions(grid, self.merge)).to(device)
        angles = (positions[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = angles.view(-1, unit, angles.shape[-1]).index_select(0, order_t).flatten(0, 1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        windows = Segments.build(window_lengths, device)
        frames = Segments.build(frame_lengths, device)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in self.full_attention else windows)
        merged = self.merger(x)
        restore = torch.from_numpy(np.argsort(order)).to(device)
        return merged.index_select(0, restore)
