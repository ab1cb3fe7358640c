"""bitsandbytes quantization on the CUDA platform (run on the GPU: pytest -m cuda)."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama-bnb")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _run(path: str, **kwargs):
    from pagedlm.model_executor.loader.bitsandbytes import bytes_of_parameters

    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": list(range(1, 40))}, params, use_tqdm=False)[0]
    logprobs = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return out.outputs[0].token_ids, logprobs, bytes_of_parameters(model)


@pytest.mark.parametrize(("quant_type", "tolerance"), [("nf4", 0.5), ("fp4", 0.5), ("int8", 0.1)])
def test_bitsandbytes_on_cuda(tiny_llama, quant_type, tolerance):
    ref_tokens, ref_logprobs, ref_bytes = _run(tiny_llama)
    tokens, logprobs, num_bytes = _run(
        tiny_llama, quantization="bitsandbytes", bnb_quant_type=quant_type
    )
    # Measured on an H200: max |diff| 0.115 (nf4), 0.216 (fp4), 0.023 (int8).
    assert (logprobs - ref_logprobs).abs().max().item() < tolerance
    assert tokens[:3] == ref_tokens[:3]
    assert num_bytes < ref_bytes * (0.7 if quant_type == "int8" else 0.5)
