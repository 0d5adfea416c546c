"""ARCHITECTURE.md's tree must match src/sandlot: the map may not drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sandlot"


def _documented_paths() -> set[str]:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text.split("src/sandlot/\n", 1)[1].split("```", 1)[0]
    paths: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        match = re.match(r"^([│ ]*)[├└]── (\S+)", line)
        if not match:
            continue
        depth = len(match.group(1)) // 4
        name = match.group(2)
        stack = stack[:depth]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            continue
        # "protocol/__init__.py" style entries name a file inside a package directly.
        paths.add("/".join([*stack, name]))
    return paths


def _actual_paths() -> set[str]:
    return {
        str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if "__pycache__" not in path.parts
    }


def test_every_module_is_on_the_map() -> None:
    missing = _actual_paths() - _documented_paths()
    assert not missing, f"modules missing from ARCHITECTURE.md's tree: {sorted(missing)}"


def test_the_map_names_no_module_that_does_not_exist() -> None:
    stale = {p for p in _documented_paths() if p.endswith(".py")} - _actual_paths()
    assert not stale, f"ARCHITECTURE.md names modules that do not exist: {sorted(stale)}"
