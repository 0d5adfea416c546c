"""The backend registry: backends are entry points, imported only when asked for.

``import sandlot`` must stay light (no backend, no egress proxy, no asyncio): every
script, CLI call and server worker pays for it. Each check runs in a fresh
interpreter, since this test process has long since imported everything.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest

from sandlot._exceptions import InvalidArgumentError
from sandlot.backends import (
    BACKENDS,
    Probe,
    auto_choice,
    backend_names,
    get_backend,
    load_backend,
)
from sandlot.backends.bwrap import BwrapBackend

HEAVY = (
    "asyncio",
    "sandlot.backends.bwrap",
    "sandlot.backends.docker",
    "sandlot.egress",
    "sandlot.templates",
)
"""Modules ``import sandlot`` must not load."""


def _modules_after(code: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_import_sandlot_loads_no_backend_no_proxy_no_asyncio() -> None:
    loaded = _modules_after("import sandlot")
    assert "sandlot" in loaded
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == []


def test_listing_backends_imports_none_of_them() -> None:
    loaded = _modules_after("from sandlot.backends import backend_names; backend_names()")
    assert not any(
        m.startswith(("sandlot.backends.bwrap", "sandlot.backends.docker")) for m in loaded
    )


def test_asking_for_one_backend_imports_only_its_package() -> None:
    loaded = _modules_after("from sandlot.backends import load_backend; load_backend('bwrap')")
    assert "sandlot.backends.bwrap" in loaded
    assert "sandlot.backends.docker" not in loaded


def test_builtins_are_declared_and_load_by_name() -> None:
    assert {"bwrap", "docker", "podman", "zygote"} <= set(backend_names())
    assert backend_names() == sorted(backend_names())
    assert load_backend("bwrap") is BwrapBackend
    assert BACKENDS["bwrap"] is BwrapBackend
    for name in ("bwrap", "docker", "podman", "zygote"):
        assert BACKENDS[name].name == name


def test_an_unknown_name_is_a_typed_error_listing_the_known_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="known: auto, bwrap"):
        get_backend("no-such-backend")
    assert "no-such-backend" not in BACKENDS
    with pytest.raises(KeyError):
        BACKENDS["no-such-backend"]


def _probes(**available: int) -> list[Probe]:
    """A probe per built-in backend: those named available, with the given strength."""
    names = ("bwrap", "docker", "podman", "zygote", "microvm")
    return [
        Probe(n, n in available, "" if n in available else "absent", "", available.get(n, 0))
        for n in names
    ]


def test_auto_starts_the_strongest_backend_through_its_fast_path() -> None:
    # bubblewrap is the strongest; its fast path (the zygote) starts its sandboxes.
    assert BwrapBackend.fast_path == "zygote"
    assert auto_choice(_probes(bwrap=10, zygote=9, docker=5)) == "zygote"
    # Strength decides which technology; the fast path is used only for that one.
    assert auto_choice(_probes(zygote=9, docker=11)) == "docker"


def test_auto_without_the_fast_path_takes_the_backend_itself() -> None:
    assert auto_choice(_probes(bwrap=10, docker=5)) == "bwrap"
    assert auto_choice(_probes(docker=5, podman=4)) == "docker"
    assert auto_choice(_probes()) is None


def test_auto_never_picks_a_backend_that_is_by_name_only() -> None:
    # A VM per sandbox takes seconds to start: asked for by name, never the default,
    # whatever its strength and even when nothing else is available.
    assert load_backend("microvm").by_name_only
    assert auto_choice(_probes(microvm=99, bwrap=10, zygote=9)) == "zygote"
    assert auto_choice(_probes(microvm=99)) is None


def test_auto_does_not_probe_a_backend_it_never_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every default Sandbox() resolves "auto": a by-name-only backend's probe (the
    # microVM's reads its artifacts) would be work for nothing on each of them.
    probed: list[str] = []
    microvm = load_backend("microvm")

    def probe(cls: type) -> Probe:
        probed.append("microvm")
        return Probe("microvm", True, "", "", 99)

    monkeypatch.setattr(microvm, "probe", classmethod(probe))
    with contextlib.suppress(Exception):  # whatever this host has: the probes asked matter
        get_backend("auto")
    assert probed == []
    assert microvm.probe().available  # the patch is in place: doctor still probes it


def test_auto_gives_the_zygote_a_first_start_that_does_not_wait() -> None:
    # Named explicitly, the zygote backend waits for its zygote (callers that name it
    # want forks); through "auto", a process's first sandbox starts cold instead.
    zygote = load_backend("zygote")
    assert zygote.for_auto().wait is False  # type: ignore[attr-defined]
    assert zygote().wait is True  # type: ignore[attr-defined]
    assert type(BwrapBackend.for_auto()) is BwrapBackend
