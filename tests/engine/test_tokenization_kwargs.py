"""vLLM's ``tokenization_kwargs`` (``LLM.generate``, ``AsyncLLM.generate``) and the HTTP
``add_special_tokens`` fields, over a tokenizer that adds BOS: without special tokens the
prompt has no BOS, truncation keeps BOS and cuts on the right as transformers does, and bad
kwargs are refused before anything is queued."""

from __future__ import annotations

import shutil

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from pagedlm import LLM, SamplingParams
from pagedlm.engine.tokenization_kwargs import check_tokenization_kwargs

BOS = 0  # <|endoftext|> in the chat checkpoint's tokenizer
TEXT = "hello there"
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def bos_checkpoint(chat_checkpoint, tmp_path_factory):
    """The chat checkpoint, its tokenizer adding BOS as Llama's does."""
    path = tmp_path_factory.mktemp("bos")
    shutil.copytree(chat_checkpoint, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS)]
    )
    tokenizer.save_pretrained(path)
    reloaded = AutoTokenizer.from_pretrained(path)
    assert reloaded.encode(TEXT)[0] == BOS  # the fixture does what it says
    return path, reloaded


@pytest.fixture(scope="module")
def llm(bos_checkpoint):
    path, _ = bos_checkpoint
    llm = LLM(str(path), num_kv_blocks=16)
    yield llm
    llm.llm_engine.shutdown()


def prompt_ids(llm: LLM, **kwargs) -> list[int]:
    (output,) = llm.generate([TEXT], PARAMS, use_tqdm=False, **kwargs)
    return output.prompt_token_ids


def test_add_special_tokens_and_truncation(llm, bos_checkpoint):
    _, hf = bos_checkpoint
    assert prompt_ids(llm) == hf.encode(TEXT)
    assert prompt_ids(llm, tokenization_kwargs={"add_special_tokens": False}) == hf.encode(
        TEXT, add_special_tokens=False
    )
    truncated = prompt_ids(llm, tokenization_kwargs={"truncation": True, "max_length": 4})
    hf.truncation_side = "left"  # vLLM's for a generating model: the prompt's end kept
    assert truncated == hf(TEXT, truncation=True, max_length=4)["input_ids"]
    assert len(truncated) == 4 and truncated[0] == BOS
    assert truncated[1:] == hf.encode(TEXT, add_special_tokens=False)[-3:]


def test_truncation_side_picks_the_end_a_generation_prompt_keeps(llm, bos_checkpoint):
    """vLLM's renderer key: "right" keeps the first tokens, "left" (a generating model's
    default) the last, for truncate_prompt_tokens and for truncation alike; cut after
    tokenizing, special tokens included."""
    _, hf = bos_checkpoint
    full = hf.encode(TEXT)
    cut = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=3)
    for side, want in (("right", full[:3]), ("left", full[-3:]), (None, full[-3:])):
        kwargs = None if side is None else {"truncation_side": side}
        (output,) = llm.generate([TEXT], cut, use_tqdm=False, tokenization_kwargs=kwargs)
        assert output.prompt_token_ids == want, side
    right = {"truncation": True, "max_length": 2, "truncation_side": "right"}
    assert prompt_ids(llm, tokenization_kwargs=right) == full[:2]


def test_truncation_cuts_a_token_id_prompt(llm):
    """vLLM's renderer turns ``truncation`` into ``truncate_prompt_tokens`` (``max_length``,
    else the context) for every prompt, so it cuts a prompt given as token ids too, on
    the ``truncation_side`` (a generating model's default: the left, the end kept). Only
    text prompts were cut."""
    ids = list(range(5, 15))

    def cut(**kwargs) -> list[int]:
        (output,) = llm.generate(
            [{"prompt_token_ids": ids}], PARAMS, use_tqdm=False, tokenization_kwargs=kwargs
        )
        return output.prompt_token_ids

    assert cut(truncation=True, max_length=4) == ids[-4:]
    assert cut(truncation="longest_first", max_length=4, truncation_side="right") == ids[:4]
    assert cut(truncation=False, max_length=4) == cut(max_length=4) == ids
    tighter = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3)
    (output,) = llm.generate(
        [{"prompt_token_ids": ids}],
        tighter,
        use_tqdm=False,
        tokenization_kwargs={"truncation": True, "max_length": 6},
    )
    assert output.prompt_token_ids == ids[-3:]  # the tighter bound holds


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"return_tensors": "pt"}, r"\['return_tensors'\] are not supported; use \['add_"),
        ({"padding": True}, "padding=True is not supported"),
        ({"truncation_side": "middle"}, "truncation_side must be 'left'"),
        ({"padding": "max_length"}, "applies to pooling requests"),
        ({"add_special_tokens": "no"}, "must be a bool"),
        ({"truncation": True, "max_length": 0}, "positive integer"),
        ({"truncation": "sideways"}, "truncation must be one of"),
    ],
)
def test_bad_kwargs_are_refused_before_queueing(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([TEXT], PARAMS, use_tqdm=False, tokenization_kwargs=kwargs)
    assert not llm.llm_engine.has_unfinished_requests()
    assert check_tokenization_kwargs({}) is None


def test_http_add_special_tokens(bos_checkpoint):
    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.app import build_app
    from server.fake_engine import FakeEngine, fake_context

    path, hf = bos_checkpoint
    engine = FakeEngine(path)
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 2, "return_token_ids": True}
    messages = [{"role": "user", "content": "hi"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "return_token_ids": True}
    with TestClient(build_app(fake_context(engine))) as client:

        def prompt(route: str, **fields) -> list[int]:
            response = client.post(route, json=fields)
            assert response.status_code == 200, response.text
            answer = response.json()
            return answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]

        assert prompt("/v1/completions", **body) == hf.encode(TEXT)  # vLLM's default: true
        without = prompt("/v1/completions", **body, add_special_tokens=False)
        assert without == hf.encode(TEXT, add_special_tokens=False)
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        templated = hf.encode(rendered, add_special_tokens=False)
        assert prompt("/v1/chat/completions", **chat) == templated  # vLLM's default: false
        assert prompt("/v1/chat/completions", **chat, add_special_tokens=True) == [
            BOS,
            *templated,
        ]


def test_pooling_prompts_take_tokenization_kwargs(bos_checkpoint):
    path, hf = bos_checkpoint
    llm = LLM(str(path), runner="pooling", num_kv_blocks=16)
    try:
        (plain,) = llm.embed([TEXT], use_tqdm=False)
        assert plain.prompt_token_ids == hf.encode(TEXT)
        (without,) = llm.embed(
            [TEXT], use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}
        )
        assert without.prompt_token_ids == hf.encode(TEXT, add_special_tokens=False)
        assert without.outputs.embedding != plain.outputs.embedding
        hf.truncation_side = "right"  # a pooling model keeps the start, as vLLM's
        (cut,) = llm.encode(
            [TEXT],
            use_tqdm=False,
            truncate_prompt_tokens=6,
            tokenization_kwargs={"truncation": True, "max_length": 3},
        )
        assert cut.prompt_token_ids == hf(TEXT, truncation=True, max_length=3)["input_ids"]
        with pytest.raises(ValueError, match="not supported"):
            llm.embed([TEXT], use_tqdm=False, tokenization_kwargs={"padding": True})
    finally:
        llm.llm_engine.shutdown()


def test_a_prompt_with_images_refuses_them(llm):
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": []}}
    with pytest.raises(ValueError, match="do not reach the image processor"):
        llm.generate(
            [prompt], PARAMS, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}
        )
    assert not llm.llm_engine.has_unfinished_requests()
