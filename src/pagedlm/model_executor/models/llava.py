"""LLaVA-1.5 style vision-language models: a CLIP vision tower, a two-layer projector and a
Llama-family decoder (``LlavaForConditionalGeneration``).

The decoder *is* ``LlamaForCausalLM`` over the flattened layout (graphs, kernels, LoRA and
KV layout unchanged); this class adds the image path:

- ``embed_multimodal(tensors)``: images' ``pixel_values`` [N, C, H, W] -> their
  embedding rows [N * num_image_tokens, hidden], image after image (the vision tower's
  ``vision_feature_layer`` states, the class token dropped under the "default" strategy,
  then the projector);
- ``embed_input_ids(input_ids)`` [T] -> [T, hidden], the text embeddings, over which the
  model runner scatters image rows at the placeholder positions;
- ``forward(..., inputs_embeds=...)`` runs the decoder from those embeddings.

Checkpoint names: transformers 5 (``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``lm_head``) and the older layout
(``language_model.model.*``, ``language_model.lm_head``, ``vision_tower.*``,
``multi_modal_projector.*``) both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.pipeline import IntermediateTensors
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.models.llama import LlamaForCausalLM
from pagedlm.model_executor.models.vision.clip import CLIPVisionTransformer, vision_activation
from pagedlm.model_executor.models.vision_language import require_one_stage, split_vision_weights

_TEXT_MODEL_TYPES = ("llama", "mistral")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    supports_multimodal: ClassVar[bool] = True

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        raw = arch.raw
        model_type = raw.get("text_config", {}).get("model_type", "llama")
        if model_type not in _TEXT_MODEL_TYPES:
            raise ValueError(
                f"LLaVA with a {model_type!r} decoder is not supported; supported decoders: "
                f"{', '.join(_TEXT_MODEL_TYPES)}."
            )
        require_one_stage()
        super().__init__(replace(arch, architecture="LlamaForCausalLM"), max_model_len)
        self.arch = arch
        vision = dict(raw["vision_config"])
        vision.setdefault("hidden_act", "quick_gelu")
        self.vision_tower = CLIPVisionTransformer(vision)
        layer = raw.get("vision_feature_layer", -2)
        self.feature_layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
        self.select_strategy = raw.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy={self.select_strategy!r} is not supported; "
                "use 'default' or 'full'."
            )
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision["hidden_size"] * len(self.feature_layers),
            arch.hidden_size,
            raw.get("projector_hidden_act", "gelu"),
            bool(raw.get("multimodal_projector_bias", True)),
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_multimodal(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``pixel_values`` [N, C, H, W] -> [N * num_image_tokens, hidden]."""
        states = self.vision_tower.hidden_states(tensors["pixel_values"], self.feature_layers)
        features = torch.cat(states, dim=-1)
        if self.select_strategy == "default":
            features = features[:, 1:]  # the class token carries no patch
        return self.multi_modal_projector(features).flatten(0, 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """As ``LlamaForCausalLM``; with ``inputs_embeds`` [T, hidden] the decoder starts
        from them instead of ``input_ids``' embeddings."""
        if inputs_embeds is not None:
            intermediate = {"hidden_states": inputs_embeds, "residual": None}
        return self.model(input_ids, positions, ctx, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        # LLaVA reads a hidden layer: SigLIP/CLIP's last norm and head are never used.
        text = split_vision_weights(
            self, weights, (".post_layernorm.", "vision_tower.head"), loaded
        )
        decoder = super().load_weights(text)  # consumes ``text``, which fills ``loaded``
        return loaded | decoder
