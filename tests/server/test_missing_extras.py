"""A missing optional package is the server's gap: a 400/501 naming the extra to install,
never a bare 500, and the server serves on. Imports fail by ``sys.modules[name] = None``
(Python then refuses ``import name``), not by uninstalling."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from responses_app import in_process_app, sdk_client

from pagedlm.entrypoints.openai.extras import EXTRA_OF_PACKAGE, install_hint

PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"
HOUR = {"type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": HOUR}}]
MESSAGES = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def http(chat_checkpoint):
    with in_process_app(chat_checkpoint) as http:
        yield http


def _hide(monkeypatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_the_server_extra_holds_what_tools_and_response_formats_need():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    server = set(extras["server"])
    assert {"jsonschema", "xgrammar"} <= server  # the default grammar backend included
    for module, extra in EXTRA_OF_PACKAGE.items():
        assert extra in extras, (module, extra)
    assert install_hint("jsonschema.validators") == "pip install 'pagedlm[server]'"
    assert install_hint("some_unknown_pkg.sub") == "pip install some_unknown_pkg"


def test_tools_without_jsonschema_are_a_501_naming_the_extra(http, monkeypatch):
    client = sdk_client(http)
    _hide(monkeypatch, "jsonschema")
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=stream
            )
        assert caught.value.status_code == 501
        assert "pip install 'pagedlm[server]'" in caught.value.message
    monkeypatch.undo()
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].finish_reason is not None  # the server serves on


def test_structured_outputs_without_xgrammar_are_a_400_naming_the_extra(http, monkeypatch):
    client = sdk_client(http)
    _hide(monkeypatch, "xgrammar", "pagedlm.structured_output.xgrammar_backend")
    with pytest.raises(openai.BadRequestError, match=r"pip install 'pagedlm\[structured\]'"):
        client.completions.create(
            model="tiny",
            prompt="Pick:",
            max_tokens=3,
            # a choice no other test sends: the backend's check is cached per spec
            extra_body={"structured_outputs": {"choice": ["missing-xgrammar-a", "b"]}},
        )


def test_any_missing_import_in_a_handler_is_a_501_not_a_500(http, monkeypatch):
    from pagedlm.entrypoints.openai.serving_chat import ChatServer

    async def create_with_tracing(self, request):
        import opentelemetry  # noqa: F401 - hidden below, as on a server without it

    _hide(monkeypatch, "opentelemetry")
    monkeypatch.setattr(ChatServer, "create", create_with_tracing)
    with pytest.raises(openai.APIStatusError) as caught:
        sdk_client(http).chat.completions.create(model="tiny", messages=MESSAGES)
    assert caught.value.status_code == 501
    assert "'opentelemetry'" in caught.value.message and "pip install" in caught.value.message
