"""The import structure: no module imports itself back through others, and the step
protocol is a leaf every other package may import.

Read from the source with ``ast`` (every import, including those inside functions and under
``TYPE_CHECKING``), so a cycle hidden behind a lazy import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    resolve(f"{node.module}.{alias.name}") or resolve(node.module)
                    for alias in node.names
                ]
            else:
                continue
            # The top-level package re-exports the public API; importing it names no edge.
            graph[name].update(t for t in targets if t and t != name and "." in t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def test_no_module_imports_itself_back() -> None:
    assert _cycles(_import_graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_step_protocol_is_a_leaf() -> None:
    graph = _import_graph()
    step_modules = [name for name in graph if name.startswith("pagedlm.step")]
    assert "pagedlm.step.scheduler_output" in step_modules
    for name in step_modules:
        outside = {t for t in graph[name] if not t.startswith("pagedlm.step")}
        assert outside <= {"pagedlm.sampling_params", "pagedlm.lora.request"}, (name, outside)


FIRST_IMPORT = """
import importlib, pkgutil, sys
import pagedlm.model_executor as package
failed = []
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    for key in [k for k in sys.modules if k == "pagedlm" or k.startswith("pagedlm.")]:
        del sys.modules[key]
    try:
        importlib.import_module(info.name)
    except ImportError as error:
        failed.append(f"{info.name}: {error}")
print("\\n".join(failed))
"""


def test_every_model_executor_module_imports_first() -> None:
    """Importing a module runs its packages' ``__init__`` first, which the graph above does
    not count: ``weight_offload`` -> ``layers.vocab_embedding`` -> ``loader.weight_utils``
    ran ``loader/__init__``, which imported ``weight_offload`` back, so nine modules (every
    model with a vocabulary embedding) failed when a program imported them first. Each
    module is imported into a fresh ``pagedlm`` (torch stays loaded)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ""
