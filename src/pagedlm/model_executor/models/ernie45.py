"""Baidu ERNIE 4.5 (dense, ``Ernie4_5ForCausalLM``): Llama with interleaved rotary.

Against Llama: rotary pairs are adjacent features ``(x[2i], x[2i + 1])`` (GPT-J's layout,
``is_neox_style=False``) instead of the head's two halves, and one config flag,
``use_bias``, puts a bias on every projection (q/k/v/o and the MLP's). The blocks are
Llama's; the interleaved layout is the rotary module's ``is_neox_style``, which every
kernel that rotates reads (or declines on).
"""

from __future__ import annotations

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.llama import BlockOptions, LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        bias = bool(arch.raw.get("use_bias", False))
        return BlockOptions(qkv_bias=bias, o_proj_bias=bias, mlp_bias=bias)

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__(arch, max_model_len)
        for module in self.modules():
            if not isinstance(module, RotaryEmbedding):
                continue
            if type(module) is not RotaryEmbedding:
                raise ValueError(
                    f"ERNIE 4.5 rotates adjacent feature pairs, which {type(module).__name__} "
                    "(partial rotation or LongRoPE/M-RoPE scaling) does not support; "
                    "check rope_parameters and partial_rotary_factor in config.json."
                )
            module.is_neox_style = False
