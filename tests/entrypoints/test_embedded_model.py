"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32")


def test_default_model_is_used_without_arguments(smollm2_path):
    from pagedlm.engine.arg_utils import EngineArgs

    assert EngineArgs().resolve_model() == smollm2_path


def test_chat_answers_paris(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_logits_match_transformers_gguf_loader(llm, smollm2_path):
    """Our GGUF loading + model vs transformers' own GGUF loading + LlamaForCausalLM."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from model_utils import full_logits

    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    ours = full_logits(runner.model, runner.arch, runner.attn_backend, list(token_ids))

    parsed = load_gguf_checkpoint(smollm2_path, return_tensors=False)
    config = transformers.LlamaConfig(**parsed["config"])
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(smollm2_path, return_tensors=True, model_to_load=skeleton)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    with torch.no_grad():
        theirs = model(torch.tensor([token_ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-3
    assert ours[-1].argmax() == theirs[-1].argmax()
