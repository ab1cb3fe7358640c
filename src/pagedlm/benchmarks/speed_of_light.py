"""The least time a run could take on the hardware: bytes that must move over memory
bandwidth plus compute that must happen over the matrix FLOP rate.

Counted per run, from the requests' prompt and output lengths:
- weights: every decode step reads all weights once, except the input embedding (a decode
  looks up one row per token); steps = the longest output (requests decode together);
- KV cache: generating the token at context length ``c`` reads ``c`` tokens' keys and values
  in every layer;
- prefill: ``2 * params`` FLOP per prompt token for the matmuls, plus attention's
  ``4 * layers * heads * head_dim`` FLOP per (query, key) pair of the causal triangle.
Defaults are the H200 ceilings measured on the lent machine (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.config import ArchConfig

DEFAULT_BANDWIDTH = 4.3e12
"""bytes/s, device-to-device copy (read + write) measured on the lent H200."""
DEFAULT_FLOPS = 7.9e14
"""FLOP/s, bf16 8192^3 matmul on random data measured on the lent H200."""


def weight_params(arch: ArchConfig) -> tuple[int, int]:
    """(parameters read per decode step, parameters in the matmuls of one token)."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    lm_head = arch.vocab_size * h
    body = arch.num_hidden_layers * per_layer + h
    return body + lm_head, body + lm_head


@dataclass(frozen=True)
class SpeedOfLight:
    weight_bytes: float
    kv_bytes: float
    prefill_flops: float
    bandwidth: float
    flops: float

    @property
    def seconds(self) -> float:
        return (
            self.weight_bytes + self.kv_bytes
        ) / self.bandwidth + self.prefill_flops / self.flops

    def describe(self, measured_seconds: float) -> str:
        return (
            f"speed of light {self.seconds:.3f} s (weights {self.weight_bytes / 1e9:.1f} GB, "
            f"KV {self.kv_bytes / 1e9:.1f} GB at {self.bandwidth / 1e12:.2f} TB/s; prefill "
            f"{self.prefill_flops / 1e12:.1f} TFLOP at {self.flops / 1e12:.0f} TFLOP/s): "
            f"{100 * self.seconds / measured_seconds:.1f}% of speed of light"
        )


def speed_of_light(
    arch: ArchConfig,
    prompt_lens: list[int],
    output_lens: list[int],
    dtype_bytes: int = 2,
    bandwidth: float = DEFAULT_BANDWIDTH,
    flops: float = DEFAULT_FLOPS,
) -> SpeedOfLight:
    step_params, token_params = weight_params(arch)
    steps = max(output_lens, default=0)
    kv_per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    kv_tokens = 0
    for p, o in zip(prompt_lens, output_lens):
        # Token j of the output (0-based) is produced at context length p + j.
        kv_tokens += o * p + o * (o - 1) // 2
    attention_pairs = sum(p * (p + 1) // 2 for p in prompt_lens)
    attn_flops = 4 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim
    return SpeedOfLight(
        weight_bytes=float(steps * step_params * dtype_bytes),
        kv_bytes=float(kv_tokens * kv_per_token * dtype_bytes),
        prefill_flops=float(2 * token_params * sum(prompt_lens) + attn_flops * attention_pairs),
        bandwidth=bandwidth,
        flops=flops,
    )
