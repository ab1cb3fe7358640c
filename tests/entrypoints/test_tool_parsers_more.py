"""The tool parsers named like vLLM's (mistral, pythonic, qwen3_coder, deepseek_v3/v31,
granite, internlm) on model-like outputs, malformed ones included, split at every position;
and one chat request through the app for each of two of them."""

from __future__ import annotations

import json
import random

import pytest

from pagedlm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    GraniteToolParser,
    InternLM2ToolParser,
    MistralToolParser,
    ParsedOutput,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolCall,
    ToolCallAccumulator,
    get_tool_parser,
    parse_all,
)
from server.stream_splits import assert_every_split_gives, feed_in_pieces


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


WEATHER = _call("get_weather", city="Paris", unit="celsius")
TIME = _call("get_time", tz="Europe/Paris")
NESTED_ARGS = {
    "query": "café ☕ 東京",
    "filters": {"tags": ["a", {"b": [1, 2.5]}], "on": True, "x": None},
}
NESTED = _call("search", **NESTED_ARGS)
NESTED_JSON = json.dumps(NESTED_ARGS, ensure_ascii=False)

WEATHER_JSON = '{"city": "Paris", "unit": "celsius"}'
TIME_JSON = '{"tz": "Europe/Paris"}'

MISTRAL_CASES = [
    # (model text, expected content, expected calls)
    (f"[TOOL_CALLS]get_weather[ARGS]{WEATHER_JSON}", "", [WEATHER]),
    (
        f"Let me check.\n\n[TOOL_CALLS]get_weather[ARGS]{WEATHER_JSON}"
        f"[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{TIME_JSON}",
        "Let me check.",
        [WEATHER, TIME],
    ),
    # before tokenizer v11: one marker, a JSON array
    (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_JSON}}}, '
        f'{{"name": "get_time", "arguments": {TIME_JSON}}}]',
        "",
        [WEATHER, TIME],
    ),
    (f'Sure![TOOL_CALLS][{{"name": "get_time", "arguments": {TIME_JSON}, "id": "abc123def"}}]', "Sure!", [TIME]),
    (f"[TOOL_CALLS]get_time{TIME_JSON}", "", [TIME]),  # [ARGS] left out of the text
    (f"[TOOL_CALLS]search[ARGS]{NESTED_JSON}", "", [NESTED]),
    (f"[TOOL_CALLS]get_time[ARGS]{TIME_JSON}\n\nDone.", "Done.", [TIME]),
    ("No tools needed [TOOLS] here.", "No tools needed [TOOLS] here.", []),
    ("Answer [TOOL_CA", "Answer [TOOL_CA", []),
    ("The token [TOOL_CALLS] is special.", "The token [TOOL_CALLS] is special.", []),
    ('[TOOL_CALLS]get_time[ARGS]{"tz": "Eu', '[TOOL_CALLS]get_time[ARGS]{"tz": "Eu', []),
    ("[TOOL_CALLS]get_time[CALL_", "[TOOL_CALLS]get_time[CALL_", []),
    ("[TOOL_CALLS]f[ARGS][1, 2]", "[TOOL_CALLS]f[ARGS][1, 2]", []),
    ("[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    (
        f'[TOOL_CALLS][{{"name": "get_time", "arguments": {TIME_JSON}}}, {{"oops": 1}}]',
        ', {"oops": 1}]',
        [TIME],
    ),
    (  # a broken call, then a good one
        f'[TOOL_CALLS]get_time[ARGS]{{"tz": oops}}[TOOL_CALLS]get_weather[ARGS]{WEATHER_JSON}',
        '[TOOL_CALLS]get_time[ARGS]{"tz": oops}',
        [WEATHER],
    ),
    ("", "", []),
]  # fmt: skip

