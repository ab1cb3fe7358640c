"""vLLM's request fields beyond OpenAI's: ``truncate_prompt_tokens`` (the prompt's last k
tokens, generating exactly as from that shorter prompt; -1 means ``max_model_len``),
``bad_words`` (never generated, a word of several tokens blocked at its last one) and
``allowed_token_ids``, offline and over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedlm import LLM, SamplingParams
from server.server_utils import in_process_app

PROMPT = list(range(3, 43))  # 40 tokens


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    llm = LLM(str(chat_checkpoint), num_kv_blocks=64, block_size=16, max_model_len=64)
    yield llm
    llm.llm_engine.shutdown()


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **extra)


def test_the_prompt_keeps_its_last_tokens_and_generates_as_that_prompt(llm):
    cut, plain = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[-12:]}],
        [_greedy(truncate_prompt_tokens=12), _greedy()],
        use_tqdm=False,
    )
    assert cut.prompt_token_ids == PROMPT[-12:]
    assert cut.outputs[0].token_ids == plain.outputs[0].token_ids
    (whole,) = llm.generate(
        {"prompt_token_ids": PROMPT}, _greedy(truncate_prompt_tokens=50), use_tqdm=False
    )
    assert whole.prompt_token_ids == PROMPT  # shorter than k: unchanged


def test_minus_one_is_max_model_len_and_bad_values_name_the_field(llm):
    long_prompt = list(range(3, 103))  # 100 tokens, max_model_len 64
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate({"prompt_token_ids": long_prompt}, _greedy(), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=None, truncate_prompt_tokens=-1)
    with pytest.raises(ValueError, match="leaves no room to generate"):
        # -1 keeps max_model_len tokens, so nothing is left to generate (as vLLM)
        llm.generate({"prompt_token_ids": long_prompt}, params, use_tqdm=False)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens=65 exceeds max_model_len=64"):
        llm.generate("hi", _greedy(truncate_prompt_tokens=65), use_tqdm=False)


def test_completions_take_the_field(chat_checkpoint):

    engine, app = in_process_app(chat_checkpoint, num_kv_blocks=64, max_model_len=64)
    body = {"model": "tiny", "prompt": list(range(3, 103)), "max_tokens": 4, "temperature": 0}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            too_long = await http.post("/v1/completions", json=body)
            cut = await http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 20})
            zero = await http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0})
            allowed = await http.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 12,
                    "allowed_token_ids": ab_ids,
                    "bad_words": ["b"],
                    "temperature": 1.0,
                },
            )
            invoked = await http.post("/invocations", json={**body, "truncate_prompt_tokens": 20})
            return too_long, cut, zero, allowed, invoked

    tokenizer = engine.get_tokenizer()
    ab_ids = [tokenizer.convert_tokens_to_ids(c) for c in "ab"]
    try:
        too_long, cut, zero, allowed, invoked = asyncio.run(main())
    finally:
        engine.shutdown()
    text = allowed.json()["choices"][0]["message"]["content"]
    assert text and set(text) == {"a"}  # b is allowed, but a bad word
    assert too_long.status_code == 400
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 20
    assert invoked.status_code == 200  # SageMaker's route: a body with prompt completes
    assert invoked.json()["object"] == "text_completion"
    assert invoked.json()["choices"][0]["text"] == cut.json()["choices"][0]["text"]
    assert zero.status_code == 400
    assert zero.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_are_never_generated(chat_checkpoint, async_scheduling):
    llm = LLM(
        str(chat_checkpoint),
        num_kv_blocks=64,
        block_size=16,
        max_model_len=64,
        async_scheduling=async_scheduling,
    )
    try:
        tokenizer = llm.get_tokenizer()
        a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
        assert tokenizer.encode("aa", add_special_tokens=False) == [a, a]
        # Only a and b, a far likelier: greedy says "aaaa..." unless a word forbids it.
        only_ab = dict(allowed_token_ids=[a, b], logit_bias={a: 50.0})
        prompt = {"prompt_token_ids": PROMPT[:8]}
        plain, no_aa, no_a = llm.generate(
            [prompt] * 3,
            [
                _greedy(**only_ab),
                _greedy(bad_words=["aa"], **only_ab),
                _greedy(bad_words=["a"], **only_ab),
            ],
            use_tqdm=False,
        )
        assert plain.outputs[0].token_ids == [a] * 8
        assert no_aa.outputs[0].token_ids == [a, b] * 4  # a after a is blocked, not a alone
        assert no_a.outputs[0].token_ids == [b] * 8
        with pytest.raises(ValueError, match="bad_words block every token of allowed_token_ids"):
            llm.generate("hi", _greedy(allowed_token_ids=[b], bad_words=["b"]), use_tqdm=False)
        # Only stop tokens allowed while min_tokens forbids them: refused, not junk.
        eos = tokenizer.eos_token_id
        for params in (
            SamplingParams(allowed_token_ids=[eos], min_tokens=2),
            SamplingParams(allowed_token_ids=[a], stop_token_ids=[a], min_tokens=1),
            SamplingParams(allowed_token_ids=[eos, b], bad_words=["b"], min_tokens=1),
        ):
            with pytest.raises(ValueError, match="allowed_token_ids holds only stop tokens"):
                llm.generate("hi", params, use_tqdm=False)
        # With ignore_eos the EOS is no stop token: min_tokens does not forbid it.
        [eos_only] = llm.generate(
            [prompt], _greedy(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False
        )
        assert eos_only.outputs[0].token_ids == [eos] * 8
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="bad_words must be non-empty strings"):
        SamplingParams(bad_words=["ok", " "])


def test_chat_hands_tools_to_the_template(llm):
    template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(
        messages, _greedy(), use_tqdm=False, chat_template=template, tools=tools,
        add_generation_prompt=False,
    )  # fmt: skip
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "get_time;hi"


def test_max_logprobs_caps_what_a_request_may_ask(chat_checkpoint, llm):
    prompt = {"prompt_token_ids": PROMPT[:6]}
    with pytest.raises(ValueError, match="logprobs=25 exceeds max_logprobs=20"):
        llm.generate(prompt, _greedy(logprobs=25), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=21 exceeds max_logprobs=20"):
        llm.generate(prompt, _greedy(prompt_logprobs=21), use_tqdm=False)
    # -1 is named as sent (the message said "prompt_logprobs=384", which nobody sent).
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 \(the whole vocabulary, 384 "):
        llm.generate(prompt, _greedy(prompt_logprobs=-1), use_tqdm=False)
    wide = LLM(str(chat_checkpoint), num_kv_blocks=32, max_model_len=64, max_logprobs=-1)
    try:
        vocab = wide.llm_engine.config.model.arch.vocab_size
        assert wide.llm_engine.config.model.max_logprobs == vocab
        params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1)
        (out,) = wide.generate(prompt, params, use_tqdm=False)
        # -1: every token of the vocabulary, the sampled one among them.
        assert all(len(position) == vocab for position in out.outputs[0].logprobs)
    finally:
        wide.llm_engine.shutdown()
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        LLM(str(chat_checkpoint), num_kv_blocks=32, max_logprobs=-2)


def test_hf_overrides_replace_config_fields(chat_checkpoint, smollm2_path):
    from pagedlm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=str(chat_checkpoint),
        hf_overrides={"max_position_embeddings": 48, "rms_norm_eps": 1e-3},
    ).create_engine_config()[0]
    assert config.model.max_model_len == 48 and config.model.arch.rms_norm_eps == 1e-3
    with pytest.raises(ValueError, match=r"a \.gguf file has none"):
        EngineArgs(model=smollm2_path, hf_overrides={"rms_norm_eps": 1e-3}).create_engine_config()


def test_chunked_prefill_off_runs_each_prompt_in_one_step(chat_checkpoint, llm):
    from pagedlm.engine.arg_utils import EngineArgs

    path = str(chat_checkpoint)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False runs each prompt in one"):
        EngineArgs(
            model=path, enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=16
        ).create_engine_config()
    whole = LLM(
        path, num_kv_blocks=64, block_size=16, max_model_len=64, enable_chunked_prefill=False
    )
    try:
        config = whole.llm_engine.config
        assert config.scheduler.whole_prompts and config.scheduler.max_num_batched_tokens >= 64
        prompt = {"prompt_token_ids": PROMPT}
        (got,) = whole.generate(prompt, _greedy(), use_tqdm=False)
    finally:
        whole.llm_engine.shutdown()
    (want,) = llm.generate(prompt, _greedy(), use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
