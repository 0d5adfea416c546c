"""Ray is optional: nothing outside sandlot.ray imports it, statically or at run time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")

SRC = Path(__file__).resolve().parents[2] / "src"


def test_only_sandlot_ray_imports_ray() -> None:
    graph = grimp.build_graph("sandlot", include_external_packages=True)
    importers = graph.find_modules_that_directly_import("ray")
    outside = sorted(
        m for m in importers if m != "sandlot.ray" and not m.startswith("sandlot.ray.")
    )
    assert outside == []


def test_the_single_machine_path_does_not_load_ray() -> None:
    # The same entry points a user without the ray extra touches, in a fresh interpreter:
    # a lazy or dynamic import would slip past the static check above.
    probe = (
        "import sys\n"
        "import sandlot, sandlot.pool, sandlot.backends, sandlot.cli, sandlot.server\n"
        "from sandlot.cli import main\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    subprocess.run([sys.executable, "-c", probe], check=True, env=env, timeout=120)
