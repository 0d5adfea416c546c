"""What backends do for the CLI and the server besides starting sandboxes, against the
real thing: a recovery token destroys its sandbox from another process (what a restarted
server does after a crash), a stale or malformed token destroys nothing, and the
start-up cleanup of every declared backend runs on a host without Docker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import Sandbox
from sandlot.backends import RecoveryToken, reap

REAP = (
    "import json, sys\n"
    "from sandlot.backends import reap\n"
    "print(json.dumps(reap(sys.argv[1], json.loads(sys.argv[2]))))\n"
)
WAIT = 60.0


def _reap_elsewhere(backend: str, token: RecoveryToken) -> bool:
    """``sandlot.backends.reap`` in another process, as a restarted server calls it."""
    done = subprocess.run(
        [sys.executable, "-c", REAP, backend, json.dumps(token)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return bool(json.loads(done.stdout))


def _with_marker(name: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if name.encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture(params=["bwrap", "zygote"])
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    sbx = Sandbox(backend=request.param, timeout=None)
    try:
        yield sbx
    finally:
        sbx.kill()


def _token(sbx: Sandbox) -> RecoveryToken:
    handle = sbx._core._handle
    assert handle is not None
    token = handle.recovery_token()
    assert token is not None
    assert json.loads(json.dumps(token)) == token  # storable as JSON, as the server does
    return token


@pytest.mark.requires_bwrap
@pytest.mark.requires_template
def test_a_recovery_token_destroys_its_sandbox_from_another_process(sandbox: Sandbox) -> None:
    marker = f"sandlot-reap-{uuid.uuid4().hex}"
    started = sandbox.commands.run(
        f"python -c 'import time; time.sleep(600)' {marker} >/dev/null 2>&1 &"
    )
    assert started.exit_code == 0
    assert _with_marker(marker), "the sandbox's process is not running"
    backend = sandbox._core.backend.name
    assert _reap_elsewhere(backend, _token(sandbox)) is True
    deadline = time.monotonic() + WAIT
    while _with_marker(marker):  # the whole sandbox goes, not only its first process
        assert time.monotonic() < deadline, "the sandbox survived its reaping"
        time.sleep(0.1)


@pytest.mark.requires_bwrap
@pytest.mark.requires_template
def test_a_stale_or_malformed_token_destroys_nothing(sandbox: Sandbox) -> None:
    token = _token(sandbox)
    backend = sandbox._core.backend.name
    stale = {**token, "start": str(int(token["start"]) + 1)}  # same pid, another process
    assert _reap_elsewhere(backend, stale) is False
    for bad in (
        {},
        {"pid": str(token["pid"]), "start": token["start"]},
        {"pid": True, "start": token["start"]},
        {"pid": 1, "start": "0"},
        {"pid": token["pid"]},
    ):
        assert reap(backend, bad) is False, bad
    assert reap("no-such-backend", token) is False  # an unknown name: logged, no error
    assert sandbox.run_code("6 * 7").text == "42"  # untouched


def test_start_up_cleanup_runs_on_a_host_without_docker(tmp_path: Path) -> None:
    # No engine answers, and the engines' client library is missing altogether.
    shadow = tmp_path / "docker"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('docker is not installed here')\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",
        "SANDLOT_PODMAN_HOST": "unix:///nonexistent/podman.sock",
    }
    code = (
        "import json\n"
        "from sandlot.backends import backend_names, check_all, cleanup_orphans\n"
        "names = backend_names()\n"
        "findings = [f.as_dict() for f in check_all()]\n"
        "print(json.dumps({'names': names, 'removed': cleanup_orphans(), 'checks': findings}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert {"docker", "podman"} <= set(outcome["names"])  # declared, so they were asked
    assert "docker" not in outcome["removed"] and "podman" not in outcome["removed"]
    assert all(check["status"] in ("ok", "missing", "warn", "info") for check in outcome["checks"])
