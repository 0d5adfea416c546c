"""The repository root holds only what is listed here, so stray files cannot creep in.

A file at the root is the first thing a reader sees; an empty ``oom`` left by a debugging
session was tracked there for a while. Adding a root entry means adding it (and why) to
``ALLOWED`` on purpose. Ignored files (``.venv``, caches, ``out/``) are not counted.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ALLOWED: dict[str, str] = {
    ".ci": "the CI entry point (.ci/run)",
    ".gitignore": "what git and this test ignore",
    "ARCHITECTURE.md": "layout and design",
    "CHANGELOG.md": "changes, Keep a Changelog",
    "CONTRIBUTING.md": "setup, test tiers, the check to run before each commit",
    "README.md": "what sandlot is and how to use it",
    "SECURITY.md": "the threat model, per layer",
    "bench": "benchmarks and their results",
    "deploy": "the node image's files and the Kubernetes (KubeRay) manifests",
    "docs": "protocol, egress, backend documents",
    "examples": "runnable examples",
    "pyproject.toml": "package metadata and tool configuration",
    "scripts": "setup, check and test scripts",
    "src": "the sandlot package",
    "tests": "the test suite",
}


def _root_entries() -> set[str]:
    """First path components of every tracked file and every untracked, unignored one."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot tell tracked from ignored files")
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("not running from a git checkout of sandlot (e.g. an unpacked sdist)")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return {path.split(b"/", 1)[0].decode() for path in listed.split(b"\0") if path}


def test_only_listed_entries_at_the_repository_root() -> None:
    unexpected = _root_entries() - ALLOWED.keys()
    assert not unexpected, (
        f"unexpected entries at the repository root: {sorted(unexpected)}; remove them, "
        "ignore them in .gitignore, or add them to ALLOWED in this test with a reason"
    )
