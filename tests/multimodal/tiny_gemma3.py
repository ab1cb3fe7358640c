"""A tiny random Gemma 3 vision-language checkpoint with its processor.

SigLIP tower 32x32 pixels in 8x8 patches (a 4x4 grid), pooled 2x2 to 4 image tokens, a
2-layer Gemma 3 decoder (one sliding-window layer, one global); a byte-level BPE
tokenizer with ``<start_of_image>``, ``<image_soft_token>`` and ``<end_of_image>``, and a
Gemma3Processor that resizes any image to 32x32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from multimodal.tiny_common import bpe_tokenizer, randomize

IMAGE_TOKENS = 4
WEIGHT_STD = 0.1
BOI = "<start_of_image>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = ["<start_of_turn>user\ndescribe the picture.<end_of_turn>\n<start_of_turn>model\na cat."]
SPECIAL = ["<pad>", "<eos>", "<bos>", BOI, "<image_soft_token>", "<end_of_image>"]


def _tokenizer():
    return bpe_tokenizer(
        CORPUS,
        SPECIAL + ["<start_of_turn>", "<end_of_turn>"],
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        extra_special_tokens={
            "boi_token": BOI,
            "image_token": "<image_soft_token>",
            "eoi_token": "<end_of_image>",
        },
    )


def save_tiny_gemma3(path: Path) -> torch.nn.Module:
    """Checkpoint + processor in ``path``; returns transformers' model (fp32, eval)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer = _tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        image_seq_length=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=12,  # shorter than the prompts: the local layer's window matters
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["<eos>"],
        bos_token_id=ids["<bos>"],
        # An untied random head: a tied one mostly echoes the last prompt token.
        tie_word_embeddings=False,
    )
    vision = SiglipVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=ids[BOI],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
    )
    # Gemma norms store weight - 1
    model = randomize(Gemma3ForConditionalGeneration(config), (-0.5, 0.5), WEIGHT_STD)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model.eval()
