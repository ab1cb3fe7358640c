"""A tiny random LLaVA-1.5 checkpoint with its processor, and transformers' answers on it.

CLIP tower 32x32 pixels in 8x8 patches (16 image tokens per image), a 2-layer Llama
decoder; a byte-level BPE tokenizer with ``<image>``, and a LlavaProcessor whose image
processor resizes any image to 32x32, so images of different sizes give the same count.
"""

from __future__ import annotations

from pathlib import Path

import torch

from multimodal.tiny_common import bpe_tokenizer, hf_greedy, hf_processor, random_image, randomize

__all__ = ["hf_greedy", "hf_processor", "random_image", "save_tiny_llava"]

IMAGE_TOKENS = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
CORPUS = ["USER: describe the picture. ASSISTANT: a cat sits on a mat, a dog runs by."]


def _tokenizer():
    return bpe_tokenizer(
        CORPUS,
        ["<s>", "</s>", "<image>"],
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
    )


def save_tiny_llava(path: Path) -> torch.nn.Module:
    """Checkpoint + processor in ``path``; returns transformers' model (fp32, eval)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer()
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        num_additional_image_tokens=1,  # CLIP's class token, which "default" drops
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    vision = CLIPVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token)
    model = randomize(LlavaForConditionalGeneration(config), (0.5, 1.5))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model.eval()
