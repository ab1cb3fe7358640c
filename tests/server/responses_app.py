"""The app in process over ``FakeEngine``, served to the unmodified ``openai`` SDK.

Starlette's ``TestClient`` is an ``httpx.Client``, so the SDK sends its requests straight
into the ASGI app (no port, no subprocess); each SDK client may present its own API key.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

BASE_URL = "http://testserver"


@contextmanager
def in_process_app(
    checkpoint: Path, num_tokens: int = 3, engine: FakeEngine | None = None, **context: Any
) -> Iterator[TestClient]:
    """The app over ``engine`` (a new ``FakeEngine`` by default); ``context``: further
    ``ServingContext`` fields."""
    ctx = fake_context(engine or FakeEngine(checkpoint, num_tokens=num_tokens), **context)
    with TestClient(build_app(ctx), base_url=BASE_URL) as http:
        yield http


def sdk_client(http: TestClient, api_key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{BASE_URL}/v1", api_key=api_key, http_client=http, max_retries=0
    )
