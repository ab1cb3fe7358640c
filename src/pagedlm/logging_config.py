"""How every pagedlm process configures Python's logging: the server, its engine-core
process and the core's worker processes alike.

By default each process logs ``LEVEL name: message`` lines at its level (the server's
``--log-level``, handed on as ``PAGEDLM_LOG_LEVEL``). A logging configuration file
(``--log-config-file``, or ``PAGEDLM_LOGGING_CONFIG_PATH`` as vLLM's
``VLLM_LOGGING_CONFIG_PATH``) replaces that: a JSON object in ``logging.config.dictConfig``'s
schema, applied in every process, uvicorn's loggers included. The server hands the path on
in the same variable, so processes it starts read the same file.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
from typing import Any

LOG_LEVEL_ENV = "PAGEDLM_LOG_LEVEL"
LOGGING_CONFIG_ENV = "PAGEDLM_LOGGING_CONFIG_PATH"
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def read_logging_config(path: str) -> dict[str, Any]:
    """The file's ``dictConfig`` mapping; ValueError names the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except OSError as error:
        raise ValueError(f"logging config {path}: {error.strerror}.") from None
    except ValueError as error:
        raise ValueError(f"logging config {path} is not JSON: {error}.") from None
    if not isinstance(config, dict) or "version" not in config:
        raise ValueError(
            f"logging config {path} must be a JSON object in logging.config.dictConfig's "
            'schema (with "version": 1).'
        )
    return config


def configure_logging(level: str | None = None, config_path: str | None = None) -> None:
    """This process's logging: the configuration file (``config_path``, else
    ``$PAGEDLM_LOGGING_CONFIG_PATH``) if there is one, else ``level`` (else
    ``$PAGEDLM_LOG_LEVEL``, else WARNING) in pagedlm's line format."""
    path = config_path or os.environ.get(LOGGING_CONFIG_ENV) or None
    if path is None:
        level = (level or os.environ.get(LOG_LEVEL_ENV) or "WARNING").upper()
        logging.basicConfig(level=level, format=LOG_FORMAT)
        return
    config = read_logging_config(path)
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as error:
        raise ValueError(f"logging config {path} was refused by dictConfig: {error}") from None
