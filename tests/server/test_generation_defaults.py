"""Every generating endpoint fills the sampling fields a request leaves unset from the
model's generation config, and caps max_tokens with its max_new_tokens (vLLM's server)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from fake_engine import FakeEngine
from responses_app import in_process_app
from server_utils import start_server

DEFAULTS = {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "max_tokens": 4}


class RecordingEngine(FakeEngine):
    """Keeps the parameters of every request it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params = []

    def generate(self, prompt, params, request_id, priority=0, lora_request=None):
        self.params.append(params)
        return super().generate(prompt, params, request_id, priority, lora_request)


@pytest.fixture
def served(chat_checkpoint):
    engine = RecordingEngine(chat_checkpoint, num_tokens=20)
    with in_process_app(chat_checkpoint, engine=engine, sampling_defaults=DEFAULTS) as http:
        yield http, engine


MESSAGES = [{"role": "user", "content": "Hello there"}]
REQUESTS = [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/responses", {"input": "Hello"}),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 50}),
]


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_unset_fields_take_the_models_defaults(served, path, body):
    http, engine = served
    response = http.post(path, json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    params = engine.params[-1]
    assert (params.temperature, params.top_k, params.top_p) == (0.25, 7, 0.5)
    assert params.max_tokens == 4  # the config's max_new_tokens caps the request's 50 too
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0  # not in the config


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_fields_a_request_sets_are_its_own(served, path, body):
    http, engine = served
    own = {"temperature": 0.9, "top_k": 3, "top_p": 0.8, "max_tokens": 2}
    if path == "/v1/responses":  # no top_k there, and max_tokens is max_output_tokens
        own = {"temperature": 0.9, "top_p": 0.8, "max_output_tokens": 2}
    response = http.post(path, json={"model": "tiny", **body, **own})
    assert response.status_code == 200, response.text
    params = engine.params[-1]
    assert params.temperature == 0.9 and params.top_p == 0.8 and params.max_tokens == 2
    assert params.top_k == own.get("top_k", 7)


def test_the_responses_object_reports_the_temperature_it_ran_with(served):
    http, _ = served
    response = http.post("/v1/responses", json={"model": "tiny", "input": "Hello"}).json()
    assert (response["temperature"], response["top_p"]) == (0.25, 0.5)


def test_pagedlm_serve_reads_the_checkpoints_generation_config(chat_checkpoint, tmp_path):
    """End to end: the server's engine config carries the file's defaults to the routes;
    --override-generation-config changes them."""
    model = tmp_path / "model"
    shutil.copytree(chat_checkpoint, model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update(temperature=0.0, max_new_tokens=5)
    config_path.write_text(json.dumps(config))
    server = start_server(
        model, tmp_path / "server.log", "--override-generation-config", '{"max_new_tokens": 3}'
    )
    try:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 40}
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    # temperature 0 from the file (greedy: the same text twice), max_tokens capped at the
    # override's 3 (the request asked 40).
    assert first["usage"]["completion_tokens"] == 3
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    # Logged once: by the front end, not again by the engine-core process.
    assert (tmp_path / "server.log").read_text().count("come from") == 1
