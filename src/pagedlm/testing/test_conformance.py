"""The conformance kit as pytest tests (shipped in the wheel, collected with ``--pyargs``)::

    PAGEDLM_PLATFORM=<name> python -m pytest --pyargs pagedlm.testing

checks the platform (default: the one pagedlm selects) and every attention backend
registered for it. A check that does not apply (no graph support, no fused sampler) is
skipped with the reason; a failure names the broken promise. See ``docs/plugins.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagedlm.testing import parity, suite
from pagedlm.testing.promises import NotApplicable

PLATFORM = suite.platform_under_test()
TARGETS = suite.backend_targets(PLATFORM)


def _run(check: Callable[..., None], *args) -> None:
    try:
        check(*args)
    except NotApplicable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pagedlm-kit-checkpoints")


@pytest.mark.parametrize("check", list(suite.PLATFORM_CHECKS))
def test_platform(check: str) -> None:
    _run(suite.PLATFORM_CHECKS[check], PLATFORM)


@pytest.mark.parametrize("check", list(suite.BACKEND_CHECKS))
@pytest.mark.parametrize("backend", list(TARGETS))
def test_attention_backend(backend: str, check: str) -> None:
    _run(suite.BACKEND_CHECKS[check], TARGETS[backend])


@pytest.mark.parametrize("arch", list(parity.TINY_MODELS))
@pytest.mark.parametrize("backend", list(TARGETS))
def test_greedy_parity(backend: str, arch: str, checkpoints: Path) -> None:
    _run(parity.check_greedy_parity, PLATFORM, arch, checkpoints, backend)
