"""What each family's vision encoder can take, checked on the front end.

A processor option (``crop_size``, ``patch_size``, ``merge_size``, ``image_seq_length``,
..., which ``mm_processor_kwargs`` may set) can make tensors the model's vision tower
cannot encode, or expand an image's placeholder to more or fewer tokens than the encoder
makes rows. The workers would fail the step; here it is a ``ValueError`` (HTTP 400) for
the one request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

ItemRows = Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], int]
"""(one image's processed tensors, the model's config.json) -> the embedding rows the
encoder makes of it; ``ValueError`` when the model cannot take the tensors."""

_HINT = "check the processor options in mm_processor_kwargs"


def _square_image(tensors: Mapping[str, torch.Tensor], raw: Mapping[str, Any]) -> None:
    """CLIP and SigLIP towers: pixel_values [1, C, S, S] at ``vision_config.image_size``."""
    vision = raw["vision_config"]
    size, channels = vision["image_size"], vision.get("num_channels", 3)
    shape = list(tensors["pixel_values"].shape)
    if shape != [1, channels, size, size]:
        raise ValueError(
            f"the processed image is {shape[1:]} (channels, height, width) but the model's "
            f"vision tower takes {[channels, size, size]} (vision_config.image_size); {_HINT}."
        )


def llava_rows(tensors: Mapping[str, torch.Tensor], raw: Mapping[str, Any]) -> int:
    _square_image(tensors, raw)
    vision = raw["vision_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return patches + int(raw.get("vision_feature_select_strategy", "default") == "full")


def gemma3_rows(tensors: Mapping[str, torch.Tensor], raw: Mapping[str, Any]) -> int:
    _square_image(tensors, raw)
    return int(raw.get("mm_tokens_per_image", 256))


def qwen2_5_vl_rows(tensors: Mapping[str, torch.Tensor], raw: Mapping[str, Any]) -> int:
    """pixel_values [t * h * w, C * T * P * P] with its ``image_grid_thw`` [1, 3]; the
    merger makes one row of each ``spatial_merge_size``-squared group of patches."""
    vision = raw["vision_config"]
    patch, temporal = vision.get("patch_size", 14), vision.get("temporal_patch_size", 2)
    channels = vision.get("in_channels", vision.get("in_chans", 3))
    merge = vision.get("spatial_merge_size", 2)
    pixel_values = tensors["pixel_values"]
    t, h, w = (int(n) for n in tensors["image_grid_thw"][0])
    width = channels * temporal * patch * patch
    if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
        raise ValueError(
            f"the processed image has patches of {list(pixel_values.shape[1:])} values but "
            f"the model's vision tower takes {width} (channels x temporal_patch_size "
            f"{temporal} x patch_size {patch}^2); {_HINT}."
        )
    if pixel_values.shape[0] != t * h * w or h % merge or w % merge:
        raise ValueError(
            f"the processed image's patch grid {[t, h, w]} does not merge into the model's "
            f"{merge}x{merge} groups (vision_config.spatial_merge_size); {_HINT}."
        )
    return t * h * w // merge**2
