"""Grammars that apply after the model's thought (vLLM's ``structured_outputs_config``
``reasoning_parser``, ``enable_in_reasoning`` off), end to end on a tiny llama whose next
token is scripted (``thinking_model.py``): the thought's tokens are free, the end marker
starts the grammar, greedy outputs are exact, with asynchronous scheduling on and off and
with n-gram drafts that straddle the end marker, beside ``min_tokens``, ``n=2``, chunked
prefills, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams, StructuredOutputsParams
from structured_output.thinking_model import write_scripted_checkpoint

SCRIPT = {
    # the thought: x y, then its end; the model's answer would be q, the grammar's 5 6 7
    "<think>": ["x"],
    "x": ["y"],
    "y": ["</think>"],
    "</think>": ["q", "5"],
    "5": ["q", "6"],
    "6": ["q", "7"],
    "7": ["q", "EOS"],
    "q": ["EOS"],
    # prompts that leave the first token to decide: p thinks first, o answers at once
    "p": ["q", "<think>", "3"],
    "o": ["q", "3"],
    "3": ["</think>", "4"],  # in the answer the end marker is the grammar's: masked
    "4": ["EOS"],
    # w: a newline first, then the thought (the reasoning parsers skip leading whitespace)
    "w": ["\u010a"],  # the byte-level spelling of "\n"
    "\u010a": ["<think>", "3"],
}
DIGITS = StructuredOutputsParams(regex="[0-9]+")
NEWLINE_DIGITS = StructuredOutputsParams(regex="\n?[0-9]+")
PAD = "z" * 10
"""Before every prompt: chunks of 8 tokens, blocks shared in the prefix cache."""
CASES = [
    # (prompt, sampling fields, every sample's text)
    ("ab<think>", {}, "xy</think>567"),  # the prompt opened the thought
    ("ap", {}, "<think>xy</think>567"),  # the first token opened it
    ("ao", {}, "34"),  # the first token was the answer's
    ("a<think>\n</think>o", {}, "34"),  # the prompt closed the thought
    ("ab<think>", {"min_tokens": 7}, "xy</think>5670"),  # EOS held back by min_tokens
    ("ab<think>", {"n": 2}, "xy</think>567"),
    # n-gram drafts after x: y </think> q; q falls to the mask of the position after </think>
    ("<think>xy</think>q567q<think>", {}, "xy</think>567"),
    ("ab<think>", {"structured_outputs": None}, "xy</think>q"),  # no grammar beside
    # whitespace before the start marker leaves the first token to decide, as the parser
    ("aw", {"structured_outputs": NEWLINE_DIGITS}, "\n<think>xy</think>567"),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_scripted_checkpoint(tmp_path_factory.mktemp("thinking"), SCRIPT))


@pytest.fixture(scope="module")
def encode(model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_thought_is_free_and_the_answer_follows_the_grammar(
    model_path: str, encode, speculative: str | None, async_scheduling: bool
) -> None:
    spec = None
    if speculative == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3, "min_acceptance_rate": 0}  # fmt: skip
    llm = LLM(
        model_path,
        dtype="float32",
        max_model_len=64,
        block_size=8,
        num_kv_blocks=5,  # fewer than the batch needs at once: preemption
        max_num_batched_tokens=8,
        async_scheduling=async_scheduling,
        speculative_config=spec,
        structured_outputs_config={"reasoning_parser": "qwen3"},
    )
    try:
        prompts = [{"prompt_token_ids": encode(PAD + prompt)} for prompt, _, _ in CASES]
        base = {"temperature": 0, "max_tokens": 12, "structured_outputs": DIGITS}
        params = [SamplingParams(**{**base, **fields}) for _, fields, _ in CASES]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for (prompt, fields, text), output in zip(CASES, outputs, strict=True):
            got = [(c.text, c.finish_reason) for c in output.outputs]
            assert got == [(text, "stop")] * fields.get("n", 1), (prompt, fields)
        scheduler = llm.llm_engine.engine_core.scheduler
        assert scheduler.num_preemptions > 0
        if speculative:
            assert scheduler.make_stats().spec_decoding.num_accepted_tokens > 0
    finally:
        llm.llm_engine.shutdown()


def test_without_a_reasoning_parser_the_grammar_starts_at_the_first_token(model_path, encode):
    """The engine's behaviour before grammars waited for the thought, and with
    ``enable_in_reasoning`` (vLLM's switch back to it)."""
    for config in (None, {"reasoning_parser": "qwen3", "enable_in_reasoning": True}):
        llm = LLM(model_path, dtype="float32", max_model_len=64, num_kv_blocks=16,
                  structured_outputs_config=config)  # fmt: skip
        try:
            assert llm.llm_engine.config.structured_outputs_reasoning is None
            params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=DIGITS)
            prompt = {"prompt_token_ids": encode("ab<think>")}
            [output] = llm.generate(prompt, params, use_tqdm=False)
            assert output.outputs[0].text == "0"
        finally:
            llm.llm_engine.shutdown()


