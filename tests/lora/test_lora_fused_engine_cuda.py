"""On the GPU: a lone request with an adapter decodes through the fused one-row kernel
(``lora_fused.gemv_lora``, replayed from CUDA graphs) and gets the tokens of the
two-launch path (``PAGEDLM_LORA_FUSED=0``), not the base model's."""

from __future__ import annotations

import pytest
import torch

from peft_adapters import LLAMA_MODULES, make_adapter


@pytest.mark.cuda
def test_cuda_engine_one_request_fused_gives_the_two_launch_tokens(
    tiny_checkpoint, tmp_path, monkeypatch
):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from pagedlm import LLM, LoRARequest, SamplingParams
    from pagedlm_cuda.kernels import lora as lora_kernels

    base = tiny_checkpoint("llama")
    make_adapter(base, tmp_path / "adapter", LLAMA_MODULES, rank=8, seed=3)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    calls = []
    original = lora_kernels.gemv_lora
    monkeypatch.setattr(lora_kernels, "gemv_lora", lambda *a: calls.append(1) or original(*a))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": [11, 5, 93, 27, 5, 64, 2]}]
    tokens = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDLM_LORA_FUSED", fused)
        calls.clear()
        llm = LLM(
            str(base),
            skip_tokenizer_init=True,
            enable_lora=True,
            max_loras=2,
            dtype="float32",
            num_kv_blocks=64,
        )
        out = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        tokens[fused] = out[0].outputs[0].token_ids
        tokens["base" + fused] = (
            llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        )
        assert bool(calls) == (fused == "1")
        del llm
    assert tokens["1"] == tokens["0"]
    assert tokens["base1"] == tokens["base0"]
    assert tokens["1"] != tokens["base1"]
