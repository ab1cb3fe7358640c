"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the vision transformer of
``vision/qwen2_5_vit.py`` and a Qwen2 decoder whose rotary is M-RoPE.

The decoder *is* ``Qwen2ForCausalLM`` over the flattened layout; its rotary module comes
from the config's ``mrope_section`` (``layers/rotary_mrope.py``), so it takes positions
[T] (text: the three parts are equal) or [3, T] (a step that feeds image tokens).
``uses_mrope`` asks the model runner for those positions: it computes each request's
three-part prompt positions and its decode offset once when the request is admitted
(``pagedlm.multimodal.mrope``) and builds every step's positions from them.

- ``embed_multimodal(tensors)``: ``pixel_values`` [num_patches, C * T * P * P] and
  ``image_grid_thw`` [N, 3] -> [sum of the images' tokens, hidden], image after image;
- ``embed_input_ids`` and ``forward(..., inputs_embeds=...)`` as LLaVA's (``llava.py``).

Checkpoint names: the published layout (``model.*`` decoder, ``visual.*``, ``lm_head``)
and transformers 5's (``model.language_model.*``, ``model.visual.*``) both load; each
vision block's ``mlp.gate_proj`` and ``mlp.up_proj`` go into the halves of its one
``mlp.gate_up_proj``, and ``mlp.down_proj`` into its padded twin (zeros beyond the
checkpoint's hidden size).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import ClassVar

import torch

from pagedlm.config import ArchConfig
from pagedlm.distributed.pipeline import IntermediateTensors
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.models.llama import Qwen2ForCausalLM
from pagedlm.model_executor.models.vision.qwen2_5_vit import Qwen2_5_VisionTransformer
from pagedlm.model_executor.models.vision_language import require_one_stage, split_vision_weights

_VISION_MLP = re.compile(
    r"(?:model\.)?visual\.blocks\.(\d+)\.mlp\.(gate|up|down)_proj\.(weight|bias)"
)
"""A vision block's MLP projection in the checkpoint (either naming)."""


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True
    packed_multimodal_inputs: ClassVar[bool] = True
    """Images of any sizes encode in one call (patches concatenated, one grid row each)."""
    host_multimodal_inputs: ClassVar[frozenset[str]] = frozenset({"image_grid_thw"})
    """The tower plans its windows from the grids on the host: the encoder runner keeps
    them there."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        require_one_stage()
        if arch.rope_scaling is None or arch.rope_scaling.get("rope_type") != "mrope":
            raise ValueError(
                "Qwen2.5-VL needs M-RoPE: config.json's rope_parameters (or rope_scaling) "
                "must carry mrope_section."
            )
        super().__init__(replace(arch, architecture="Qwen2ForCausalLM"), max_model_len)
        self.arch = arch
        vision = dict(arch.raw["vision_config"])
        self.visual = Qwen2_5_VisionTransformer(vision)
        self.spatial_merge_size = int(vision.get("spatial_merge_size", 2))
        """Patches per side of one decoder token (the M-RoPE positions need it)."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_multimodal(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.visual(tensors["pixel_values"], tensors["image_grid_thw"])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """As ``Qwen2ForCausalLM``; ``positions`` [T] or [3, T]; with ``inputs_embeds``
        [T, hidden] the decoder starts from them instead of ``input_ids``' embeddings."""
        if inputs_embeds is not None:
            intermediate = {"hidden_states": inputs_embeds, "residual": None}
        return self.model(input_ids, positions, ctx, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        parts: set[tuple[str, str]] = set()
        rest = self._load_vision_mlp(weights, parts)
        text = split_vision_weights(self, rest, (), loaded)
        decoder = super().load_weights(text)  # consumes ``text``, which fills ``loaded``
        # gate_up_proj counts as loaded once both of its halves were.
        for name, part in parts:
            if part == "down" or (part == "gate" and (name, "up") in parts):
                loaded.add(name)
        return loaded | decoder

    def _load_vision_mlp(
        self, weights: Iterable[tuple[str, torch.Tensor]], parts: set[tuple[str, str]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy the vision blocks' MLP tensors into ``gate_up_proj`` and the padded
        ``down_proj`` (noting each (parameter name, projection) in ``parts``); yield every
        other tensor."""
        blocks = self.visual.blocks
        for name, tensor in weights:
            match = _VISION_MLP.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            block, projection, kind = int(match[1]), match[2], match[3]
            if block >= len(blocks):
                raise ValueError(
                    f"checkpoint tensor {name!r} names vision block {block}, but "
                    f"vision_config has depth {len(blocks)}; check config.json."
                )
            blocks[block].mlp.load(projection, kind, tensor)
            fused = "down_proj" if projection == "down" else "gate_up_proj"
            parts.add((f"visual.blocks.{block}.mlp.{fused}.{kind}", projection))
