"""The multimodal benchmark's model shapes: per family, a checkpoint directory without
weights (config.json, a generated word-level tokenizer with the shape's vocabulary and
special-token ids, transformers' image processor), the prompt, and transformers' model
class, processor and vision-encoder call for the comparison.

Families: LLaVA-1.5 (CLIP ViT-L/14 at 336 px, 576 image tokens, Llama decoder) and
Qwen2.5-VL (its window-attention ViT at the image's own size: 1024x768 becomes 756x1036
pixels, 54x74 patches, 999 decoder tokens; Qwen2 decoder with M-RoPE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _word_tokenizer(words: list[str], special: dict[str, int], vocab_size: int, **names):
    """A whitespace word-level tokenizer: ``words`` first, ``special`` tokens (added,
    never split) at their ids, filler words up to ``vocab_size``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    taken = set(special.values())
    vocab: dict[str, int] = {}
    next_id = 0
    for word in words + [f"w{i}" for i in range(vocab_size)]:
        while next_id in taken:
            next_id += 1
        if next_id >= vocab_size:
            break
        if word not in vocab:
            vocab[word] = next_id
            next_id += 1
    vocab.update(special)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special if t not in words]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    for token, token_id in special.items():
        if tokenizer.convert_tokens_to_ids(token) != token_id:
            raise RuntimeError(f"the generated tokenizer put {token} at the wrong id")
    return tokenizer


@dataclass(frozen=True)
class Family:
    question: str
    write: Callable[[Path, dict[str, Any]], None]
    """(directory, shape) -> config.json, tokenizer and processor files in it."""
    hf_model: Callable[[], type]
    hf_processor: Callable[[Path], Any]
    hf_encode: Callable[[Any, Any], Any]
    """(transformers' model, its processor's outputs for one image) -> the image rows."""


LLAVA_QUESTION = "USER: <image>\nDescribe the image in detail. ASSISTANT:"


def _write_llava(directory: Path, shape: dict[str, Any]) -> None:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
    )

    text, vision = shape["text"], shape["vision"]
    words = ["<unk>", "<s>", "</s>", *LLAVA_QUESTION.replace("<image>", "").split()]
    tokenizer = _word_tokenizer(
        words,
        {"<image>": 32000},  # LLaVA-1.5's id, an added special token
        text["vocab_size"],
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",  # transformers' batch is padded (every prompt is as long)
        extra_special_tokens={"image_token": "<image>"},
    )
    size = vision["image_size"]
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
    )
    config = LlavaConfig(
        text_config=LlamaConfig(**text, bos_token_id=1, eos_token_id=2),
        vision_config=CLIPVisionConfig(**vision),
        image_token_index=32000,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(directory)
    processor.save_pretrained(directory)


def _auto_processor(directory: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory)


def _llava_model() -> type:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration


QWEN_QUESTION = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image in "
    "detail.<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_SPECIAL = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
"""Qwen2.5-VL's ids for its special tokens."""


def _write_qwen2_5_vl(directory: Path, shape: dict[str, Any]) -> None:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagedlm.multimodal.qwen_vl_processor import images_only_processor_class

    text, vision = shape["text"], shape["vision"]
    words = ["<unk>", "user", "assistant", "Describe", "the", "image", "in", "detail."]
    tokenizer = _word_tokenizer(
        words,
        QWEN_SPECIAL,
        text["vocab_size"],
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    processor = images_only_processor_class()(
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer
    )
    config = Qwen2_5_VLConfig(
        text_config={**text, "eos_token_id": 151645, "bos_token_id": 151643},
        vision_config=vision,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(directory)
    processor.save_pretrained(directory)


def _qwen_processor(directory: Path) -> Any:
    from pagedlm.multimodal.qwen_vl_processor import load_qwen2_5_vl_processor

    return load_qwen2_5_vl_processor(str(directory))


def _qwen_model() -> type:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


FAMILIES = {
    "llava": Family(
        LLAVA_QUESTION,
        _write_llava,
        _llava_model,
        _auto_processor,
        lambda model, inputs: model.model.get_image_features(pixel_values=inputs["pixel_values"]),
    ),
    "qwen2_5_vl": Family(
        QWEN_QUESTION,
        _write_qwen2_5_vl,
        _qwen_model,
        _qwen_processor,
        lambda model, inputs: model.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ),
    ),
}

_QWEN_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    hidden_act="silu",
    tokens_per_second=2,
)

SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {
        "family": "llava",
        "text": dict(
            vocab_size=32064,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        "vision": dict(
            image_size=336,
            patch_size=14,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            projection_dim=768,
        ),
    },
    "tiny": {
        "family": "llava",
        "text": dict(
            vocab_size=32064,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        ),
        "vision": dict(
            image_size=56,
            patch_size=14,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=64,
        ),
    },
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json.
    "qwen2.5-vl-7b": {
        "family": "qwen2_5_vl",
        "text": dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [16, 24, 24],
            },
        ),
        "vision": _QWEN_VISION,
    },
    "qwen2.5-vl-tiny": {
        "family": "qwen2_5_vl",
        "text": dict(
            vocab_size=152064,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        ),
        "vision": {
            **_QWEN_VISION,
            "depth": 4,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_heads": 2,
            "out_hidden_size": 128,
            "fullatt_block_indexes": [1, 3],
        },
    },
}
