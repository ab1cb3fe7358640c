"""``--log-config-file`` (a ``dictConfig`` JSON for the server, its engine core and uvicorn)
and ``--disable-access-log-for-endpoints``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx
import pytest

from pagedlm.entrypoints.cli.main import parse_args
from pagedlm.entrypoints.openai.http_options import AccessLogPathFilter
from pagedlm.logging_config import configure_logging, read_logging_config
from server.server_utils import start_server


def _file_config(log_file) -> dict:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tagged": {"format": "TAGGED %(name)s %(levelname)s %(message)s"}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "formatter": "tagged",
            },
        },
        "root": {"level": "INFO", "handlers": ["file"]},
    }


def test_a_config_file_replaces_the_level_in_a_fresh_process(tmp_path):
    log_file, config = tmp_path / "out.log", tmp_path / "logging.json"
    config.write_text(json.dumps(_file_config(log_file)))
    code = (
        "import logging; from pagedlm.logging_config import configure_logging;"
        "configure_logging('ERROR');"  # the file wins over the level
        "logging.getLogger('pagedlm.x').info('hello from info')"
    )
    env = {"PAGEDLM_LOGGING_CONFIG_PATH": str(config), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert log_file.read_text() == "TAGGED pagedlm.x INFO hello from info\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [("{", "is not JSON"), ("[1]", "dictConfig's schema"), ('{"a": 1}', '"version": 1')],
)
def test_a_bad_config_file_is_named(tmp_path, text, message):
    config = tmp_path / "logging.json"
    config.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        read_logging_config(str(config))
    assert str(config) in str(error.value)
    with pytest.raises(ValueError, match="No such file"):
        configure_logging(config_path=str(tmp_path / "missing.json"))


def test_the_access_log_filter_matches_paths_without_their_query():
    keep = AccessLogPathFilter(frozenset({"/health", "/metrics"}))

    def record(path: str) -> logging.LogRecord:
        args = ("1.2.3.4:5", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', args,
                                 None)  # fmt: skip

    assert not keep.filter(record("/health")) and not keep.filter(record("/metrics?x=1"))
    assert keep.filter(record("/v1/models")) and keep.filter(record("/healthz"))
    assert parse_args(["serve", "--disable-access-log-for-endpoints", "/health, /metrics"]
                      ).disable_access_log_for_endpoints == {"/health", "/metrics"}  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(["serve", "--disable-access-log-for-endpoints", "health"])


def test_the_server_and_its_core_log_through_the_file(chat_checkpoint, tmp_path):
    log_file, config = tmp_path / "server.log", tmp_path / "logging.json"
    config.write_text(json.dumps(_file_config(log_file)))
    server = start_server(chat_checkpoint, tmp_path / "out.txt", "--log-config-file",
                          str(config), "--disable-access-log-for-endpoints", "/health")  # fmt: skip
    try:
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    finally:
        assert server.stop() == 0
    text = log_file.read_text()
    lines = text.splitlines()
    assert all(line.startswith("TAGGED ") for line in lines if line.strip()), text[:2000]
    # The engine-core process logged its loading through the same file, at its INFO level
    # (the server's --log-level warning is replaced by the file).
    assert any(line.startswith("TAGGED pagedlm.worker.") for line in lines), text[:2000]
    assert any(line.startswith("TAGGED pagedlm.server INFO Engine ready") for line in lines)
    access = [line for line in lines if line.startswith("TAGGED uvicorn.access")]
    assert any("/v1/models" in line for line in access), text[:2000]
    assert not any("/health" in line for line in access), text[:2000]
