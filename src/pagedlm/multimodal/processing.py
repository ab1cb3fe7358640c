"""The front end's multimodal step: prompt text + images -> token ids and features.

Preprocessing is the model's own transformers processor (``AutoProcessor`` from the model
directory), so resizing, normalization and the expansion of each image's placeholder to
its number of embedding rows are exactly transformers'. What pagedlm adds: the
``mm_processor_kwargs`` the processor is called with (``processor_kwargs``), splitting the
processor's batch tensors per image, checking that each image fits the model's encoder
(``item_geometry``), finding each image's run of placeholder tokens and naming it by a
content hash (``hash_item``) for the encoder cache and the prefix cache.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.config import ModelConfig
from pagedlm.multimodal.item_geometry import (
    ItemRows,
    gemma3_rows,
    llava_rows,
    qwen2_5_vl_rows,
)
from pagedlm.multimodal.processor_kwargs import check_names
from pagedlm.multimodal.tensors import to_tensor_data
from pagedlm.step.multimodal import MultiModalFeature

ItemSplitter = Callable[[Mapping[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
"""(the processor's outputs, number of images) -> each image's own tensors."""


def _split_pixel_values(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict]:
    pixel_values = outputs["pixel_values"]
    if pixel_values.shape[0] != num_items:
        raise ValueError(
            f"the processor returned {pixel_values.shape[0]} images for {num_items} given"
        )
    return [{"pixel_values": pixel_values[i : i + 1]} for i in range(num_items)]


def _split_patches(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict]:
    """Qwen2.5-VL: ``pixel_values`` [all images' patches, C * T * P * P], cut by each
    image's ``image_grid_thw`` [num_items, 3]."""
    grid = outputs["image_grid_thw"]
    if grid.shape[0] != num_items:
        raise ValueError(f"the processor returned {grid.shape[0]} images for {num_items} given")
    patches = outputs["pixel_values"].split(grid.prod(-1).tolist())
    return [
        {"pixel_values": patches[i], "image_grid_thw": grid[i : i + 1]} for i in range(num_items)
    ]


def _auto_processor(source: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(source)


def _qwen2_5_vl_processor(source: str) -> Any:
    from pagedlm.multimodal.qwen_vl_processor import load_qwen2_5_vl_processor

    return load_qwen2_5_vl_processor(source)


def _qwen2_5_vl_kwargs(kwargs: dict[str, Any], processor: Any) -> dict[str, Any]:
    from pagedlm.multimodal.qwen_vl_processor import pixel_bounds_as_size

    return pixel_bounds_as_size(kwargs, processor)


def _same_kwargs(kwargs: dict[str, Any], processor: Any) -> dict[str, Any]:
    return kwargs


@dataclass(frozen=True)
class FamilySpec:
    """What differs between vision-language families on the front end."""

    image_token_key: str
    """config.json key of the placeholder token id."""
    split_items: ItemSplitter
    image_placeholder: str
    """The text a prompt writes per image (``"<image>"``); chat templates insert it."""
    item_rows: ItemRows
    """The embedding rows the model's encoder makes of one processed image."""
    bidirectional: bool = False
    """Whether an image's tokens attend to each other both ways in the decoder."""
    load_processor: Callable[[str], Any] = _auto_processor
    """The checkpoint directory -> its transformers processor."""
    adapt_kwargs: Callable[[dict[str, Any], Any], dict[str, Any]] = _same_kwargs
    """(checked ``mm_processor_kwargs``, the processor) -> what the processor call takes."""


FAMILIES: dict[str, FamilySpec] = {
    "LlavaForConditionalGeneration": FamilySpec(
        "image_token_index", _split_pixel_values, "<image>", llava_rows
    ),
    # The prompt writes <start_of_image>; the processor expands it to
    # "\n\n<start_of_image>" + mm_tokens_per_image x <image_soft_token> + "<end_of_image>\n\n".
    "Gemma3ForConditionalGeneration": FamilySpec(
        "image_token_index",
        _split_pixel_values,
        "<start_of_image>",
        gemma3_rows,
        bidirectional=True,
    ),
    # The prompt writes <|vision_start|><|image_pad|><|vision_end|>; the processor repeats
    # <|image_pad|> once per merged patch group (the count follows the image's size).
    "Qwen2_5_VLForConditionalGeneration": FamilySpec(
        "image_token_id",
        _split_patches,
        "<|image_pad|>",
        qwen2_5_vl_rows,
        load_processor=_qwen2_5_vl_processor,
        adapt_kwargs=_qwen2_5_vl_kwargs,
    ),
}
"""HF architecture -> its spec; an architecture not here is text-only."""


def is_multimodal(architecture: str) -> bool:
    return architecture in FAMILIES


def hash_item(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) of an item's processed tensors: names, dtypes, shapes and bytes, in
    name order. Equal pixels after preprocessing -> equal identifier, whatever the file.

    The bytes are hashed in place (the tensor's storage seen as uint8, which also covers
    dtypes numpy lacks, such as bfloat16), not copied first; sha256 because with the SHA
    instructions of current x86 CPUs it is the fastest of hashlib's collision-resistant
    digests (a 1024x768 image's 18.8 MB of float32 patches: sha256 15.7 ms, blake2b 40 ms).
    """
    digest = hashlib.sha256(b"pagedlm-mm-item")
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(name.encode() + b"\0" + str(tensor.dtype).encode() + b"\0")
        digest.update(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def placeholder_runs(token_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of ``token_id`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


class MultiModalProcessor:
    """Images + text for one model (built once per engine; the processor loads lazily,
    once, whichever thread asks first; ``process`` may run on several threads at once)."""

    def __init__(self, model_config: ModelConfig) -> None:
        arch = model_config.arch
        self.spec = FAMILIES[arch.architecture]
        self.raw_config = arch.raw
        self.image_token_id = int(arch.raw[self.spec.image_token_key])
        self.source = model_config.tokenizer or model_config.model
        self._processor: Any = None
        self._lock = threading.Lock()

    @property
    def processor(self) -> Any:
        with self._lock:
            if self._processor is None:
                self._processor = self.spec.load_processor(self.source)
        return self._processor

    def render_chat(self, conversation: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """The conversation (image parts as ``{"type": "image"}``) through the given
        ``chat_template``, else the processor's, else the tokenizer's, as text with one
        placeholder per image."""
        processor = self.processor
        template = (
            template_kwargs.pop("chat_template", None)
            or getattr(processor, "chat_template", None)
            or getattr(processor.tokenizer, "chat_template", None)
        )
        return processor.apply_chat_template(
            conversation, chat_template=template, tokenize=False, **template_kwargs
        )

    def check_kwargs(self, kwargs: Mapping[str, Any], where: str) -> None:
        """``ValueError`` naming a key of ``kwargs`` the image processor does not take."""
        check_names(kwargs, self.processor, where)

    def process(
        self, text: str, images: Sequence[Any], kwargs: Mapping[str, Any] | None = None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids with every image's placeholder expanded, and the images' features;
        ``kwargs``: checked ``mm_processor_kwargs`` for the processor call."""
        num_placeholders = text.count(self.spec.image_placeholder)
        if num_placeholders != len(images):
            raise ValueError(
                f"the prompt has {num_placeholders} image placeholder(s) "
                f"{self.spec.image_placeholder!r} but {len(images)} image(s) were given; "
                "write one placeholder per image."
            )
        outputs = self._call_processor(text, images, dict(kwargs or {}))
        token_ids = [int(t) for t in outputs["input_ids"][0].tolist()]
        items = self.spec.split_items(outputs, len(images))
        runs = placeholder_runs(token_ids, self.image_token_id)
        runs = _split_runs(runs, len(items))
        features = []
        for index, (tensors, (offset, length)) in enumerate(zip(items, runs, strict=True)):
            rows = self.spec.item_rows(tensors, self.raw_config)
            if rows != length:
                raise ValueError(
                    f"image {index}: the processor expanded its placeholder to {length} "
                    f"tokens but the model's encoder makes {rows} embedding rows of it; "
                    "check the processor options in mm_processor_kwargs."
                )
            features.append(
                MultiModalFeature(
                    modality="image",
                    identifier=hash_item(tensors),
                    offset=offset,
                    length=length,
                    tensors={name: to_tensor_data(t) for name, t in tensors.items()},
                    bidirectional=self.spec.bidirectional,
                )
            )
        return token_ids, features

    def _call_processor(self, text: str, images: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The processor's outputs; its failures (bad options, images it cannot resize)
        as ``ValueError``, which the server answers with 400 (as vLLM does)."""
        processor = self.processor
        try:
            kwargs = self.spec.adapt_kwargs(kwargs, processor)
            return processor(text=text, images=list(images), return_tensors="pt", **kwargs)
        except Exception as exc:  # transformers raises many types for bad options
            with_kwargs = f" with mm_processor_kwargs {kwargs}" if kwargs else ""
            # Some messages start with the processor's whole repr; the reason ends them.
            lines = str(exc).strip().splitlines() or [""]
            raise ValueError(
                f"the image processor {type(processor).__name__} failed{with_kwargs}: "
                f"{type(exc).__name__}: {lines[-1].strip()[:300]}"
            ) from None


def _split_runs(runs: list[tuple[int, int]], num_items: int) -> list[tuple[int, int]]:
    """One (offset, length) per item: adjacent images (``<image><image>``) form one run,
    split evenly (a family whose images differ in size never writes them adjacent)."""
    if len(runs) == num_items:
        return runs
    total = sum(length for _, length in runs)
    if num_items == 0 or total % num_items:
        raise ValueError(
            f"cannot match {num_items} image(s) to {total} placeholder tokens in the prompt"
        )
    per_item = total // num_items
    out = []
    for offset, length in runs:
        if length % per_item:
            raise ValueError("an image's placeholder run was cut by other tokens")
        out.extend((offset + i * per_item, per_item) for i in range(length // per_item))
    return out
