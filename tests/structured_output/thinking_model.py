"""A tiny llama whose next token is a table lookup on its current token, with a tokenizer
that has ``<think>`` and ``</think>``: outputs that think, end the thought and answer
exactly as a test scripts them, so grammars after the thought can be checked token by
token (greedy, with or without speculation and asynchronous scheduling).

One layer whose attention and MLP write nothing (``o_proj`` and ``down_proj`` are zero):
the last hidden state is the current token's embedding, a one-hot ``e_c`` of the token's
class ``c`` (RMS-normed to ``8 e_c``), and the LM head's column ``c`` holds the logits that
follow. A scripted token has a class of its own; its successors get logits 8, 7, 6, ... in
the order given (what a grammar masks falls to the next), every other token 0 (ties go to
the lowest id). Tokens without a script share class 0, whose only successor is EOS.
"""

from __future__ import annotations

from pathlib import Path

import torch

from server.server_utils import (
    EOS_ID,
    THINK_END_ID,
    THINK_START_ID,
    VOCAB_SIZE,
    _write_tokenizer,
)

HIDDEN = 64


def token_id(text: str) -> int:
    """The id of a one-character token (``<think>`` and ``</think>`` too) of the tiny
    byte-level tokenizer: ids 3.. are the byte alphabet, sorted."""
    if text == "<think>":
        return THINK_START_ID
    if text == "</think>":
        return THINK_END_ID
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return 3 + alphabet.index(text)


def write_scripted_checkpoint(path: Path, script: dict[str, list[str]]) -> Path:
    """``script``: a token -> the tokens that may follow it, most likely first ("EOS" is
    the end of sequence)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def ids(tokens: list[str]) -> list[int]:
        return [EOS_ID if t == "EOS" else token_id(t) for t in tokens]

    assert len(script) < HIDDEN
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    embed = torch.zeros(VOCAB_SIZE, HIDDEN)
    embed[:, 0] = 1.0
    head = torch.zeros(VOCAB_SIZE, HIDDEN)
    head[EOS_ID, 0] = 1.0
    for index, (token, successors) in enumerate(script.items(), start=1):
        embed[token_id(token)] = 0.0
        embed[token_id(token), index] = 1.0
        for rank, successor in enumerate(ids(successors)):
            head[successor, index] = 1.0 - rank / 8
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    _write_tokenizer(path, thinking=True)
    return path