TURN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
HISTORY = "<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n" + TURN


@pytest.mark.parametrize(
    ("parser", "prompt", "ended"),
    [
        ("qwen3", TURN + "<think>\n", False),  # Qwen3.5's template opened the thought
        ("qwen3", TURN, None),  # Qwen3's leaves it to the model
        ("qwen3", TURN + "<think>\n\n</think>\n\n", True),  # enable_thinking=False
        ("qwen3", HISTORY, None),  # an earlier turn's thought is not this turn's
        ("deepseek_r1", TURN, False),  # the family starts inside the thought
        ("deepseek_r1", TURN + "<think>\n\n</think>\n\n", True),
        ("deepseek_r1", HISTORY, False),
    ],
)
def test_where_the_output_starts_is_the_reasoning_parsers_rule(
    chat_thinking_checkpoint, parser, prompt, ended
):
    """The input processor reads each constrained request's ``reasoning_ended`` from its
    prompt by the rule the server's reasoning parser follows (one rule: the last marker of
    the prompt's current turn), and the two agree on where an output starts."""
    import torch

    from pagedlm.config import ArchConfig, ModelConfig, ReasoningMarkers
    from pagedlm.engine.input_processor import InputProcessor
    from pagedlm.entrypoints.openai.chat_output import reasoning_factory
    from pagedlm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, split_reasoning
    from pagedlm.tokenizer import get_tokenizer
    from server.server_utils import THINK_END_ID, THINK_START_ID

    path = str(chat_thinking_checkpoint)
    tokenizer = get_tokenizer(path)
    config = ModelConfig(path, None, ArchConfig.from_directory(path), torch.float32, 256)
    markers = ReasoningMarkers(parser, (THINK_START_ID,), (THINK_END_ID,))
    processor = InputProcessor(config, tokenizer, reasoning=markers)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(max_tokens=4, n=2, structured_outputs=DIGITS)
    processed = processor.process("r", {"prompt_token_ids": ids}, params)
    assert [child.reasoning_ended for child in processed.children] == [ended, ended]
    plain = processor.process("p", {"prompt_token_ids": ids}, SamplingParams(max_tokens=4))
    assert plain.children[0].reasoning_ended is True  # no grammar: nothing to wait for

    new_parser = reasoning_factory(REASONING_PARSERS[parser], tokenizer, ids)
    thought_first = split_reasoning(new_parser(), "<think>a</think>1")
    answer_first = split_reasoning(new_parser(), "a</think>1")
    if ended is False:  # the output starts inside the thought
        assert (answer_first.reasoning, answer_first.content) == ("a", "1")
    elif ended is True:  # the output is the answer
        assert (answer_first.reasoning, answer_first.content) == ("", "a</think>1")
    else:  # a thought only where the output opens one
        assert (thought_first.reasoning, thought_first.content) == ("a", "1")
        assert (answer_first.reasoning, answer_first.content) == ("", "a</think>1")


