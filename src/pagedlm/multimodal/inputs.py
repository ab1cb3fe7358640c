"""A prompt's ``multi_modal_data`` checked and turned into token ids and features.

vLLM's prompt shape: ``{"prompt": "USER: <image>\\n...", "multi_modal_data": {"image":
PIL.Image | [PIL.Image, ...]}}``. Every check raises ``ValueError`` naming the problem
before anything enters the engine: images for a text-only model, an unknown modality,
something that is not an image, more images than ``limit_mm_per_prompt``, placeholders
that do not match the images.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pagedlm.config import ModelConfig, MultiModalConfig
from pagedlm.multimodal.processing import FAMILIES, MultiModalProcessor, is_multimodal
from pagedlm.step.multimodal import MultiModalFeature


def text_only_error(model_config: ModelConfig) -> ValueError:
    return ValueError(
        f"the model {model_config.arch.architecture} is text-only and takes no images; "
        "send text only, or serve a vision-language model "
        f"({', '.join(sorted(FAMILIES))})."
    )


def _images(value: Any) -> list[Any]:
    from PIL import Image

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for index, item in enumerate(items):
        if not isinstance(item, Image.Image):
            raise ValueError(
                f"multi_modal_data['image'][{index}] is a {type(item).__name__}, not a "
                "PIL.Image.Image; open the image with PIL first."
            )
    return items


class MultiModalInputs:
    """The front end's multimodal side for one engine (the processor loads on first use).
    Thread safe: ``LLM`` and ``AsyncLLM`` preprocess prompts on thread pools."""

    def __init__(self, model_config: ModelConfig, config: MultiModalConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.supported = is_multimodal(model_config.arch.architecture)
        self._processor: MultiModalProcessor | None = None
        self._lock = threading.Lock()

    @property
    def processor(self) -> MultiModalProcessor:
        if not self.supported:
            raise text_only_error(self.model_config)
        with self._lock:
            if self._processor is None:
                self._processor = MultiModalProcessor(self.model_config)
        return self._processor

    def check_count(self, modality: str, count: int) -> None:
        limit = self.config.limit_per_prompt.get(modality, 0)
        if count > limit:
            raise ValueError(
                f"the prompt has {count} {modality}s but at most {limit} are allowed per "
                f'prompt; send fewer, or raise --limit-mm-per-prompt \'{{"{modality}": '
                f"{count}}}'."
            )

    def process(
        self, prompt: Mapping[str, Any], mm_data: Any
    ) -> tuple[str, list[int], list[MultiModalFeature]]:
        """(text, token ids, features) of a prompt dict with ``multi_modal_data``."""
        if not isinstance(mm_data, Mapping):
            raise ValueError(
                "multi_modal_data must be a dict like {'image': PIL.Image or a list of them}."
            )
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise ValueError(
                f"multi_modal_data has unsupported modalities {sorted(unknown)}; only "
                "'image' is supported."
            )
        images = _images(mm_data.get("image", []))
        if images and not self.supported:
            raise text_only_error(self.model_config)
        self.check_count("image", len(images))
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError(
                "a prompt with multi_modal_data needs its text as 'prompt' (with one "
                f"{self.processor.spec.image_placeholder!r} per image), not token ids."
            )
        if not images:
            return text, [], []
        token_ids, features = self.processor.process(text, images)
        return text, token_ids, features
