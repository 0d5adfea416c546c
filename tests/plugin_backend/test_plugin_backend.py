"""A backend is added by declaring it: no edit anywhere in sandlot.

The backend lives in this folder only (``sandlot_plugin_test``, test-only: it wraps
bwrap). Each test declares it the way ``pip install`` of a package would, with a
throwaway ``.dist-info`` whose ``entry_points.txt`` names it in the
``sandlot.backends`` group, on the ``PYTHONPATH`` of real sandlot processes, and checks
what a user and an operator see: ``sandlot doctor``, ``sandlot run --backend``,
``Sandbox(backend=...)``, and ``sandlot serve``'s start-up cleanup and crash recovery.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.backends.host import process_start_time

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sandlot_plugin_test import ENTRY_POINT, NAME, STATE_ENV  # noqa: E402

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]


def _declare(tmp_path: Path) -> dict[str, str]:
    """The environment of a process in which the plug-in is installed (declared)."""
    site = tmp_path / "site"
    dist = site / "sandlot_plugin_test-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sandlot-plugin-test\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(f"[sandlot.backends]\n{ENTRY_POINT}\n")
    state = tmp_path / "state"
    state.mkdir()
    path = [str(site), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), STATE_ENV: str(state)}


def _sandlot(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandlot", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _lines(env: dict[str, str], kind: str) -> list[Any]:
    path = Path(env[STATE_ENV]) / f"{kind}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _leases(env: dict[str, str]) -> list[str]:
    directory = Path(env[STATE_ENV]) / "leases"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_sandlot_doctor_shows_a_declared_backend(tmp_path: Path) -> None:
    env = _declare(tmp_path)
    report = json.loads(_sandlot(env, "doctor", "--json").stdout)
    checks = {check["name"].strip(): check for check in report["checks"]}
    assert checks[f"backend {NAME}"]["status"] == "ok", checks[f"backend {NAME}"]
    assert checks[f"{NAME}: wraps"]["detail"] == "bwrap"  # its probe's details
    assert checks["plugin-test state"]["status"] == "ok"  # its checks()
    assert NAME in report["backends_available"]
    assert report["backends_available"][0] == "bwrap"  # "auto" still picks the strongest
    assert report["auto"] == "zygote"  # (through its fast path)
    # Control: the same command without the declaration knows nothing of it.
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if "PYTHONPATH" in os.environ:
        plain["PYTHONPATH"] = os.environ["PYTHONPATH"]
    report = json.loads(_sandlot(plain, "doctor", "--json").stdout)
    assert f"backend {NAME}" not in {check["name"] for check in report["checks"]}


def test_sandlot_run_uses_it_by_name(tmp_path: Path) -> None:
    env = _declare(tmp_path)
    # This folder is on the host, outside anything a sandbox mounts.
    code = f"import os\nprint(os.path.exists({str(HERE)!r}))\n6 * 7"
    result = _sandlot(env, "run", "--backend", NAME, "--json", "-c", code)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["stdout"] == "False\n"  # a sandbox: the host's files are not there
    assert outcome["results"][0]["text"] == "42"
    assert len(_lines(env, "started")) == 1  # started by the plug-in...
    assert _leases(env) == []  # ...and its lease released when the sandbox ended
    unknown = _sandlot(env, "run", "--backend", "no-such-backend", "-c", "1")
    assert unknown.returncode == 2 and NAME in unknown.stderr  # listed among the choices


def test_the_sdk_uses_it_by_name(tmp_path: Path) -> None:
    env = _declare(tmp_path)
    script = textwrap.dedent(
        f"""
        import json
        import sandlot
        from sandlot.backends import get_backend
        with sandlot.Sandbox(backend={NAME!r}, timeout=None) as sbx:
            text = sbx.run_code("6 * 7").text
            lease = sbx._core._handle.recovery_token()["lease"]
        print(json.dumps({{"text": text, "lease": lease, "auto": get_backend("auto").name}}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["text"] == "42"
    assert _lines(env, "started") == [outcome["lease"]]
    assert outcome["auto"] == "zygote"  # bubblewrap through its fast path, not the plug-in
    assert _leases(env) == []


@pytest.mark.requires_server
def test_sandlot_serve_cleans_up_after_it_at_start(tmp_path: Path) -> None:
    from _server_harness import ServerProcess

    env = _declare(tmp_path)
    leases = Path(env[STATE_ENV]) / "leases"
    leases.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = leases / f"{gone.pid}.1.orphan"  # its owner is dead
    live = leases / f"{os.getpid()}.{process_start_time(os.getpid())}.live"  # ours: alive
    orphan.touch()
    live.touch()
    server = ServerProcess(tmp_path / "server", env=env).start()
    try:
        assert not orphan.exists() and live.exists()
        assert _lines(env, "cleanups") == [[f"lease {orphan.name}"]]
        assert f"'{NAME}': 1" in server.log()  # in the recovery report
    finally:
        server.stop()


@pytest.mark.requires_server
def test_a_restarted_server_hands_the_recovery_token_back_to_it(tmp_path: Path) -> None:
    from _server_harness import ServerProcess

    env = _declare(tmp_path)
    # No warm pool: the test follows the one sandbox it creates through a restart.
    server = ServerProcess(
        tmp_path / "server", "--backend", NAME, "--pool-size", "0", env=env
    ).start()
    try:
        key = server.key("plugin")
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as client:
            sandbox_id = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
            answer = client.post(f"/v1/sandboxes/{sandbox_id}/execute", json={"code": "6 * 7"})
            assert '"text": "42"' in answer.text
        [lease] = _lines(env, "started")
        assert _leases(env) == [lease]
        server.stop(signal.SIGKILL)  # a crash: nothing is cleaned up
        assert _leases(env) == [lease]
        server.start()  # same state directory: recovery runs
        [token] = _lines(env, "reaped")
        assert token["lease"] == lease  # the token stored for that sandbox, given back
        inner = token["inner"]
        assert isinstance(inner, dict) and isinstance(inner["pid"], int), token
        assert _leases(env) == []  # and the dead server's lease was cleaned up
        assert "recovered from an unclean shutdown" in server.log()
    finally:
        server.stop()
