"""The layer rule, checked on the source (docs/ARCHITECTURE.md, "Layers").

entry points (mooncaked CLI, up, demo, bench, simulate, tools)
    -> roles/
    -> node plumbing (mooncaked/node/)
    -> kvstore/ | model/ | rdma/

Every import counts: module level, inside functions, and under
``if TYPE_CHECKING:`` (a type-only cycle is still a cycle a reader follows).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO as ROOT

PACKAGES = ("mooncaked", "roles", "kvstore", "model", "rdma")


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _known(name: str) -> str | None:
    """The project module an import of `name` loads last (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Project modules `module` imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import name`: the submodule when `name` is one, else pkg.
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES
                       else prefix for alias in node.names]
        else:
            continue
        for target in targets:
            known = _known(target)
            if known is not None and known != module:
                out.add(known)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def layer(module: str) -> int:
    """Higher imports lower, never the reverse.  ``mooncaked`` itself is a leaf
    (it only holds ``__version__``) that every layer may read."""
    top = module.split(".")[0]
    if module == "mooncaked":
        return -1
    if top in ("kvstore", "model", "rdma"):
        return 0
    if module.startswith("mooncaked.node"):
        return 1
    if top == "roles":
        return 2
    return 3  # the rest of mooncaked/: entry points


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_cycles_and_package_imports():
    # The checker itself must be able to fail.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "roles.scheduling.policies" in GRAPH["roles.scheduling.registry"]
    assert "mooncaked.node.errors" in GRAPH["roles.conductor.openai_parse"]


def test_no_import_cycles_between_files():
    assert _cycles(GRAPH) == []


def test_layers_point_one_way():
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                    if layer(d) > layer(m))
    assert upward == []


def test_the_version_leaf_imports_nothing():
    assert GRAPH["mooncaked"] == set()


@pytest.mark.parametrize("banned", ["asyncio", "aiohttp", "time", "socket", "threading"])
def test_the_scheduling_core_does_no_io_and_reads_no_clock(banned):
    """The HTTP conductor and the simulator run the same core: no I/O, no clock."""
    for module, path in MODULES.items():
        if not module.startswith("roles.scheduling"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert banned not in {n.split(".")[0] for n in names}, f"{module} imports {banned}"


def test_the_simulator_uses_only_the_scheduling_core_of_roles():
    """The simulator must not know more than the conductor: it drives
    ``roles.scheduling`` and nothing else of the roles."""
    for module, deps in GRAPH.items():
        if module.startswith("mooncaked.simulate"):
            bad = sorted(d for d in deps if d.startswith("roles")
                         and not d.startswith("roles.scheduling"))
            assert bad == [], f"{module} imports {bad}"
