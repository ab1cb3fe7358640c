"""Qwen2.5-VL's transformers processor for images only.

``Qwen2_5_VLProcessor`` insists on a video processor, and transformers' Qwen2-VL video
processor needs torchvision, which pagedlm does not depend on (``AutoProcessor`` fails
without it, even for image-only use). pagedlm takes no videos, so this subclass drops that
one argument and keeps everything else transformers' own: the image processor
(``AutoImageProcessor`` from the checkpoint's ``preprocessor_config.json``: resizing,
normalization, patchification into ``pixel_values`` and ``image_grid_thw``), the tokenizer,
the chat template and the expansion of each ``<|image_pad|>`` to the image's token count
(``Qwen2_5_VLProcessor.replace_image_token``).
"""

from __future__ import annotations

from typing import Any


def load_qwen2_5_vl_processor(source: str) -> Any:
    return images_only_processor_class().from_pretrained(source)


def images_only_processor_class() -> type:
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # Qwen2_5_VLProcessor.__init__'s token lookups, without the video processor.
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2_5_VLImageProcessor


def pixel_bounds_as_size(kwargs: dict[str, Any], processor: Any) -> dict[str, Any]:
    """``min_pixels``/``max_pixels`` (the names vLLM's examples and Qwen's model cards
    use) as the ``size`` bounds transformers' Qwen2-VL image processor now reads
    (``shortest_edge``/``longest_edge``: it warns that the call-time names are going away);
    the other bound is the processor's own."""
    if "min_pixels" not in kwargs and "max_pixels" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    own = processor.image_processor.size
    size = {
        "shortest_edge": getattr(own, "shortest_edge", None),
        "longest_edge": getattr(own, "longest_edge", None),
        **(kwargs.get("size") or {}),
    }
    if "min_pixels" in kwargs:
        size["shortest_edge"] = kwargs.pop("min_pixels")
    if "max_pixels" in kwargs:
        size["longest_edge"] = kwargs.pop("max_pixels")
    kwargs["size"] = size
    return kwargs
