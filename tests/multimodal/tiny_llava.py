"""A tiny random LLaVA-1.5 checkpoint with its processor, and transformers' answers on it.

CLIP tower 32x32 pixels in 8x8 patches (16 image tokens per image), a 2-layer Llama
decoder; a byte-level BPE tokenizer with ``<image>``, and a LlavaProcessor whose image
processor resizes any image to 32x32, so images of different sizes give the same count.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE_TOKENS = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
CORPUS = ["USER: describe the picture. ASSISTANT: a cat sits on a mat, a dog runs by."]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<image>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
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
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model.eval()


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@functools.cache
def hf_processor(path: Path):
    """The checkpoint's ``AutoProcessor``, loaded once per test process."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def hf_greedy(model: torch.nn.Module, path: Path, text: str, images: list, new_tokens: int):
    """transformers' greedy continuation (exactly ``new_tokens`` ids, EOS not stopping)."""
    inputs = hf_processor(path)(text=text, images=images or None, return_tensors="pt")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
