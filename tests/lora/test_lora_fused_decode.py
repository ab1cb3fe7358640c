"""The one-row fused GEMV + LoRA kernel inside a whole model (interpreted on CPU): a tiny
Llama whose linear layers run ``SingleRowLinear`` (as on CUDA), wrapped by the LoRA
manager with the Triton ops, decodes one token per step through ``gemv_lora`` and gives
transformers' logits with the adapter merged; a base-model request gives the base
model's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_setup import load_triton_env

triton_env = load_triton_env()

from model_utils import PagedRunner  # noqa: E402
from pagedlm.config import LoRAConfig  # noqa: E402
from pagedlm.lora.manager import LoRAManager  # noqa: E402
from pagedlm.lora.request import LoRARequest  # noqa: E402
from pagedlm.model_executor.layers.linear_base import LinearBase  # noqa: E402
from pagedlm.model_executor.loader import load_model  # noqa: E402
from pagedlm_cuda.fused_layers import SingleRowLinear  # noqa: E402
from pagedlm_cuda.kernels import lora_fused  # noqa: E402
from pagedlm_cuda.kernels.lora import TritonLoRAOps  # noqa: E402
from peft_adapters import LLAMA_MODULES, make_adapter  # noqa: E402
from tiny_checkpoints import hf_logits, load_hf_model, model_config  # noqa: E402


class _State:
    def __init__(self, lora: LoRARequest | None) -> None:
        self.lora_request = lora


@pytest.mark.skipif(triton_env.ON_GPU, reason="the interpreted kernels on CPU tensors")
def test_one_row_decode_steps_through_the_fused_kernel_match_merged_transformers(
    tiny_checkpoint, tmp_path, monkeypatch
):
    base = tiny_checkpoint("llama")
    merged = make_adapter(base, tmp_path / "adapter", LLAMA_MODULES, rank=4)
    config = model_config(base)
    model = load_model(config, torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.set_kernel(SingleRowLinear(module))
    manager = LoRAManager(
        LoRAConfig(max_loras=2, max_lora_rank=8),
        config.arch,
        model,
        16,
        TritonLoRAOps(),
        torch.float32,
        torch.device("cpu"),
    )
    calls = []
    original = lora_fused.gemv_lora
    monkeypatch.setattr(
        "pagedlm_cuda.kernels.lora.gemv_lora",
        lambda *args: calls.append(args[0].shape) or original(*args),
    )
    prompt = [3, 141, 59, 26, 5, 35]
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    got = {}
    for name, request in (("lora", lora), ("base", None)):
        # One request: the prompt's first 3 tokens in one step, then 3 one-row steps.
        manager.prepare_step([_State(request)], np.array([0, len(prompt)]), len(prompt))
        got[name] = PagedRunner(model, 1, 16, 16).chunk_then_decodes([prompt], 3)[0]
    adapted = len(manager.layers)
    assert len(calls) == 2 * 3 * adapted  # every adapted layer of every one-row step
    torch.testing.assert_close(got["lora"], hf_logits(merged, prompt), atol=2e-4, rtol=1e-4)
    want_base = hf_logits(load_hf_model(base), prompt)
    torch.testing.assert_close(got["base"], want_base, atol=2e-4, rtol=1e-4)
