"""What the tiny vision-language checkpoints share: a byte-level BPE tokenizer trained on
a one-line corpus, random weights, random images, and transformers' greedy answers."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def bpe_tokenizer(corpus: list[str], special_tokens: list[str], **named_tokens):
    """A ``PreTrainedTokenizerFast`` over a 300-token BPE vocabulary whose first ids are
    ``special_tokens``; ``named_tokens`` (``eos_token="..."``, ``extra_special_tokens``)
    go to the tokenizer as they are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **named_tokens)


def randomize(model: torch.nn.Module, norm_range: tuple[float, float], std: float = 0.1):
    """Seeded random weights (norm weights uniform in ``norm_range``); returns ``model``."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(*norm_range)
            else:
                param.normal_(0.0, std)
    return model


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@functools.cache
def hf_processor(path: Path):
    """The checkpoint's ``AutoProcessor``, loaded once per test process."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def hf_greedy(
    model: torch.nn.Module, path: Path, text: str, images: list, new_tokens: int, processor=None
):
    """transformers' greedy continuation (exactly ``new_tokens`` ids, EOS not stopping);
    ``processor`` defaults to the checkpoint's ``AutoProcessor``."""
    processor = processor or hf_processor(path)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
