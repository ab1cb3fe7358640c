"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, a
projector that average-pools its patches to ``mm_tokens_per_image`` and projects them
(RMS-normed) to the decoder's width, and the Gemma 3 decoder (``gemma3.py``) unchanged.

Against LLaVA (``llava.py``), two things differ:

- the decoder scales token embeddings by ``sqrt(hidden_size)``; images' rows are not
  scaled (transformers scatters them into the already-scaled embeddings), so
  ``embed_input_ids`` returns scaled rows and ``forward(inputs_embeds=...)`` skips it;
- an image's tokens attend to each other both ways (``bidirectional_images``): the front
  end marks its features ``bidirectional``, the scheduler feeds an image whole, and the
  attention backend lets a step's positions of one image see each other
  (``BatchLayout.bidirectional_spans``); a backend that cannot is refused at load.

Checkpoint names: transformers 5 (``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``) and the older layout (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``) both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.pipeline import IntermediateTensors
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.gemma_norm import GemmaRMSNorm
from pagedlm.model_executor.models.gemma3 import Gemma3ForCausalLM
from pagedlm.model_executor.models.vision.siglip import SiglipVisionTransformer
from pagedlm.model_executor.models.vision_language import require_one_stage, split_vision_weights


class Gemma3MultiModalProjector(nn.Module):
    """[N, patches, vision_hidden] -> [N, mm_tokens_per_image, text_hidden]: the patch grid
    average-pooled to ``tokens_per_side`` squared, RMS-normed, then projected."""

    def __init__(self, vision: dict, text_hidden: int, mm_tokens_per_image: int) -> None:
        super().__init__()
        hidden = vision["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, vision.get("layer_norm_eps", 1e-6))
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = int(mm_tokens_per_image**0.5)
        if tokens_per_side**2 != mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image={mm_tokens_per_image} must be a square whose side "
                f"divides the {self.patches_per_side} patches per side of the image."
            )
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    bidirectional_images: ClassVar[bool] = True

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        require_one_stage()
        super().__init__(replace(arch, architecture="Gemma3ForCausalLM"), max_model_len)
        self.arch = arch
        raw = arch.raw
        vision = dict(raw["vision_config"])
        if vision.get("vision_use_head"):
            raise ValueError("Gemma 3 reads SigLIP's patch states; set vision_use_head=false.")
        self.vision_tower = SiglipVisionTransformer(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision, arch.hidden_size, int(raw.get("mm_tokens_per_image", 256))
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.model.normalizer, dtype=x.dtype)

    def embed_multimodal(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``pixel_values`` [N, C, H, W] -> [N * mm_tokens_per_image, hidden]."""
        states = self.vision_tower(tensors["pixel_values"])
        return self.multi_modal_projector(states).flatten(0, 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """As ``Gemma3ForCausalLM``; with ``inputs_embeds`` [T, hidden] (already scaled,
        from ``embed_input_ids``) the decoder starts from them."""
        if inputs_embeds is not None:
            intermediate = {"hidden_states": inputs_embeds}
        return self.model(input_ids, positions, ctx, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        text = split_vision_weights(self, weights, (), loaded)
        decoder = super().load_weights(text)  # consumes ``text``, which fills ``loaded``
        return loaded | decoder
