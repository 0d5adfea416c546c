"""The operations audit trail (commands, terminals, process signals and stdin, file
changes and downloads) and the idle reaper's rule for background processes, against a
real ``sandlot serve`` running bwrap sandboxes: over sandlot's own routes, and over
E2B's wire with the unmodified ``e2b`` client (normal mode)."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _host import eventually, host_pids
from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

WAIT = 60.0


def _operations(server: ServerProcess, *args: str) -> list[dict[str, Any]]:
    out = server.cli("audit", "--operations", "--json", "--limit", "100000", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


def _client(server: ServerProcess, key: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=WAIT)


def _started_pid(client: httpx.Client, sandbox_id: str, body: dict[str, Any]) -> int:
    """Start a background process and detach at once (the client stops streaming)."""
    with client.stream("POST", f"/v1/sandboxes/{sandbox_id}/processes", json=body) as response:
        assert response.status_code == 200, response.read()
        first = json.loads(next(response.iter_lines()))
    assert first["type"] == "started", first
    return int(first["pid"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = ServerProcess(tmp_path_factory.mktemp("operations"), "--idle-ttl", "600").start()
    try:
        yield started
    finally:
        started.stop()


def test_sandlot_routes_record_commands_processes_and_file_changes(
    server: ServerProcess,
) -> None:
    key = server.key("ops-alice")
    key_id = key.split("_")[1]
    other = server.key("ops-bob")
    with _client(server, key) as client:
        sandbox_id = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
        base = f"/v1/sandboxes/{sandbox_id}"
        long_line = "true " + "x" * 10_000 + " # \x1b[2K"
        for cmd in ("echo hi; exit 3", long_line):
            with client.stream("POST", f"{base}/commands", json={"cmd": cmd}) as response:
                ends = [json.loads(line) for line in response.iter_lines()]
            assert ends[-1]["type"] == "end_of_command", ends
        sleeper = _started_pid(client, sandbox_id, {"cmd": "sleep 600"})
        reader = _started_pid(client, sandbox_id, {"cmd": "cat", "stdin": True})
        data = base64.b64encode(b"secret\n").decode()
        stdin = client.post(f"{base}/processes/{reader}/stdin", json={"data": data})
        assert stdin.status_code == 204, stdin.text
        terminal = _started_pid(client, sandbox_id, {"pty": {"rows": 24, "cols": 80}})
        for pid in (sleeper, reader, terminal):
            assert client.delete(f"{base}/processes/{pid}").json() == {"killed": True}
        written = client.post(f"{base}/files", params={"path": "a.txt"}, content=b"12345")
        assert written.status_code == 200, written.text
        assert client.get(f"{base}/files", params={"path": "a.txt"}).content == b"12345"
        assert client.post(f"{base}/files/mkdir", params={"path": "d"}).status_code == 200
        moved = client.post(f"{base}/files/rename", json={"old_path": "a.txt", "new_path": "d/b"})
        assert moved.status_code == 200, moved.text
        assert client.delete(f"{base}/files", params={"path": "d/b"}).status_code == 204
        # Reads that list or inspect are left out of the trail.
        assert client.get(f"{base}/files/list", params={"path": "."}).status_code == 200
        assert client.get(f"{base}/processes").status_code == 200

    rows = _operations(server, "--sandbox", sandbox_id)
    assert {row["tenant"] for row in rows} == {"ops-alice"}
    assert {row["key_id"] for row in rows} == {key_id}
    kinds = [row["kind"] for row in rows]
    assert kinds == [
        "command",
        "command",
        "process",
        "process",
        "stdin",
        "pty",
        "kill",
        "kill",
        "kill",
        "write",
        "download",
        "mkdir",
        "rename",
        "remove",
    ], kinds
    first, long_one = rows[0], rows[1]
    assert first["target"] == "echo hi; exit 3"
    assert (first["outcome"], first["exit_code"]) == ("ok", 3)
    assert first["finished_at"] >= first["started_at"]
    # Bounded and escaped as a cell's text is; its full size and digest are kept.
    assert len(long_one["target"]) <= 4096 and "\x1b" not in long_one["target"]
    assert long_one["target_bytes"] == len(long_line.encode())
    assert (long_one["outcome"], long_one["exit_code"]) == ("ok", 0)
    assert [(row["target"], row["outcome"]) for row in rows[2:4]] == [
        ("sleep 600", "started"),
        ("cat", "started"),
    ]
    assert [row["pid"] for row in rows[2:4]] == [sleeper, reader]
    assert (rows[4]["pid"], rows[4]["size"]) == (reader, 7)
    assert rows[5]["pid"] == terminal and rows[5]["outcome"] == "started"
    assert [row["pid"] for row in rows[6:9]] == [sleeper, reader, terminal]
    assert (rows[9]["target"], rows[9]["size"], rows[9]["outcome"]) == ("a.txt", 5, "ok")
    assert (rows[12]["target"], rows[12]["destination"]) == ("a.txt", "d/b")
    assert not _operations(server, "--tenant", "ops-bob")
    del other
    # The human-readable listing shows them, one escaped line each.
    listing = server.cli("audit", "--operations", "--sandbox", sandbox_id).stdout
    assert "echo hi; exit 3" in listing and "exit=3" in listing
    assert len(listing.splitlines()) == len(rows)


def test_a_failed_file_operation_is_recorded_as_an_error(server: ServerProcess) -> None:
    key = server.key("ops-carol")
    with _client(server, key) as client:
        sandbox_id = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
        gone = client.delete(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "nope"})
        assert gone.status_code == 404, gone.text
    (row,) = _operations(server, "--sandbox", sandbox_id)
    assert (row["kind"], row["target"], row["outcome"]) == ("remove", "nope", "error")
    assert row["error_name"] == "NotFoundError"


def test_e2b_wire_commands_and_files_are_recorded(server: ServerProcess) -> None:
    from e2b import CommandExitException, Sandbox

    key = server.key("ops-e2b")
    sbx = Sandbox.create(timeout=120, **server.e2b_opts(key))
    try:
        result = sbx.commands.run("echo from-e2b", timeout=30)
        assert result.stdout.strip() == "from-e2b"
        handle = sbx.commands.run("sleep 600", background=True)
        assert sbx.commands.kill(handle.pid)
        with pytest.raises(CommandExitException):
            handle.wait()  # the end the server sent, after recording it
        sbx.files.write("/home/user/w.txt", "abc")
        assert sbx.files.read("/home/user/w.txt") == "abc"
        assert sbx.files.make_dir("/home/user/dir")
        sbx.files.rename("/home/user/w.txt", "/home/user/dir/w.txt")
        sbx.files.remove("/home/user/dir/w.txt")
        assert sbx.files.list("/home/user")
        # Signed URLs (no headers): recorded under the key that created the sandbox.
        signed = httpx.post(sbx.upload_url("signed.txt"), files={"file": ("x", b"signed")})
        assert signed.status_code == 200, signed.text
        assert httpx.get(sbx.download_url("signed.txt")).content == b"signed"
        rows = _operations(server, "--sandbox", sbx.sandbox_id)
    finally:
        sbx.kill()
    assert {row["tenant"] for row in rows} == {"ops-e2b"}
    summary = [(row["kind"], row["target"], row["outcome"], row["exit_code"]) for row in rows]
    assert summary[:3] == [
        # envd makes every command a process; the exit code is there when the client
        # read it to the end, as the SDK's foreground run does.
        ("process", "/bin/bash -l -c 'echo from-e2b'", "ok", 0),
        # Started in the background; the SDK's handle streamed it to its end.
        ("process", "/bin/bash -l -c 'sleep 600'", "ok", -9),
        ("kill", None, "ok", None),
    ], summary
    assert rows[1]["pid"] == handle.pid == rows[2]["pid"]
    assert [(kind, target) for kind, target, _, _ in summary[3:]] == [
        ("write", "/home/user/w.txt"),
        ("download", "/home/user/w.txt"),
        ("mkdir", "/home/user/dir"),
        ("rename", "/home/user/w.txt"),
        ("remove", "/home/user/dir/w.txt"),
        ("write", "signed.txt"),
        ("download", "signed.txt"),
    ], summary
    assert {row["key_id"] for row in rows} == {key.split("_")[1]}
    assert rows[6]["destination"] == "/home/user/dir/w.txt"


def test_a_background_process_keeps_its_sandbox_from_the_idle_reaper(tmp_path: Path) -> None:
    """Idle TTL 2 s, a detached ``sleep 6``: the sandbox lives while it runs (no
    client streams it, nothing else touches the sandbox), and is reaped once it ends."""
    server = ServerProcess(tmp_path / "state", "--idle-ttl", "2").start()
    try:
        with _client(server, server.key("ops-idle")) as client:
            sandbox_id = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
            started = time.monotonic()
            _started_pid(client, sandbox_id, {"cmd": "sleep 6"})
            # Reading a sandbox's info does not lease it: it keeps nothing alive.
            while time.monotonic() - started < 5:
                info = client.get(f"/v1/sandboxes/{sandbox_id}")
                assert info.status_code == 200, (time.monotonic() - started, info.text)
                time.sleep(0.2)
            eventually(
                lambda: client.get(f"/v1/sandboxes/{sandbox_id}").status_code == 404,
                "the sandbox to be reaped once its background process ended",
            )
            assert time.monotonic() - started >= 6
    finally:
        server.stop()


def test_a_sandbox_with_a_background_process_still_expires(tmp_path: Path) -> None:
    """The absolute timeout is not extended by a running process."""
    server = ServerProcess(tmp_path / "state", "--idle-ttl", "2").start()
    try:
        with _client(server, server.key("ops-expiry")) as client:
            sandbox_id = client.post("/v1/sandboxes", json={"timeout": 3}).json()["sandbox_id"]
            _started_pid(client, sandbox_id, {"cmd": "sleep 600"})
            eventually(
                lambda: client.get(f"/v1/sandboxes/{sandbox_id}").status_code == 404,
                "the sandbox to expire under its running process",
            )
    finally:
        server.stop()


def test_a_sandbox_that_does_not_answer_cannot_stall_the_reaper(tmp_path: Path) -> None:
    """The reaper asks idle sandboxes whether a process runs: one whose runner was
    stopped (SIGSTOP, so it never answers) counts as idle after a short wait, and the
    other tenants' idle sandboxes are reaped on time, not after its 60 s request
    timeout."""
    server = ServerProcess(tmp_path / "state", "--idle-ttl", "2").start()
    try:
        with _client(server, server.key("ops-frozen")) as client:
            frozen = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
            marker = f"sleep {int(time.monotonic() * 1000) % 1_000_000 + 2_000_000}"
            pid = _started_pid(client, frozen, {"cmd": marker})
            assert pid
            eventually(lambda: bool(host_pids(marker)), "the marker process on the host")
            (sleeper,) = host_pids(marker)
            with open(f"/proc/{sleeper}/stat") as handle:
                runner = int(handle.read().rsplit(")", 1)[1].split()[1])
            os.kill(runner, signal.SIGSTOP)
            other = client.post("/v1/sandboxes", json={"timeout": 600}).json()["sandbox_id"]
            created = time.monotonic()
            eventually(
                lambda: client.get(f"/v1/sandboxes/{other}").status_code == 404,
                "the other idle sandbox to be reaped",
            )
            assert time.monotonic() - created < 20
            eventually(
                lambda: client.get(f"/v1/sandboxes/{frozen}").status_code == 404,
                "the silent sandbox to be reaped as idle",
            )
    finally:
        server.stop()
