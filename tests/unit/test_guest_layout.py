"""The guest layout is written down once, in :mod:`sandlot.protocol.layout`.

Host modules import it; the one exception is the script that runs inside a container
image build (no sandlot there), checked here to agree with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sandlot
from sandlot.protocol import WORKSPACE_ROOTS, layout

SRC = Path(sandlot.__file__).parent


def test_workspace_roots_are_the_layouts() -> None:
    assert WORKSPACE_ROOTS == layout.WORKSPACE_ROOTS == (layout.HOME, "/tmp")


def test_no_module_but_the_layout_spells_a_guest_path() -> None:
    """Every string literal naming the sandbox's home or sandlot's mount points lives in
    ``protocol/layout.py`` (docstrings and comments may mention them)."""
    guest = (layout.HOME, layout.TEMPLATE_GUEST, layout.LIB_GUEST, layout.EGRESS_SOCKET_GUEST)
    spelled: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "layout.py" or path.name == "_image_build.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and any(node.value.startswith(root) for root in guest)
            ):
                spelled.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert spelled == []


def test_the_image_build_script_agrees_with_the_layout() -> None:
    # It runs inside `docker build` where sandlot is not installed, so it spells the
    # paths itself; editing it also renames every built image, so it is checked instead.
    from sandlot.backends.docker import _image_build

    assert layout.TEMPLATE_GUEST == _image_build.ROOT
    assert _image_build.SHARE.startswith(layout.TEMPLATE_SHARE + "/")
    source = (SRC / "backends" / "docker" / "_image_build.py").read_text()
    assert f'"{layout.HOME}"' in source
    assert f"{layout.SANDBOX_UID}:{layout.SANDBOX_GID}" in source
