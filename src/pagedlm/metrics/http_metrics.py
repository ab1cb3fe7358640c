"""vLLM's ``http_*`` series on ``/metrics``: prometheus-fastapi-instrumentator's default
metrics, with the options vLLM gives it (``Instrumentator(excluded_handlers=[...])``,
every other option the library's default):

- ``http_requests_total{handler, method, status}``;
- ``http_request_size_bytes{handler}`` and ``http_response_size_bytes{handler}``:
  summaries of the ``Content-Length`` headers (0 without one, as for a stream);
- ``http_request_duration_seconds{handler, method}`` (buckets 0.1, 0.5, 1) and
  ``http_request_duration_highr_seconds`` (no labels, 21 buckets up to 60 s).

``handler`` is the route's path template (``/v1/chat/completions``), "none" for a path
no route has; ``status`` is grouped (``2xx``, ``4xx``). A duration runs until the
response's last byte is sent, so a stream is measured to its end. The routes vLLM leaves
out are left out (each pattern searched in the handler): ``/metrics``, ``/health``,
``/load``, ``/ping``, ``/version``, ``/server_info``.

The middleware wraps the routes only, as vLLM's sits inside its CORS and API-key
middleware: a request refused before routing (a wrong API key, a body over the limit, a
model route while asleep) is not counted. The series are unprefixed whatever
``--metric-name-prefix`` says, as vLLM's.

Importing this module imports ``prometheus_fastapi_instrumentator`` (the server extra).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator, metrics

EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
"""vLLM's ``excluded_handlers``: regular expressions searched in a request's handler."""


class HttpMetrics:
    """The ``http_*`` series in ``registry``; ``instrument(app)`` measures an app's
    requests into them (every app instrumented shares them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Registered once, here: left to itself the library's middleware registers them
        # whenever a middleware stack is built, and measures nothing from the second
        # time over one registry on (two apps over one serving context).
        self._instrumentation = metrics.default(registry=registry)

    def instrument(self, app: Any) -> None:
        """Add the measuring middleware to ``app`` (a FastAPI app), inside any added
        after it."""
        instrumentator = Instrumentator(
            excluded_handlers=list(EXCLUDED_HANDLERS), registry=self.registry
        )
        instrumentator.add(self._instrumentation).instrument(app)
