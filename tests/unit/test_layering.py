"""sandlot's import graph: no cycles, a stdlib-only runner, no backend's private names
used from outside it.

The layer contracts themselves are import-linter's (``[tool.importlinter]`` in
pyproject.toml, run by ``lint-imports`` in scripts/check); this module checks what
those contract types cannot say. The graph comes from grimp, import-linter's own graph
library, so both read the same imports.

Imports under ``if TYPE_CHECKING:`` count. They never run, so they cannot cause an
import-order failure, but they are design dependencies all the same (mypy and readers
follow them), and a cycle moved behind ``TYPE_CHECKING`` still means neither module can
be understood, tested or replaced without the other.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sandlot"

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles that exist on purpose or are being removed; every entry needs its reason."""

RUNNER_THIRD_PARTY: dict[tuple[str, str], str] = {
    ("sandlot.runner._kernel", "matplotlib"): (
        "only when a pool preloads matplotlib, inside the template's interpreter, guarded"
    ),
}
"""(importer, package) pairs the stdlib-only runner may import, with the reason."""

KNOWN_PRIVATE_NAME_IMPORTS: dict[tuple[str, str], str] = {}
"""(importer, name) pairs still waiting for their fix; every entry needs its reason."""


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # No cache: a test should not write into whatever directory pytest runs from.
    return grimp.build_graph("sandlot", include_external_packages=True, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> Iterator[list[str]]:
    """Strongly connected components of more than one sandlot module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if m == "sandlot" or m.startswith("sandlot."))
    edges = {
        m: sorted(
            i
            for i in graph.find_modules_directly_imported_by(m)
            if i == "sandlot" or i.startswith("sandlot.")
        )
        for m in modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if child < len(edges[node]):
                work.append((node, child + 1))
                nxt = edges[node][child]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    yield sorted(component)


def test_the_cycle_finder_finds_a_cycle() -> None:
    # Control: a graph with one planted cycle (and a self-contained chain) yields it.
    planted = grimp.ImportGraph()
    for name in ("sandlot", "sandlot.a", "sandlot.b", "sandlot.c", "sandlot.d"):
        planted.add_module(name)
    planted.add_import(importer="sandlot.a", imported="sandlot.b")
    planted.add_import(importer="sandlot.b", imported="sandlot.c")
    planted.add_import(importer="sandlot.c", imported="sandlot.a")
    planted.add_import(importer="sandlot.d", imported="sandlot.a")
    assert list(_cycles(planted)) == [["sandlot.a", "sandlot.b", "sandlot.c"]]


def test_no_import_cycle_inside_sandlot(graph: grimp.ImportGraph) -> None:
    found = [c for c in _cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    details = []
    for component in found:
        members = set(component)
        for importer in component:
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
                lines = graph.get_import_details(importer=importer, imported=imported)
                where = ", ".join(f"l.{d['line_number']}" for d in lines)
                details.append(f"  {importer} -> {imported} ({where})")
    assert not found, "import cycles inside sandlot:\n" + "\n".join(details)


@pytest.mark.parametrize("package", ["sandlot.runner", "sandlot.protocol"])
def test_runner_and_protocol_import_only_the_standard_library(
    graph: grimp.ImportGraph, package: str
) -> None:
    # They run inside the sandbox, on the template's interpreter, before anything of
    # sandlot's host side exists there (import-linter checks the sandlot side).
    stdlib = set(sys.stdlib_module_names)
    offending = []
    for importer in sorted({package} | graph.find_descendants(package)):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            top = imported.split(".")[0]
            if top == "sandlot" or top in stdlib or (importer, top) in RUNNER_THIRD_PARTY:
                continue
            offending.append(f"{importer} -> {imported}")
    assert not offending, f"{package} must use only the standard library: {offending}"


def test_only_sandlot_ray_imports_ray(graph: grimp.ImportGraph) -> None:
    # Ray is an optional extra: the single-machine path (the SDK, the server, the CLI
    # until `serve --ray` asks for it, lazily) must import without it.
    offending = [
        f"{importer} -> {imported}"
        for importer in sorted(m for m in graph.modules if m.startswith("sandlot."))
        if not (importer == "sandlot.ray" or importer.startswith("sandlot.ray."))
        for imported in sorted(graph.find_modules_directly_imported_by(importer))
        if imported == "ray" or imported.startswith("ray.")
    ]
    assert not offending, f"only sandlot.ray may import ray: {offending}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_imports(path: Path) -> Iterator[tuple[str, str, int]]:
    """(module, name, line) for every ``from module import name`` in a file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module or ""
        for alias in node.names:
            yield module, alias.name, node.lineno


def _backend_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["sandlot", "backends"] and not parts[2].startswith("_"):
        return ".".join(parts[:3])
    return None


def test_no_backend_private_names_are_imported_from_outside_it() -> None:
    # import-linter sees modules, not names: `from sandlot.backends.bwrap import _probe`
    # is an import of the public module sandlot.backends.bwrap. This checks the names.
    offending = []
    known_seen = set()
    for path in sorted(SRC.rglob("*.py")):
        importer = _module_name(path)
        for module, name, line in _from_imports(path):
            backend = _backend_of(module)
            if backend is None or importer == backend or importer.startswith(backend + "."):
                continue
            if (importer, name) in KNOWN_PRIVATE_NAME_IMPORTS:
                known_seen.add((importer, name))
            elif name.startswith("_"):
                offending.append(f"{importer} (l.{line}): from {module} import {name}")
    assert not offending, "a backend's private names used outside it:\n" + "\n".join(offending)
    # An exception whose import is gone must leave the list, or it would excuse the next.
    stale = sorted(set(KNOWN_PRIVATE_NAME_IMPORTS) - known_seen)
    assert not stale, f"KNOWN_PRIVATE_NAME_IMPORTS entries no longer needed: {stale}"


def test_the_public_api_contract_lists_every_private_top_level_module() -> None:
    # The contract names each private top-level module (import-linter has no "_*"
    # wildcard), so a new one must be added there or the CLI could import it unseen.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    public_api = [c for c in contracts if "only the public API" in c["name"]]
    assert public_api, "no public-API contract in pyproject.toml"
    private = {
        f"sandlot.{p.stem if p.is_file() else p.name}"
        for p in SRC.iterdir()
        if p.name.startswith("_")
        and not p.name.startswith("__")
        and (p.suffix == ".py" or (p / "__init__.py").exists())
    }
    for contract in public_api:
        assert set(contract["forbidden_modules"]) == private, contract["name"]
