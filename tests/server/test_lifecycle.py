"""Server lifecycle against real ``sandlot serve`` processes: SIGKILL and restart,
graceful shutdown, idle reaping, and a bounded load test."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _host import eventually as _eventually
from _host import host_pids as _processes_with
from _server_harness import ServerProcess
from sandlot import Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

WAIT = 120.0
"""Seconds to wait for anything asynchronous; generous, the machine is shared."""


def _client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT
    )


def _audit(server: ServerProcess, *args: str) -> list[dict[str, Any]]:
    out = server.cli("audit", "--json", "--limit", "100000", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


class Cell(threading.Thread):
    """Streams one cell in the background; ``started`` is set at its first message."""

    def __init__(self, client: httpx.Client, sandbox_id: str, code: str) -> None:
        super().__init__(daemon=True)
        self.client, self.sandbox_id, self.code = client, sandbox_id, code
        self.started = threading.Event()
        self.messages: list[dict[str, Any]] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with self.client.stream(
                "POST",
                f"/v1/sandboxes/{self.sandbox_id}/execute",
                json={"code": self.code, "timeout": 900},
            ) as response:
                for line in response.iter_lines():
                    self.messages.append(json.loads(line))
                    self.started.set()
        except BaseException as exc:  # the server was killed under it
            self.failure = exc
        finally:
            self.started.set()


def _sleeper(marker: str, seconds: int = 600) -> str:
    """Cell code: a child process with ``marker`` in its argv, then a long wait."""
    return (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({seconds})',"
        f" {marker!r}])\n"
        "print('started', flush=True)\n"
        f"time.sleep({seconds})\n"
    )


def test_sigkill_mid_cell_then_restart_leaves_nothing_and_keeps_the_audit(
    tmp_path: Path,
) -> None:
    server = ServerProcess(tmp_path / "state").start()
    try:
        _crash_and_restart(server)
    finally:
        server.stop()


def _crash_and_restart(server: ServerProcess) -> None:
    key = server.key("crash")
    marker = f"sandlot-crash-{uuid.uuid4().hex}"
    with _client(server, key) as client:
        sandbox_id = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
        done = client.post(f"/v1/sandboxes/{sandbox_id}/execute", json={"code": "'before'"})
        assert "'before'" in done.text
        cell = Cell(client, sandbox_id, _sleeper(marker))
        cell.start()
        assert cell.started.wait(WAIT) and cell.messages, cell.failure
        assert _processes_with(marker), "the cell's child process is not running"
        assert server.process is not None
        server_pid = server.process.pid
        assert _cgroups_of(server_pid) is None or _cgroups_of(server_pid), "no sandbox cgroup"
        server.stop(signal.SIGKILL)
        cell.join(WAIT)
    # bwrap dies with the server (--die-with-parent), and the kernel then kills the
    # whole sandbox: nothing of it may survive.
    _eventually(lambda: not _processes_with(marker), "the sandbox's processes to die")
    assert not os.path.exists(f"/proc/{server_pid}")

    # What the dead server left in its upload spool goes; what it did not put there
    # (a directory, another program's file) stays, and does not stop the start.
    spool = server.state_dir / "spool"
    (spool / "upload-abc123").write_bytes(b"half an upload")
    (spool / "a-directory").mkdir()
    (spool / "notes.txt").write_text("an operator's file")
    server.start()  # same state directory: recovery runs
    assert "recovered from an unclean shutdown" in server.log()
    assert sorted(p.name for p in spool.iterdir()) == ["a-directory", "notes.txt"]
    # The dead server's cgroups are gone (swept by the restarted server, or by any
    # other sandlot process that started first: either way, nothing is left).
    assert not _cgroups_of(server_pid)
    rows = _audit(server, "--sandbox", sandbox_id)
    assert [row["outcome"] for row in rows] == ["ok", "killed"]
    assert rows[0]["code"] == "'before'" and rows[1]["status"] == "died"
    assert marker in (rows[1]["code"] or "")
    with _client(server, key) as client:
        assert client.get(f"/v1/sandboxes/{sandbox_id}").status_code == 404
        assert client.get("/v1/sandboxes").json() == []
        fresh = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
        answer = client.post(f"/v1/sandboxes/{fresh}/execute", json={"code": "6 * 7"})
        assert '"text": "42"' in answer.text
    assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal when done
    assert "shutdown: 0 running cell(s) finished, 0 interrupted" in server.log()


def test_graceful_shutdown_finishes_short_cells_and_interrupts_long_ones(
    tmp_path: Path,
) -> None:
    server = ServerProcess(tmp_path / "state", "--shutdown-grace", "10").start()
    try:
        _shut_down_gracefully(server)
    finally:
        server.stop()


def _shut_down_gracefully(server: ServerProcess) -> None:
    key = server.key("graceful")
    marker = f"sandlot-graceful-{uuid.uuid4().hex}"
    with _client(server, key) as client:
        sandbox_id = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
        context = client.post(f"/v1/sandboxes/{sandbox_id}/contexts", json={}).json()["id"]
        long_cell = Cell(client, sandbox_id, _sleeper(marker))
        short_code = "import time\nprint('started', flush=True)\ntime.sleep(2)\n'done'"
        long_cell.start()
        assert long_cell.started.wait(WAIT)
        short = client.build_request(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/execute",
            # Its own context, so it runs while the long cell does.
            json={"code": short_code, "context_id": context, "timeout": 900},
        )
        short_response = client.send(short, stream=True)
        lines = short_response.iter_lines()
        first = next(lines)
        assert json.loads(first)["text"] == "started\n"
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in lines]
        short_response.close()
        long_cell.join(WAIT)
    assert rest[-1]["type"] == "end_of_execution" and rest[-1]["status"] == "ok", rest
    assert any(m.get("text") == "'done'" for m in rest)
    assert long_cell.messages[-1]["type"] == "end_of_execution", long_cell.messages
    assert long_cell.messages[-1]["status"] == "interrupted"
    assert server.stop() in (0, -signal.SIGTERM)
    assert "shutdown: 1 running cell(s) finished, 1 interrupted" in server.log()
    _eventually(lambda: not _processes_with(marker), "the sandbox's processes to die")
    outcomes = sorted(row["outcome"] for row in _audit(server, "--sandbox", sandbox_id))
    assert outcomes == ["killed", "ok"]


def test_idle_sandboxes_are_reaped(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "state", "--idle-ttl", "2").start()
    try:
        key = server.key("idle")
        with _client(server, key) as client:
            sandbox_id = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
            _eventually(
                lambda: client.get(f"/v1/sandboxes/{sandbox_id}").status_code == 404,
                "the idle sandbox to be reaped",
            )
            metrics = client.get("/metrics").text
        assert 'sandlot_sandboxes_ended_total{reason="reaped"} 1.0' in metrics
        assert "sandlot_sandboxes_live 0.0" in metrics
    finally:
        server.stop()


def test_a_sandbox_in_use_is_never_reaped_from_under_its_request(tmp_path: Path) -> None:
    """A client uploading slowly, for several idle TTLs, gets its file written; the reaper
    takes the sandbox only once the request is over (and then does)."""
    server = ServerProcess(tmp_path / "state", "--idle-ttl", "1").start()
    try:
        key = server.key("slow-writer")
        with _client(server, key) as client:
            sandbox_id = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
            started = time.monotonic()

            def slowly() -> Iterator[bytes]:
                while time.monotonic() - started < 4:
                    yield b"x" * 1024
                    time.sleep(0.1)

            written = client.post(
                f"/v1/sandboxes/{sandbox_id}/files", params={"path": "slow.txt"}, content=slowly()
            )
            assert written.status_code == 200, written.text
            read = client.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "slow.txt"})
            assert read.status_code == 200 and set(read.content) == {ord("x")}
            _eventually(
                lambda: client.get(f"/v1/sandboxes/{sandbox_id}").status_code == 404,
                "the sandbox to be reaped once it was left idle",
            )
    finally:
        server.stop()


@pytest.mark.slow
def test_load_twenty_clients_for_a_minute_lose_nothing_and_leave_nothing(
    tmp_path: Path,
) -> None:
    """20 concurrent SDK clients (remote mode) run cells for 60 s on one server."""
    clients, seconds = 20, 60.0
    server = ServerProcess(
        tmp_path / "state", "--max-sandboxes", "40", "--max-memory-mb", "40000"
    ).start()
    try:
        key = server.key("load")
        stop_at = time.monotonic() + seconds
        counts = [0] * clients
        failures: list[str] = []
        sandbox_ids: list[str] = []

        def client(index: int) -> None:
            try:
                with Sandbox(
                    api_url=server.url, api_key=key, resources={"memory_mb": 512}, timeout=600
                ) as sbx:
                    sandbox_ids.append(sbx.sandbox_id)
                    sbx.run_code("total = 0")
                    n = 0
                    while time.monotonic() < stop_at:
                        n += 1
                        execution = sbx.run_code(
                            f"total += {n}\nprint('client {index} cell {n}')\n(total, {n})",
                            timeout=120,
                        )
                        expected = (n * (n + 1) // 2, n)
                        if (
                            execution.error is not None
                            or execution.text != repr(expected)
                            or execution.logs.stdout != [f"client {index} cell {n}\n"]
                        ):
                            failures.append(f"client {index} cell {n}: {execution}")
                            return
                        counts[index] = n
            except Exception as exc:
                failures.append(f"client {index}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + WAIT * 3)
        assert not failures, failures[:5]
        assert all(count > 0 for count in counts), counts
        total = sum(counts)
        print(f"load: {clients} clients, {total} cells in {seconds:g} s, per client {counts}")
        rows = _audit(server, "--tenant", "load")
        # Every cell the clients saw is in the audit trail, and nothing else is running.
        assert len(rows) == total + clients  # + one "total = 0" per client
        assert {row["outcome"] for row in rows} == {"ok"}
        with _client(server, key) as api:
            assert api.get("/v1/sandboxes").json() == []
            metrics = api.get("/metrics").text
        assert "sandlot_sandboxes_live 0.0" in metrics
        assert f'sandlot_executions_total{{outcome="ok"}} {float(total + clients)}' in metrics
    finally:
        assert server.process is not None
        server_pid = server.process.pid
        server.stop()
    _eventually(lambda: not _bwrap_children(server_pid), "no sandbox process to remain")


def _cgroups_of(pid: int) -> list[Path] | None:
    """The sandbox cgroups a sandlot process ``pid`` created (None: no cgroups here)."""
    from sandlot._exceptions import IsolationUnavailable
    from sandlot.backends import _cgroups

    try:
        host = _cgroups.host()
    except IsolationUnavailable:
        return None
    found: list[Path] = []
    for base in host.bases.values():
        if base.is_dir():
            found.extend(p for p in base.iterdir() if p.name.startswith(f"{pid}."))
    return found


def _bwrap_children(parent: int) -> list[int]:
    children = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if int(fields[1]) == parent:
            children.append(int(name))
    return children
