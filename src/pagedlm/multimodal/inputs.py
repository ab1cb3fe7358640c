"""A prompt's ``multi_modal_data`` checked and turned into token ids and features.

vLLM's prompt shape: ``{"prompt": "USER: <image>\\n...", "multi_modal_data": {"image":
PIL.Image | [PIL.Image, ...]}, "mm_processor_kwargs": {...}}`` (the last optional, over
``--mm-processor-kwargs``). Every check raises ``ValueError`` naming the problem before
anything enters the engine: images for a text-only model, an unknown modality, something
that is not an image, more images than ``limit_mm_per_prompt``, placeholders that do not
match the images, a processor option the model's image processor does not take.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pagedlm.config import ModelConfig, MultiModalConfig
from pagedlm.multimodal.processing import FAMILIES, MultiModalProcessor, is_multimodal
from pagedlm.multimodal.processor_kwargs import as_kwargs
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
        if item.width == 0 or item.height == 0:
            raise ValueError(
                f"multi_modal_data['image'][{index}] is {item.width}x{item.height} pixels; "
                "send an image with at least one pixel."
            )
    return items


class MultiModalInputs:
    """The front end's multimodal side for one engine (the processor loads on first use,
    or at once to check ``--mm-processor-kwargs``). Thread safe: ``LLM`` and ``AsyncLLM``
    preprocess prompts on thread pools."""

    def __init__(self, model_config: ModelConfig, config: MultiModalConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.supported = is_multimodal(model_config.arch.architecture)
        self._processor: MultiModalProcessor | None = None
        self._lock = threading.Lock()
        if config.mm_processor_kwargs:
            if not self.supported:
                raise ValueError(
                    f"--mm-processor-kwargs is for vision-language models; the model "
                    f"{model_config.arch.architecture} is text-only: drop the flag."
                )
            self.processor.check_kwargs(config.mm_processor_kwargs, "--mm-processor-kwargs")

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

    def processor_kwargs(self, request_kwargs: Any) -> dict[str, Any]:
        """``--mm-processor-kwargs`` with a request's ``mm_processor_kwargs`` over them
        (vLLM's merge), the request's checked against the model's image processor."""
        request_kwargs = as_kwargs(request_kwargs, "mm_processor_kwargs")
        if request_kwargs:
            if not self.supported:
                raise ValueError(
                    f"mm_processor_kwargs is for image prompts; the model "
                    f"{self.model_config.arch.architecture} is text-only: drop it."
                )
            self.processor.check_kwargs(request_kwargs, "mm_processor_kwargs")
        return {**self.config.mm_processor_kwargs, **request_kwargs}

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
        kwargs = self.processor_kwargs(prompt.get("mm_processor_kwargs"))
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError(
                "a prompt with multi_modal_data needs its text as 'prompt' (with one "
                f"{self.processor.spec.image_placeholder!r} per image), not token ids."
            )
        if not images:
            return text, [], []
        token_ids, features = self.processor.process(text, images, kwargs)
        return text, token_ids, features
