"""A tiny random Qwen2.5-VL checkpoint with its processor.

Vision tower: 14-pixel patches, 2x2 merged into one decoder token, windows of 2x2 merged
tokens (``window_size`` 56 pixels), four blocks of which 1 and 3 attend to the whole
image; a 2-layer Qwen2 decoder with M-RoPE (``mrope_section`` [2, 3, 3] of 8 pairs). The
image processor keeps each image between 2 and 24 decoder tokens, so images of different
sizes get different grids (and several windows). Transformers' processor is loaded images
only (``pagedlm.multimodal.qwen_vl_processor``): its video processor needs torchvision.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from multimodal.tiny_common import bpe_tokenizer, randomize

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["<|im_start|>user\ndescribe the picture.<|im_end|>\n<|im_start|>assistant\na cat."]
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def _tokenizer():
    return bpe_tokenizer(
        CORPUS,
        SPECIAL,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )


@functools.cache
def processor(path: Path):
    """transformers' Qwen2.5-VL processor (images only) for the checkpoint in ``path``."""
    from pagedlm.multimodal.qwen_vl_processor import load_qwen2_5_vl_processor

    return load_qwen2_5_vl_processor(str(path))


def save_tiny_qwen2_5_vl(path: Path) -> torch.nn.Module:
    """Checkpoint + processor in ``path``; returns transformers' model (fp32, eval)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagedlm.multimodal.qwen_vl_processor import images_only_processor_class

    tokenizer = _tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 24)
    hf_processor = images_only_processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": None,
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1, 3],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = randomize(Qwen2_5_VLForConditionalGeneration(config), (0.5, 1.5))
    model.save_pretrained(path)
    hf_processor.save_pretrained(path)
    return model.eval()
