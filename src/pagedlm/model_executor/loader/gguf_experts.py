"""GGUF mixture-of-experts tensors, cut into one 2-D read per expert.

Mixture-of-experts files (qwen2moe, qwen3moe, and llama files with ``llama.expert_count``:
Mixtral) stack each layer's experts into one ``[experts, out, in]`` tensor per projection
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``; gate and up fused into
``ffn_gate_up_exps`` by ``--fuse-gate-up-exps``; one 2-D ``ffn_gate.{e}`` per expert in early
Mixtral files). Quantized blocks run along rows, so every expert's rows are a byte range
of their own: each becomes a 2-D tensor of its own under the HF per-expert name
(``mlp.experts.{e}.gate_proj``), which ``MoEForCausalLM.load_weights`` stacks again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from pagedlm.model_executor.loader.gguf_architectures import (
    GGUFArchitecture,
    hf_tensor_name,
    is_layer_tensor,
)
from pagedlm.model_executor.loader.gguf_reader import GGUFTensorInfo


def hf_entries(
    info: GGUFTensorInfo, spec: GGUFArchitecture
) -> Iterator[tuple[str, GGUFTensorInfo]]:
    """``(hf_name, info)`` for the HF tensors one file tensor holds: itself, or each
    expert's part of a stacked ``[experts, rows, cols]`` tensor (or of an early Mixtral
    file's ``blk.N.ffn_gate.E``) as a 2-D tensor of its own. Quantized blocks run along
    rows, so every expert's rows, and each equal row part of them (a fused gate/up), are a
    byte range of the file."""
    import gguf

    parts = info.name.split(".")
    stem = parts[2] if is_layer_tensor(parts) else ""
    if len(parts) == 5 and parts[3].isdigit() and f"{stem}_exps" in spec.expert_tensors:
        (path,) = spec.expert_tensors[f"{stem}_exps"]
        yield f"model.layers.{parts[1]}.{path.format(expert=parts[3])}.{parts[4]}", info
        return
    if stem not in spec.expert_tensors:
        yield hf_tensor_name(info.name, spec), info
        return
    paths = spec.expert_tensors[stem]
    if len(info.shape) != 3 or info.shape[1] % len(paths):
        raise ValueError(
            f"{info.name} has shape {info.shape}, not [experts, rows, columns]; re-convert "
            "the model."
        )
    num_experts, rows, cols = info.shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
    row_bytes = cols // block_size * type_size
    part_rows = rows // len(paths)
    for expert in range(num_experts):
        for index, path in enumerate(paths):
            offset = info.offset + (expert * rows + index * part_rows) * row_bytes
            yield (
                f"model.layers.{parts[1]}.{path.format(expert=expert)}.{parts[-1]}",
                replace(info, shape=(part_rows, cols), offset=offset),
            )
