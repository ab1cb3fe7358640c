"""``/openapi.json`` with every route's request body, as the pydantic models that parse it.

The routes read their bodies themselves (``request_body.parse_body``: strict JSON, the
API's own error shapes), so FastAPI cannot see the models; each body route declares its
model here instead, and the schema generator puts the models under
``components.schemas``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"


def request_body_spec(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    schema = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` (served at /openapi.json) describe ``models`` too."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _, definitions = models_json_schema(
                [(model, "validation") for model in models], ref_template=REF_TEMPLATE
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(definitions.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
