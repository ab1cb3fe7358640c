"""Helpers for the plugin and conformance-kit tests.

The example out-of-tree plugin (``examples/platform_plugin``) is made visible to a test the
way ``pip install -e`` would, without changing the environment.

An editable install adds the package's source directory to ``sys.path`` and writes a
``.dist-info`` directory holding its entry points, which ``importlib.metadata`` (and so
pluggy's ``load_setuptools_entrypoints``) discovers. Here both go into ``sys.path`` for one
test only, the dist-info made from the example's own ``pyproject.toml``: the test sees
exactly the entry points a user's install would register, through the same discovery.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "platform_plugin"
EXAMPLE_SRC = EXAMPLE_DIR / "src"


def example_project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((EXAMPLE_DIR / "pyproject.toml").read_text())["project"]


def write_dist_info(directory: Path) -> list[str]:
    """A ``.dist-info`` for the example in ``directory``; returns the ``sys.path`` entries
    that make it installed (``directory`` and the example's source)."""
    project = example_project()
    dist_info = directory / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
        for group, points in project["entry-points"].items()
    )
    (dist_info / "entry_points.txt").write_text(entry_points)
    return [str(directory), str(EXAMPLE_SRC)]


def install_example(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Make the example installed until ``monkeypatch`` is undone, and rebuild the
    process-wide plugin manager to see it (the caller clears it again at the end)."""
    from pagedlm.plugins.registry import get_plugin_manager

    for entry in write_dist_info(directory):
        monkeypatch.syspath_prepend(entry)
    get_plugin_manager.cache_clear()


def subprocess_env(directory: Path, **extra: str) -> dict[str, str]:
    """Environment for a child Python that sees this checkout and the installed example."""
    src = Path(__file__).resolve().parents[1] / "src"
    paths = [str(src), *write_dist_info(directory), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def kit_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per test session for the kit's tiny checkpoints (``tiny_checkpoint``
    makes each model once there, and CPU reference tokens are cached per directory)."""
    path = tmp_path_factory.getbasetemp() / "pagedlm-kit-checkpoints"
    path.mkdir(exist_ok=True)
    return path
