"""The example out-of-tree plugin passes the conformance kit, run the documented way:
``PAGEDLM_PLATFORM=example python -m pytest --pyargs pagedlm.testing``.

The example is installed for most of these tests through its entry points
(``plugin_kit``), not with pip: the discovery path is the same, and the environment is left
as it was. One test pip-installs it into a fresh virtual environment and runs the kit there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlm.plugins.registry import create_plugin_manager, get_plugin_manager, select_platform
from pagedlm.testing import TINY_MODELS, NotApplicable, check_greedy_parity
from plugin_kit import install_example, kit_checkpoints

pytest_plugins = ["pytester"]

KIT_COMMAND = [
    sys.executable,
    "-m",
    "pytest",
    "--pyargs",
    "pagedlm.testing",
    "-p",
    "no:cacheprovider",
]


def test_documented_command_passes_for_the_example(example_platform, pytester, monkeypatch) -> None:
    """Every platform and attention check, through the kit's pytest module, in this process
    (parity is the next test; the whole command runs in a fresh venv below)."""
    monkeypatch.setenv("PAGEDLM_PLATFORM", "example")
    result = pytester.runpytest_inprocess(
        "--pyargs", "pagedlm.testing", "-p", "no:cacheprovider", "-v", "-rs", "-k", "not parity"
    )
    # Skipped: no fused sampler, greedy verifier, in-flight corrector or step gatherer; no
    # graphs; no view of host memory.
    result.assert_outcomes(passed=15, skipped=6)
    result.stdout.fnmatch_lines(
        [
            "*test_attention_backend?example_attention-slot_mapping? PASSED*",
            "*test_attention_backend?example_attention-sliding_window? PASSED*",
            "*platform 'example' maps no host memory*",
            "*platform 'example' hands the sampler no fused kernel*",
            "*'example_attention' * captures no graph*",
        ]
    )


@pytest.fixture
def example_platform(monkeypatch, tmp_path):
    install_example(monkeypatch, tmp_path / "site-packages")
    yield select_platform("example", pm=create_plugin_manager(autoload=True))
    get_plugin_manager.cache_clear()


@pytest.mark.parametrize("arch", list(TINY_MODELS))
def test_greedy_parity_with_the_cpu(example_platform, arch, tmp_path_factory) -> None:
    checkpoints = kit_checkpoints(tmp_path_factory)
    if arch == "gemma2_soft_cap":  # its backend has no soft-cap: refused, by name
        with pytest.raises(NotApplicable, match=r"refuses tiny gemma2_soft_cap.*logits_soft_cap"):
            check_greedy_parity(example_platform, arch, checkpoints)
    else:
        check_greedy_parity(example_platform, arch, checkpoints)


def test_pip_installed_example_passes_the_kit_in_a_fresh_venv(tmp_path) -> None:
    """The plugin author's path for real: ``pip install ./examples/platform_plugin`` into
    a new virtual environment (it sees this one's packages, pagedlm included: nothing is
    downloaded), then the whole documented command there, greedy parity included."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    python = str(venv / "bin" / "python")
    example = Path(__file__).resolve().parents[2] / "examples" / "platform_plugin"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    subprocess.run(
        [*pip, "--no-deps", "--no-build-isolation", "--no-index", str(example)],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    env = {**os.environ, "PAGEDLM_PLATFORM": "example"}
    env.pop("PAGEDLM_PLUGINS", None)
    env.pop("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", None)
    result = subprocess.run(
        [python, *KIT_COMMAND[1:], "-q", "-rs"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Skipped: no fused sampler, greedy verifier, in-flight corrector or step gatherer, no
    # graphs, and the soft cap its backend refuses by name.
    assert "17 passed, 7 skipped" in result.stdout, result.stdout[-2000:]
    # The example came from the venv's site-packages, not from a path this test set up.
    origin = subprocess.run(
        [python, "-c", "import pagedlm_example_platform as m; print(m.__file__)"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )  # fmt: skip
    assert origin.stdout.startswith(str(venv)), origin.stdout
