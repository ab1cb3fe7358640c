"""Phi-3: a Llama-shaped decoder whose checkpoints store q/k/v and gate/up already fused.

Differences from Llama that live elsewhere: LongRoPE scaling and partial rotation come
from ``get_rope_for_arch``; the config's ``sliding_window`` (every layer) from
``layer_sliding_windows``. Here only the checkpoint layout: ``qkv_proj.weight``
[(heads + 2 * kv_heads) * head_dim, hidden] and ``gate_up_proj.weight`` [2 * inter, hidden]
are split back into the per-projection tensors the tensor-parallel loaders expect, so
each rank still takes its own heads and its own slice of the intermediate size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedlm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfuse(weights))

    def _unfuse(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield HF-Llama names: fused tensors become views of their parts (no copies)."""
        arch = self.arch
        q_size = arch.num_attention_heads * arch.head_dim
        kv_size = arch.num_key_value_heads * arch.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has {tensor.shape[0]} rows but config.json "
                        f"implies {q_size + 2 * kv_size} (q {q_size} + k, v {kv_size} each); "
                        "the checkpoint does not match its config."
                    )
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield name.replace(".qkv_proj.", f".{part}."), value
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
