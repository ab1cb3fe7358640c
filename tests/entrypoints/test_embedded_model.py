"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedlm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    # The dequantized weights, so the logits can match transformers' to 1e-3; the quantized
    # CPU kernels are held to the dequantized path in tests/cpu/test_quantized_parity.py.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLM_CPU_DEQUANTIZE_GGUF", "1")
        return LLM(smollm2_path, dtype="float32")


def test_default_model_is_used_without_arguments(smollm2_path):
    from pagedlm.engine.arg_utils import EngineArgs

    assert EngineArgs().resolve_model() == smollm2_path


def test_chat_answers_paris(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_logits_match_transformers_gguf_loader(llm, smollm2_path, monkeypatch):
    """Our GGUF loading + model vs transformers' own GGUF loading + LlamaForCausalLM."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from model_utils import full_logits

    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    ours = full_logits(runner.model, runner.arch, runner.attn_backend, list(token_ids))

    # transformers reads the file's metadata in each call below (the 49k-token vocabulary:
    # ~5 s) and builds gguf's tensor-name map once per module it walks (~400 times, ~10 s);
    # both are pure functions of their arguments, so each is built once here.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
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


def test_stop_strings_and_tokens(llm):
    prompt = "Count: 1, 2, 3, 4,"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert " 6" in full.text
    stop = " 6"
    cut = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]

    stop_token = full.token_ids[3]
    by_token = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_token


def test_eos_min_tokens_and_decoded_logprobs(llm):
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0, max_tokens=64)
    answer = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert answer.finish_reason == "stop" and answer.stop_reason is None
    assert answer.token_ids[-1] == eos
    longer = llm.chat(
        QUESTION,
        SamplingParams(temperature=0, max_tokens=64, min_tokens=20, logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) >= 20
    assert eos not in longer.token_ids[:20]
    first = longer.logprobs[0][longer.token_ids[0]]
    assert first.decoded_token == llm.get_tokenizer().decode([longer.token_ids[0]])
    assert first.rank >= 1 and first.logprob <= 0


def test_batch_of_conversations_and_continue_final_message(llm):
    conversations = [
        QUESTION,
        [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue"}],
    ]
    outs = llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(outs) == 1
    cont = llm.chat(
        conversations[1],
        SamplingParams(temperature=0, max_tokens=8),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )[0]
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(cont.prompt_token_ids).rstrip().endswith("Blue")