@pytest.fixture(scope="module")
def chat_thinking_checkpoint(tmp_path_factory):
    from server.server_utils import write_chat_checkpoint

    return write_chat_checkpoint(tmp_path_factory.mktemp("chat-thinking"), thinking=True)


@pytest.mark.parametrize(
    ("parser", "markers"),
    [("qwen3", ((382,), (383,))), ("deepseek_r1", ((382,), (383,))), ("granite", None),
     ("openai_gptoss", None), ("mistral", None)],
)  # fmt: skip
def test_the_engine_takes_the_markers_that_are_single_tokens(
    chat_thinking_checkpoint, parser, markers, caplog
):
    """``--reasoning-parser``'s markers as token ids; a parser whose end marker is no single
    token of the tokenizer (granite's sentences, gpt-oss's channels, mistral's [/THINK]
    here) leaves grammars at the first token, and says so."""
    from pagedlm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(chat_thinking_checkpoint), num_kv_blocks=8, max_model_len=64,
                      structured_outputs_config={"reasoning_parser": parser})  # fmt: skip
    config, _ = args.create_engine_config()
    reasoning = config.structured_outputs_reasoning
    if markers is None:
        assert reasoning is None
        assert "no single token of this tokenizer" in caplog.text
    else:
        assert (reasoning.start_token_ids, reasoning.end_token_ids) == markers
    unknown = {"reasoning_parser": "nope"}
    args = EngineArgs(model=str(chat_thinking_checkpoint), structured_outputs_config=unknown)
    with pytest.raises(ValueError, match="'nope' is unknown; choose one of"):
        args.create_engine_config()


def test_reasoning_parser_is_an_engine_argument_as_in_vllm(model_path, encode):
    """vLLM's ``LLM(reasoning_parser=...)`` (an ``EngineArgs`` field, the CLI's one
    ``--reasoning-parser``) is the ``structured_outputs_config`` key of that name: either
    spelling sets both; two different parsers are refused naming both."""
    from pagedlm.engine.arg_utils import EngineArgs

    llm = LLM(model_path, dtype="float32", max_model_len=64, num_kv_blocks=16,
              reasoning_parser="qwen3")  # fmt: skip
    try:
        assert llm.llm_engine.config.structured_outputs_reasoning.reasoning_parser == "qwen3"
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=DIGITS)
        [output] = llm.generate({"prompt_token_ids": encode("ab<think>")}, params, use_tqdm=False)
        assert output.outputs[0].text == "xy</think>567"
    finally:
        llm.llm_engine.shutdown()
    same = EngineArgs(model=model_path, reasoning_parser="qwen3",
                      structured_outputs_config={"reasoning_parser": "qwen3", "backend": "auto"})  # fmt: skip
    assert same.structured_outputs_config == {"reasoning_parser": "qwen3", "backend": "auto"}
    configured = EngineArgs(
        model=model_path, structured_outputs_config={"reasoning_parser": "qwen3"}
    )
    assert configured.reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser='qwen3' and structured_outputs_config's "
                       "reasoning_parser 'deepseek_r1' name two"):  # fmt: skip
        EngineArgs(model=model_path, reasoning_parser="qwen3",
                   structured_outputs_config={"reasoning_parser": "deepseek_r1"})  # fmt: skip


def test_serve_has_one_reasoning_parser_flag():
    """The engine's ``--reasoning-parser`` is the server's: one option, parsed once."""
    from pagedlm.entrypoints.cli.main import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = [a for a in serve._actions if "--reasoning-parser" in a.option_strings]
    assert len(flags) == 1 and flags[0].dest == "reasoning_parser"
    args = parser.parse_args(["serve", "m", "--reasoning-parser", "qwen3"])
    assert args.reasoning_parser == "qwen3"
