"""The Triton LoRA kernels inside a whole model: a tiny Llama with a PEFT adapter,
wrapped by the LoRA manager with the CUDA platform's ops, gives transformers' logits with
the adapter merged (interpreted on CPU; on the GPU with ``-m cuda``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_env import ON_GPU

from model_utils import full_logits
from pagedlm.config import LoRAConfig
from pagedlm.lora.manager import LoRAManager
from pagedlm.lora.request import LoRARequest
from pagedlm.model_executor.loader import load_model
from pagedlm_cpu.attention import CpuSdpaBackend
from pagedlm_cuda.kernels.lora import TritonLoRAOps
from peft_adapters import LLAMA_MODULES, make_adapter
from tiny_checkpoints import hf_logits, model_config


class _State:
    def __init__(self, lora: LoRARequest | None) -> None:
        self.lora_request = lora


@pytest.mark.skipif(
    ON_GPU, reason="the interpreted kernels on CPU tensors; the GPU runs the engine test"
)
def test_model_with_triton_lora_matches_merged_transformers(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    merged = make_adapter(base, tmp_path / "adapter", LLAMA_MODULES, rank=4)
    config = model_config(base)
    model = load_model(config, torch.device("cpu"))
    manager = LoRAManager(
        LoRAConfig(max_loras=2, max_lora_rank=8),
        config.arch,
        model,
        16,
        TritonLoRAOps(),
        torch.float32,
        torch.device("cpu"),
    )
    assert manager.graph_safe
    prompt = [3, 141, 59, 26, 5, 35]
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    manager.prepare_step([_State(lora)], np.array([0, len(prompt)]), len(prompt))
    assert manager.state.groups == []  # the kernels read token_slots only
    got = full_logits(model, config.arch, CpuSdpaBackend(torch.device("cpu")), prompt)
    want = hf_logits(merged, prompt)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    manager.prepare_step([_State(None)], np.array([0, len(prompt)]), len(prompt))
    base_logits = full_logits(model, config.arch, CpuSdpaBackend(torch.device("cpu")), prompt)
    assert not torch.allclose(base_logits, want, atol=1e-2)


@pytest.mark.cuda
def test_cuda_engine_mixed_adapters_same_tokens_with_and_without_graphs(tiny_checkpoint, tmp_path):
    """On the GPU: 3 adapters and the base model in one batch, replayed from CUDA graphs
    (the kernels read the slots buffer) and eager, give the same greedy tokens."""
    from pagedlm import LLM, SamplingParams

    base = tiny_checkpoint("llama")
    loras = []
    for index in range(3):
        make_adapter(base, tmp_path / str(index), LLAMA_MODULES, rank=8, seed=index)
        loras.append(LoRARequest(f"a{index}", index + 1, str(tmp_path / str(index))))
    prompts = [{"prompt_token_ids": [7 * i + 1] * (i + 3)} for i in range(8)]
    per_prompt = [None if i % 4 == 3 else loras[i % 4] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    for eager in (False, True):
        llm = LLM(
            str(base),
            skip_tokenizer_init=True,
            enable_lora=True,
            max_loras=3,
            dtype="float32",
            enforce_eager=eager,
            num_kv_blocks=64,
        )
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
        base_outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        assert results[-1][0] != base_outs[0].outputs[0].token_ids
        del llm
    assert results[0] == results[1]