PYTHONIC_CASES = [
    ('[get_weather(city="Paris", unit="celsius")]', "", [WEATHER]),
    ("[get_weather(city='Paris', unit='celsius'), get_time(tz=\"Europe/Paris\")]", "", [WEATHER, TIME]),
    ('<|python_start|>[get_time(tz="Europe/Paris")]<|python_end|>', "", [TIME]),
    ('  \n[get_time(tz="Europe/Paris")]', "", [TIME]),
    (
        '[search(query="café ☕ 東京", filters={"tags": ["a", {"b": (1, 2.5)}], "on": True, "x": None})]',
        "",
        [NESTED],
    ),
    (  # brackets, commas and quotes inside strings
        """[note(text="a, b] c) 'q' \\"dq\\"", tag='it\\'s', body='''x\n], y''')]""",
        "",
        [_call("note", text="a, b] c) 'q' \"dq\"", tag="it's", body="x\n], y")],
    ),
    ("[f(n=-3, ratio=1.5e3, empty='', flags=[])]", "", [_call("f", n=-3, ratio=1500.0, empty="", flags=[])]),
    ('[get_time(tz="Europe/Paris")', "", [TIME]),  # stopped before the ]
    ('[get_time(tz="Europe/Paris")]\nDone.', "Done.", [TIME]),
    ('[get_time(tz="Europe/Paris"), 42]', " 42]", [TIME]),
    ('[get_time(tz="Europe/Paris"), leak(x=open)]', " leak(x=open)]", [TIME]),
    ("The weather is nice.", "The weather is nice.", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ('[get_time(tz=os.environ["TZ"])]', '[get_time(tz=os.environ["TZ"])]', []),
    ('[get_time("Europe/Paris")]', '[get_time("Europe/Paris")]', []),
    ('[f(**{"a": 1})]', '[f(**{"a": 1})]', []),
    ('[get_weather(city="Par', '[get_weather(city="Par', []),
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set has no JSON
    ("<|python_sta", "<|python_sta", []),
    ("", "", []),
]  # fmt: skip

QWEN3_CODER_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_TIME = "<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>"
CODE = 'def f(x):\n    return x < 2 and "<b>" != "</parameter"\n'

QWEN3_CODER_CASES = [
    (f"Let me check.\n{QWEN3_CODER_WEATHER}", "Let me check.", [WEATHER]),
    (f"{QWEN3_CODER_WEATHER}\n{QWEN3_CODER_TIME}", "", [WEATHER, TIME]),
    (  # no schema: values that read as JSON become JSON
        "<tool_call>\n<function=plan>\n<parameter=days>\n3\n</parameter>\n<parameter=flag>\ntrue\n"
        "</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=zip>\n007\n"
        "</parameter>\n<parameter=none>\nnull\n</parameter>\n<parameter=city>\n東京 ☕\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [_call("plan", days=3, flag=True, opts={"a": [1, 2]}, zip="007", none=None, city="東京 ☕")],
    ),
    (f"<tool_call>\n<function=write>\n<parameter=code>\n{CODE}\n</parameter>\n</function>\n</tool_call>", "", [_call("write", code=CODE)]),
    ("<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n</function>", "", [TIME]),
    # </tool_call> missing (EOS) and </parameter> missing inside a closed function
    ("<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</function>", "", [TIME]),
    (QWEN3_CODER_TIME + " Then text.", "Then text.", [TIME]),
    ("<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Pa", "<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Pa", []),
    ("Use <tool_call> tags like <tool_call>oops</tool_call> here", "Use <tool_call> tags like <tool_call>oops</tool_call> here", []),
    ("<tool_call><function=bad name></function></tool_call>", "<tool_call><function=bad name></function></tool_call>", []),
    ("<tool_call><function=f>junk<parameter=a>1</parameter></function></tool_call>", "<tool_call><function=f>junk<parameter=a>1</parameter></function></tool_call>", []),
    ("Ends with <tool_c", "Ends with <tool_c", []),
    ("a <func", "a <func", []),
    ("", "", []),
]  # fmt: skip

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _v3(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def _v31(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


DEEPSEEK_V3_CASES = [
    (f"{CALLS_BEGIN}{_v3('get_weather', WEATHER_JSON)}{CALLS_END}", "", [WEATHER]),
    (
        f"Checking both.{CALLS_BEGIN}{_v3('get_weather', WEATHER_JSON)}\n{_v3('get_time', TIME_JSON)}{CALLS_END}",
        "Checking both.",
        [WEATHER, TIME],
    ),
    (f"{CALLS_BEGIN}{_v3('search', NESTED_JSON)}{CALLS_END}", "", [NESTED]),
    (f"{CALLS_BEGIN}{_v3('get_time', TIME_JSON)}", "", [TIME]),  # stopped before the end token
    (f"{CALLS_BEGIN}{_v3('get_time', TIME_JSON)}{CALLS_END}\nDone.", "Done.", [TIME]),
    (f'{CALLS_BEGIN}{_v3("get_time", "{")}{CALLS_END}', f'{CALLS_BEGIN}{_v3("get_time", "{")}{CALLS_END}', []),
    (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{TIME_JSON}", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{TIME_JSON}", []),
    (f"{CALLS_BEGIN}junk{_v3('get_time', TIME_JSON)}{CALLS_END}", f"{CALLS_BEGIN}junk{_v3('get_time', TIME_JSON)}{CALLS_END}", []),
    (f"{CALLS_BEGIN}{_v31('get_time', TIME_JSON)}{CALLS_END}", f"{CALLS_BEGIN}{_v31('get_time', TIME_JSON)}{CALLS_END}", []),
    ("Plain answer <｜tool", "Plain answer <｜tool", []),
    ("", "", []),
]  # fmt: skip

DEEPSEEK_V31_CASES = [
    (f"{CALLS_BEGIN}{_v31('get_weather', WEATHER_JSON)}{CALLS_END}", "", [WEATHER]),
    (f"On it. {CALLS_BEGIN}{_v31('get_weather', WEATHER_JSON)}{_v31('get_time', TIME_JSON)}{CALLS_END}", "On it.", [WEATHER, TIME]),
    (f"{CALLS_BEGIN}{_v31('search', NESTED_JSON)}{CALLS_END}", "", [NESTED]),
    (f"{CALLS_BEGIN}{_v31('get_time', TIME_JSON)}", "", [TIME]),
    (f"{CALLS_BEGIN}{_v3('get_time', TIME_JSON)}{CALLS_END}", f"{CALLS_BEGIN}{_v3('get_time', TIME_JSON)}{CALLS_END}", []),
    (f'{CALLS_BEGIN}{_v31("get_time", "[1]")}{CALLS_END}', f'{CALLS_BEGIN}{_v31("get_time", "[1]")}{CALLS_END}', []),
    ("", "", []),
]  # fmt: skip

GRANITE_WEATHER = f'{{"name": "get_weather", "arguments": {WEATHER_JSON}}}'
GRANITE_TIME = f'{{"name": "get_time", "arguments": {TIME_JSON}}}'

GRANITE_CASES = [
    (f"<|tool_call|>[{GRANITE_WEATHER}]", "", [WEATHER]),
    (f"<tool_call>[{GRANITE_WEATHER}, {GRANITE_TIME}]", "", [WEATHER, TIME]),
    (f" [{GRANITE_TIME}]", "", [TIME]),
    (f'<|tool_call|>[{{"name": "search", "arguments": {NESTED_JSON}}}]', "", [NESTED]),
    (f"<|tool_call|>[{GRANITE_TIME}] That is all.", "That is all.", [TIME]),
    (f'<|tool_call|>[{GRANITE_TIME}, {{"oops": 1}}]', ', {"oops": 1}]', [TIME]),
    ("Paris is sunny.", "Paris is sunny.", []),
    ("<|tool_call|>I cannot call tools.", "<|tool_call|>I cannot call tools.", []),
    ('<|tool_call|>[{"name": "get_time", "argu', '<|tool_call|>[{"name": "get_time", "argu', []),
    ('<|tool_call|>[{"city": "Paris"}]', '<|tool_call|>[{"city": "Paris"}]', []),
    ("<|tool_c", "<|tool_c", []),
    ("", "", []),
]  # fmt: skip


ACTION = "<|action_start|><|plugin|>"

INTERNLM_CASES = [
    (f'{ACTION}\n{{"name": "get_weather", "parameters": {WEATHER_JSON}}}<|action_end|>', "", [WEATHER]),
    (f'Let me look.{ACTION}\n{GRANITE_TIME}<|action_end|>\n', "Let me look.", [TIME]),
    (f'{ACTION}{{"name": "search", "parameters": {NESTED_JSON}}}', "", [NESTED]),  # EOS, no end
    (f"{ACTION}not json<|action_end|> after", f"{ACTION}not json<|action_end|> after", []),
    (f'{ACTION}{{"name": "get_time", "para', f'{ACTION}{{"name": "get_time", "para', []),
    ("Plain <|action_st", "Plain <|action_st", []),
    ("", "", []),
]  # fmt: skip


def _accumulated(deltas: list) -> ParsedOutput:
    accumulator = ToolCallAccumulator()
    for delta in deltas:
        accumulator.add(delta)
    return accumulator.result()


def _check_every_split(new_parser, text: str, content: str, calls: list[ToolCall]) -> None:
    expected = ParsedOutput(content, tuple(calls))
    assert parse_all(new_parser(), text) == expected
    assert_every_split_gives(new_parser, text, expected, _accumulated)


@pytest.mark.parametrize("text, content, calls", MISTRAL_CASES)
def test_mistral(text, content, calls):
    _check_every_split(MistralToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", PYTHONIC_CASES)
def test_pythonic(text, content, calls):
    _check_every_split(PythonicToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", QWEN3_CODER_CASES)
def test_qwen3_coder(text, content, calls):
    _check_every_split(Qwen3CoderToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", DEEPSEEK_V3_CASES)
def test_deepseek_v3(text, content, calls):
    _check_every_split(DeepSeekV3ToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", DEEPSEEK_V31_CASES)
def test_deepseek_v31(text, content, calls):
    _check_every_split(DeepSeekV31ToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", GRANITE_CASES)
def test_granite(text, content, calls):
    _check_every_split(GraniteToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", INTERNLM_CASES)
def test_internlm(text, content, calls):
    _check_every_split(InternLM2ToolParser, text, content, calls)


PLAN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "type": "object",
                "properties": {
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                    "ratio": {"type": "number"},
                    "flag": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                    "count": {"type": "integer"},
                    "maybe": {"type": ["integer", "null"]},
                },
            },
        },
    }
]


def test_qwen3_coder_converts_by_the_tool_schema():
    values = {"days": "3", "zip": "007", "ratio": "2.50", "flag": "True", "opts": "{'a': (1,)}",
              "tags": '["x", "y"]', "count": "many", "maybe": "null", "extra": "5"}  # fmt: skip
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=plan>\n{params}</function>\n</tool_call>"
    expected = _call("plan", days=3, zip="007", ratio=2.5, flag=True, opts={"a": [1]},
                     tags=["x", "y"], count="many", maybe=None, extra="5")  # fmt: skip
    _check_every_split(lambda: Qwen3CoderToolParser(PLAN_TOOLS), text, "", [expected])
    # a function the tools do not declare falls back to the look of each value
    other = (
        "<tool_call>\n<function=other>\n<parameter=zip>\n1\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_all(Qwen3CoderToolParser(PLAN_TOOLS), other).calls == (_call("other", zip=1),)


CASES = {
    "mistral": MISTRAL_CASES,
    "pythonic": PYTHONIC_CASES,
    "qwen3_coder": QWEN3_CODER_CASES,
    "deepseek_v3": DEEPSEEK_V3_CASES,
    "deepseek_v31": DEEPSEEK_V31_CASES,
    "granite": GRANITE_CASES,
    "internlm": INTERNLM_CASES,
}
NEW_PARSERS = list(CASES)
FRAGMENTS = [
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call|>", "<tool_call>", "</tool_call>",
    "<function=f>", "</function>", "<parameter=a>", "</parameter>", CALLS_BEGIN, CALLS_END,
    CALL_BEGIN, CALL_END, SEP, "<|python_start|>", "<|python_end|>", "```json\n", "```", ACTION,
    "<|action_end|>",
    "[", "]", "{", "}", "(", ")", ",", ":", "=", '"', "'", "\\", " ", "\n", "f", "get_time",
    '"name"', '"arguments"', TIME_JSON, "x=1", "é☕", "null", "3",
]  # fmt: skip


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_random_text_never_raises_and_any_split_agrees(name):
    """Fragments of every format and whole outputs of this one, glued at random."""
    rng = random.Random(name)
    new_parser = get_tool_parser(name)
    pieces = FRAGMENTS + [text for text, _, _ in CASES[name]] * 2
    for _ in range(150):
        text = "".join(rng.choices(pieces, k=rng.randrange(1, 10)))
        expected = parse_all(new_parser(), text)
        splits = [list(range(1, len(text)))]  # one character at a time
        for _ in range(6):
            size = min(len(text) + 1, rng.randrange(1, 6))
            splits.append(sorted(rng.sample(range(len(text) + 1), size)))
        for cuts in splits:
            assert _accumulated(feed_in_pieces(new_parser(), text, cuts)) == expected, (text, cuts)


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_pathological_input_is_fast(name):
    new_parser = get_tool_parser(name)
    for text in ("[TOOL_CALLS]" + "{" * 20000, "<|tool_call|>[" + "[" * 20000, "[f(x=" + "[" * 20000,
                 "<tool_call><function=f>" + "<parameter=a>" * 5000, CALLS_BEGIN + CALL_BEGIN * 5000,
                 "[" + '"' * 20001):  # fmt: skip
        result = parse_all(new_parser(), text)
        assert result.calls == () and result.content == text


def test_registered_under_vllms_names():
    for name in NEW_PARSERS:
        assert name in TOOL_PARSERS
    with pytest.raises(ValueError, match="qwen3_coder"):
        get_tool_parser("nope")


def test_cli_accepts_the_new_names_and_lists_them_for_an_unknown_one(capsys):
    from pagedlm.entrypoints.cli.main import build_parser

    for name in NEW_PARSERS:
        args = build_parser().parse_args(["serve", "--tool-call-parser", name])
        assert args.tool_call_parser == name
    from pagedlm.entrypoints.openai.parser_plugins import check_parser_args

    with pytest.raises(SystemExit) as exit_info:
        check_parser_args(build_parser().parse_args(["serve", "--tool-call-parser", "nope"]))
    error = str(exit_info.value)
    assert all(repr(name) in error for name in NEW_PARSERS), error


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


@pytest.mark.parametrize(
    "parser, output",
    [
        ("pythonic", "[get_weather(city='Paris', unit='celsius')]"),
        ("qwen3_coder", f"Checking.\n{QWEN3_CODER_WEATHER}"),
    ],
)
def test_chat_completion_through_the_app(chat_checkpoint, parser, output):
    from server.fake_engine import scripted_chat

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL], "max_tokens": 400}  # fmt: skip
    message, stream = scripted_chat(
        chat_checkpoint, output, body, tool_parser=parser, enable_auto_tool_choice=True
    )
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert message["content"] == ("Checking." if parser == "qwen3_coder" else None)
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    streamed = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed
    ] == calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
