"""``--tool-parser-plugin`` / ``--reasoning-parser-plugin``: a file registers parsers of its
own, which the parser flags then accept; bad plugins and names are errors that say why."""

from __future__ import annotations

import textwrap

import pytest

from pagedlm.entrypoints.cli.main import build_parser
from pagedlm.entrypoints.openai.parser_plugins import check_parser_args
from pagedlm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    get_reasoning_parser,
    reasoning_parser_factory,
    register_reasoning_parser,
    split_reasoning,
)
from pagedlm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    get_tool_parser,
    parse_all,
    register_tool_parser,
)

PLUGIN = textwrap.dedent(
    """
    from pagedlm.entrypoints.openai.reasoning_parsers import (
        ReasoningDelta,
        ReasoningParser,
        register_reasoning_parser,
    )
    from pagedlm.entrypoints.openai.reasoning_parsers.think import ThinkReasoningParser
    from pagedlm.entrypoints.openai.tool_parsers import HermesToolParser, register_tool_parser


    @register_tool_parser("brackets", "double_brackets")
    class BracketToolParser(HermesToolParser):
        needs_special_tokens = False
        blocks = (("[[", "]]"),)


    @register_reasoning_parser("angles")
    class AngleReasoningParser(ThinkReasoningParser):
        start_tags = ("<<",)
        end_tags = (">>",)
        starts_in_reasoning = False  # like qwen3: a thought only where one is opened


    @register_reasoning_parser("shout")
    class ShoutReasoningParser(ReasoningParser):
        # written before prompt_opens_reasoning: its constructor takes nothing

        def __init__(self):
            self.text = ""

        def feed(self, text):
            self.text += text
            return ReasoningDelta()

        def finish(self):
            return ReasoningDelta("", self.text.upper())
    """
)


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(PLUGIN)
    yield str(path)
    for registry, names in (
        (TOOL_PARSERS, ("brackets", "double_brackets")),
        (REASONING_PARSERS, ("angles", "shout")),
    ):
        for name in names:
            registry.pop(name, None)


def _args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_a_plugin_file_registers_parsers_the_flags_then_accept(plugin) -> None:
    args = _args(
        "--tool-parser-plugin", plugin, "--tool-call-parser", "brackets",
        "--reasoning-parser-plugin", plugin, "--reasoning-parser", "angles",
    )  # fmt: skip
    check_parser_args(args)
    parser_class = get_tool_parser("brackets")
    assert get_tool_parser("double_brackets") is parser_class
    parsed = parse_all(parser_class(), 'Sure. [[{"name": "f", "arguments": {"x": 1}}]]')
    assert parsed.content == "Sure." and [c.name for c in parsed.calls] == ["f"]
    split = split_reasoning(get_reasoning_parser("angles")(), "<<hmm>>yes")
    assert (split.reasoning, split.content) == ("hmm", "yes")
    check_parser_args(args)  # loading the same file again changes nothing


def test_unknown_names_list_the_choices_and_point_at_the_plugin_flag() -> None:
    with pytest.raises(SystemExit, match="register it in a file given to --tool-parser-plugin"):
        check_parser_args(_args("--tool-call-parser", "brackets"))
    with pytest.raises(SystemExit, match=r"--reasoning-parser 'nope' is unknown; choose one of"):
        check_parser_args(_args("--reasoning-parser", "nope"))


def test_bad_plugins_say_what_went_wrong(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no such file"):
        check_parser_args(_args("--tool-parser-plugin", str(tmp_path / "absent.py")))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(SystemExit, match="failed to load: RuntimeError: boom"):
        check_parser_args(_args("--tool-parser-plugin", str(broken)))
    with pytest.raises(SystemExit, match="failed to load: ModuleNotFoundError"):
        check_parser_args(_args("--reasoning-parser-plugin", "no_such_parser_module"))


def test_a_taken_name_or_a_class_of_another_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="'hermes' is taken by HermesToolParser"):

        @register_tool_parser("hermes")
        class Other(HermesToolParser):
            pass

    assert TOOL_PARSERS["hermes"] is HermesToolParser
    with pytest.raises(TypeError, match="must subclass ReasoningParser"):
        register_reasoning_parser("mine")(HermesToolParser)
    assert "mine" not in REASONING_PARSERS


def test_plugin_parsers_after_a_template_that_opened_the_thought(plugin, chat_checkpoint) -> None:
    """A parser built on ``ThinkReasoningParser`` starts inside the thought the prompt
    opened (its text was the content); one whose constructor takes no
    ``prompt_opens_reasoning`` is built as before."""
    from server.fake_engine import scripted_chat

    check_parser_args(_args("--reasoning-parser-plugin", plugin))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}|<<\n"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    message, stream = scripted_chat(
        chat_checkpoint, "hmm>>yes", body, reasoning_parser="angles", chat_template=template
    )
    assert (message["reasoning_content"], message["content"]) == ("hmm", "yes")
    assert '"reasoning_content": "h' in stream
    assert reasoning_parser_factory(get_reasoning_parser("shout"), "<<") is get_reasoning_parser(
        "shout"
    )
    message, _ = scripted_chat(
        chat_checkpoint, "hmm>>yes", body, reasoning_parser="shout", chat_template=template
    )
    assert (message["reasoning_content"], message["content"]) == (None, "HMM>>YES")
