"""The cell WebSocket (``/v1/sandboxes/{id}/cells``) against a real ``sandlot serve``.

The remote SDK sends a sandbox's cells over one WebSocket: what it returns, streams,
audits and refuses must be what the HTTP route does. And the socket is attacked as the
HTTP route is: another tenant's sandbox, a key revoked while the connection is open,
frames over the body limit, garbage frames and broken framing, a message mid-cell, a
client that reads nothing. Plus the fallback to HTTP on a server without the socket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wsproto")

import wsproto.events as ws

import sandlot
from _server_harness import ServerProcess
from sandlot import AsyncSandbox, Sandbox
from sandlot._remote import CellSocket, NoCellSocket
from sandlot.policy import MiB

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

MAX_BODY = 8 * MiB  # ServerSettings.max_body_bytes' default


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("cells"), "--idle-ttl", "600", "--client-stall-timeout", "5"
    ).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def alice(server: ServerProcess) -> str:
    return server.key("alice")


@pytest.fixture
def sbx(server: ServerProcess, alice: str) -> Iterator[Sandbox]:
    with Sandbox(api_url=server.url, api_key=alice) as sandbox:
        yield sandbox


def _audit(server: ServerProcess, sandbox_id: str) -> list[dict[str, Any]]:
    out = server.cli("audit", "--sandbox", sandbox_id, "--json").stdout
    return [json.loads(line) for line in out.splitlines()]


def _on_socket(sandbox: Sandbox) -> CellSocket | None:
    return sandbox._core._socket  # type: ignore[attr-defined, no-any-return]


def _raw(sock: CellSocket, event: ws.Event) -> None:
    """Send any frame, bypassing what CellSocket.cell would send."""
    sock._sock.sendall(sock._ws.send(event))


def _replies(sock: CellSocket, timeout: float = 60) -> list[dict[str, Any]]:
    """The server's messages until one ends the exchange (a refusal, the end of a cell)
    or the server closes the connection (then a last ``{"type": "closed"}``)."""
    sock._sock.settimeout(timeout)
    got: list[dict[str, Any]] = []
    parts: list[str] = []
    for event in sock._events():
        if isinstance(event, ws.TextMessage):
            parts.append(event.data)
            if not event.message_finished:
                continue
            got.extend(json.loads(line) for line in "".join(parts).splitlines())
            parts.clear()
            if got and got[-1]["type"] in ("refused", "end_of_execution"):
                return got
        elif isinstance(event, ws.CloseConnection):
            return [*got, {"type": "closed", "code": event.code}]
    raise AssertionError("unreachable")


def _connect(server: ServerProcess, key: str, sandbox_id: str) -> CellSocket:
    return CellSocket.connect(server.url, key, sandbox_id)


# --- the remote SDK over the socket ----------------------------------------------------


def test_cells_go_over_one_socket_with_the_http_routes_results_and_audit(
    server: ServerProcess, sbx: Sandbox
) -> None:
    assert sbx.run_code("0").text == "0"
    # The first cell went over HTTP, on the connection the create left open.
    assert _on_socket(sbx) is None
    out: list[str] = []
    results: list[Any] = []
    first = sbx.run_code(
        "print('a', flush=True)\nimport sys; print('b', file=sys.stderr)\n6 * 7",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: out.append("err:" + m.line),
        on_result=results.append,
    )
    sock = _on_socket(sbx)
    assert sock is not None, "the second cell did not open the socket"
    assert first.text == "42" and first.logs.stdout == ["a\n"] and first.logs.stderr == ["b\n"]
    assert out == ["a\n", "err:b\n"] and [r.text for r in results] == ["42"]
    assert first.status == "ok" and first.execution_count == 2 and first.usage is not None
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert failed.status == "error"
    assert _on_socket(sbx) is sock  # the same connection, cell after cell
    rows = _audit(server, sbx.sandbox_id)
    assert [row["outcome"] for row in rows] == ["ok", "ok", "error"]
    assert rows[1]["stdout_bytes"] == 2 and rows[1]["stderr_bytes"] == 2
    assert rows[1]["result_count"] == 1


def test_a_cells_audit_row_is_written_before_its_output_returns(
    server: ServerProcess, sbx: Sandbox
) -> None:
    for n in range(3):
        sbx.run_code(f"{n}")
        rows = _audit(server, sbx.sandbox_id)
        assert len(rows) == n + 1 and rows[-1]["outcome"] == "ok", rows


def test_a_cell_timeout_and_a_kill_under_a_cell_are_as_over_http(
    server: ServerProcess, alice: str
) -> None:
    with Sandbox(api_url=server.url, api_key=alice) as sbx:
        sbx.run_code("0")  # the first cell goes over HTTP
        slow = sbx.run_code("import time; time.sleep(30)", timeout=1)
        assert _on_socket(sbx) is not None  # the timeout came as an answer, over the socket
        assert slow.status == "timeout" and slow.error is not None
        assert sbx.run_code("'after'").text == "'after'"
        assert _on_socket(sbx) is not None
        started = threading.Event()
        outcome: list[BaseException | sandlot.Execution] = []

        def run() -> None:
            try:
                outcome.append(
                    sbx.run_code(
                        "import time\nprint('in', flush=True)\ntime.sleep(60)",
                        on_stdout=lambda m: started.set(),
                        timeout=120,
                    )
                )
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(60)
        sbx.kill()
        thread.join(60)
        assert not thread.is_alive()
    # Over HTTP, a sandbox killed under its cell ends the cell typed (the server's
    # end_of_execution names the exception) or as a lost sandbox: the same here.
    (result,) = outcome
    if isinstance(result, BaseException):
        assert isinstance(result, sandlot.SandboxClosed | sandlot.SandboxLost), result
    else:
        assert result.status == "died", result


def test_a_client_that_disconnects_mid_cell_interrupts_it(
    server: ServerProcess, alice: str, sbx: Sandbox
) -> None:
    sbx.run_code("1")
    with contextlib.closing(_connect(server, alice, sbx.sandbox_id)) as sock:
        stream = sock.cell(
            {"code": "import time\nprint('started', flush=True)\ntime.sleep(600)"}, 60
        )
        assert next(stream)["text"] == "started\n"
        sock._sock.close()  # gone, mid-cell, without a close frame
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = _audit(server, sbx.sandbox_id)
            if rows[-1]["outcome"] != "running":
                break
            time.sleep(0.3)
        assert rows[-1]["outcome"] == "killed" and rows[-1]["status"] == "interrupted", rows[-1]
        assert sbx.run_code("'free'").text == "'free'"


def test_the_async_twin_streams_over_the_socket(server: ServerProcess, alice: str) -> None:
    async def scenario() -> None:
        seen: list[str] = []

        async def on_stdout(message: sandlot.OutputMessage) -> None:
            seen.append(message.line)

        async with await AsyncSandbox.create(api_url=server.url, api_key=alice) as sbx:
            for n in range(3):
                execution = await sbx.run_code(f"print({n}); {n} * 2", on_stdout=on_stdout)
                assert execution.text == str(n * 2)
            assert seen == ["0\n", "1\n", "2\n"]

    asyncio.run(scenario())


def test_an_idle_socket_is_replaced_not_reused(
    server: ServerProcess, sbx: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbx.run_code("0")
    sbx.run_code("1")
    first = _on_socket(sbx)
    assert first is not None
    monkeypatch.setattr(first, "used", time.monotonic() - 3600)
    assert sbx.run_code("2").text == "2"
    assert _on_socket(sbx) is not first and first.closed


# --- attacks -------------------------------------------------------------------------


def test_another_tenants_sandbox_is_refused_at_the_handshake(
    server: ServerProcess, sbx: Sandbox
) -> None:
    sbx.run_code("1")
    mallory = server.key("mallory")
    with pytest.raises(sandlot.SandboxClosed, match="not found"):
        _connect(server, mallory, sbx.sandbox_id)
    with pytest.raises(sandlot.AuthenticationError):
        _connect(server, "sl_0000000000000000_forged", sbx.sandbox_id)
    assert [row["tenant"] for row in _audit(server, sbx.sandbox_id)] == ["alice"]


def _handshake_status(
    server: ServerProcess, sandbox_id: str, headers: list[tuple[bytes, bytes]]
) -> int:
    """The HTTP status a raw upgrade with these headers gets (101: accepted)."""
    import wsproto

    url = server.url.removeprefix("http://")
    host, _, port = url.partition(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        client = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        conn.sendall(
            client.send(
                ws.Request(
                    host=url, target=f"/v1/sandboxes/{sandbox_id}/cells", extra_headers=headers
                )
            )
        )
        conn.settimeout(10)
        head = b""
        while b"\r\n" not in head:
            chunk = conn.recv(4096)
            assert chunk, "the server closed without answering the upgrade"
            head += chunk
    return int(head.split(b" ", 2)[1])


def test_a_page_of_another_origin_cannot_open_a_cell_socket(
    server: ServerProcess, alice: str, sbx: Sandbox
) -> None:
    # A browser attaches credentials it holds for the server (Basic auth, say) to a
    # WebSocket handshake any page starts, and says which page in Origin.
    basic = base64.b64encode(f"sandlot:{alice}".encode())
    creds = [(b"authorization", b"Basic " + basic)]
    sbx.run_code("1")
    assert _handshake_status(server, sbx.sandbox_id, creds) == 101
    url = server.url.removeprefix("http://")
    assert (
        _handshake_status(server, sbx.sandbox_id, [*creds, (b"origin", f"http://{url}".encode())])
        == 101
    )
    assert (
        _handshake_status(server, sbx.sandbox_id, [*creds, (b"origin", b"https://evil.example")])
        == 403
    )
    assert [row["code_bytes"] for row in _audit(server, sbx.sandbox_id)] == [1]


def test_a_key_revoked_mid_connection_is_refused_from_the_next_cell(
    server: ServerProcess, sbx: Sandbox
) -> None:
    key = server.key("alice")  # alice's too: her sandbox, a second key
    with contextlib.closing(_connect(server, key, sbx.sandbox_id)) as sock:
        assert [m["type"] for m in sock.cell({"code": "1"}, 60)][-1] == "end_of_execution"
        server.cli("keys", "revoke", key.split("_")[1])
        with pytest.raises(sandlot.AuthenticationError, match="revoked"):
            list(sock.cell({"code": "'ran anyway'"}, 60))
        assert _replies(sock)[-1] == {"type": "closed", "code": 1008}
        assert all(row["code_bytes"] == 1 for row in _audit(server, sbx.sandbox_id))


def test_a_frame_over_the_body_limit_is_refused_typed(
    server: ServerProcess, alice: str, sbx: Sandbox
) -> None:
    sbx.run_code("1")
    with contextlib.closing(_connect(server, alice, sbx.sandbox_id)) as sock:
        # Just over the limit: the server's own 413, and the connection stays usable.
        with pytest.raises(sandlot.InvalidArgumentError, match="larger than this server accepts"):
            list(sock.cell({"code": "#" * MAX_BODY}, 60))
        assert [m["type"] for m in sock.cell({"code": "2"}, 60)][-1] == "end_of_execution"
        # Far over it: cut off by the ASGI server before it is buffered whole.
        with pytest.raises(OSError):
            list(sock.cell({"code": "#" * (4 * MAX_BODY)}, 60))
            _replies(sock)
    # The SDK then sends that cell over HTTP, never run (it cannot have been): the
    # HTTP route's typed 413.
    with pytest.raises(sandlot.InvalidArgumentError, match="larger than this server accepts"):
        sbx.run_code("#" * (4 * MAX_BODY))
    assert len(_audit(server, sbx.sandbox_id)) == 2
    assert sbx.run_code("3").text == "3"


GARBAGE: list[tuple[ws.Event, int, str]] = [
    (ws.BytesMessage(b"\x00\xff" * 10), 400, "InvalidArgumentError"),
    (ws.TextMessage("not json"), 422, "ValidationError"),
    (ws.TextMessage("[1, 2]"), 400, "InvalidArgumentError"),
    (ws.TextMessage('{"type": "shell", "cmd": "id"}'), 400, "InvalidArgumentError"),
    (ws.TextMessage('{"type": "execute"}'), 422, "ValidationError"),
    (ws.TextMessage('{"type": "execute", "code": 5}'), 422, "ValidationError"),
    (ws.TextMessage('{"type": "execute", "code": "1", "timeout": -1}'), 422, "ValidationError"),
    (ws.TextMessage('{"type": "execute", "code": "1", "evil": 1}'), 422, "ValidationError"),
    (ws.TextMessage('{"type": "execute", "code": "\\ud800"}'), 400, "InvalidArgumentError"),
    (ws.TextMessage('{"type": "execute", "code": "1", "timeout": 1e9}'), 422, "ValidationError"),
    # Nested past the JSON parser's recursion limit (a RecursionError, not a ValueError).
    (ws.TextMessage("[" * 100_000), 422, "ValidationError"),
]


def test_garbage_frames_are_typed_refusals_and_never_crash(
    server: ServerProcess, alice: str, sbx: Sandbox
) -> None:
    sbx.run_code("1")
    with contextlib.closing(_connect(server, alice, sbx.sandbox_id)) as sock:
        for event, status, name in GARBAGE:
            _raw(sock, event)
            (reply,) = _replies(sock)
            assert reply["type"] == "refused", (event, reply)
            assert (reply["status"], reply["error"]["type"]) == (status, name), (event, reply)
        # The connection still takes a cell, and none of the garbage became one.
        assert [m["type"] for m in sock.cell({"code": "'ok'"}, 60)][-1] == "end_of_execution"
        assert len(_audit(server, sbx.sandbox_id)) == 2


def test_broken_framing_closes_that_connection_only(
    server: ServerProcess, alice: str, sbx: Sandbox
) -> None:
    sbx.run_code("1")
    with contextlib.closing(_connect(server, alice, sbx.sandbox_id)) as sock:
        # An unmasked frame with a reserved opcode and a length past the end of the stream.
        sock._sock.sendall(b"\x8b\x7f" + b"\xff" * 8 + os.urandom(64))
        assert _replies(sock)[-1]["type"] == "closed"
        assert sbx.run_code("'still here'").text == "'still here'"


def test_a_message_mid_cell_ends_the_connection_and_the_cell(
    server: ServerProcess, alice: str, sbx: Sandbox
) -> None:
    sbx.run_code("1")
    with contextlib.closing(_connect(server, alice, sbx.sandbox_id)) as sock:
        stream = sock.cell({"code": "import time\nprint('on', flush=True)\ntime.sleep(600)"}, 60)
        assert next(stream)["text"] == "on\n"
        _raw(sock, ws.TextMessage('{"type": "execute", "code": "2"}'))
        assert _replies(sock)[-1] == {"type": "closed", "code": 1008}
        deadline = time.monotonic() + 120
        while _audit(server, sbx.sandbox_id)[-1]["outcome"] == "running":
            assert time.monotonic() < deadline, "the cell was not interrupted"
            time.sleep(0.3)
        assert [row["code_bytes"] for row in _audit(server, sbx.sandbox_id)][-1] > 1


PRINTS = """
chunk = "x" * (1 << 20)
try:
    for _ in range(200):
        print(chunk)
finally:  # also when the server interrupts the cell
    open("/home/user/done", "w").close()
"""


def test_a_client_that_reads_nothing_is_cut_and_the_server_stays_bounded(
    server: ServerProcess,
) -> None:
    """200 MiB of output to a socket client that reads nothing: the server holds a
    bounded queue, the sandbox waits, and after --client-stall-timeout (5 s) the
    stream is cut with ClientTooSlow and the cell interrupted."""
    assert server.process is not None
    pid = server.process.pid
    key = server.key("printer", "--ceiling", f"output_bytes={256 * MiB}")
    with Sandbox(api_url=server.url, api_key=key, resources={"output_bytes": 256 * MiB}) as sbx:
        sbx.run_code("1")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status(pid, "VmRSS")
        with contextlib.closing(_connect(server, key, sbx.sandbox_id)) as sock:
            sock._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            _raw(sock, ws.TextMessage(json.dumps({"type": "execute", "code": PRINTS})))
            for _ in range(600):  # bounded: a few minutes at most
                # A round trip into the sandbox (over HTTP) as the pause between polls.
                if sbx.commands.run("sleep 0.1; test -f /home/user/done", timeout=5).exit_code == 0:
                    break
            else:
                pytest.fail("the cell did not end")
            growth = _status(pid, "VmHWM") - base
            messages = _replies(sock, timeout=60)
    assert growth < 64 * MiB, f"the server grew by {growth / MiB:.0f} MiB"
    printed = sum(len(str(m.get("text", ""))) for m in messages if m["type"] == "stdout")
    assert 0 < printed < 64 * MiB, printed
    cut = [m for m in messages if m["type"] == "error"]
    assert cut and cut[-1]["name"] == "ClientTooSlow", messages[-3:]


def _status(pid: int, field: str) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1]) * 1024
    raise KeyError(field)


# --- fallback ------------------------------------------------------------------------


def test_a_server_without_the_socket_gets_cells_over_http(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A server whose ASGI server has no WebSocket implementation (uvicorn without
    wsproto or websockets) answers the upgrade as a plain request, as a sandlot from
    before the socket does: the SDK goes on over HTTP, for good, and nothing differs."""
    shadow = tmp_path_factory.mktemp("no-websocket")
    for name in ("wsproto", "websockets"):
        (shadow / name).mkdir()
        (shadow / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    path = [str(shadow), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    server = ServerProcess(
        tmp_path_factory.mktemp("old-server"), env={"PYTHONPATH": os.pathsep.join(path)}
    ).start()
    try:
        key = server.key("alice")
        with pytest.raises(NoCellSocket), Sandbox(api_url=server.url, api_key=key) as probe:
            _connect(server, key, probe.sandbox_id)
        with Sandbox(api_url=server.url, api_key=key) as sbx:
            out: list[str] = []
            for n in range(3):
                execution = sbx.run_code(f"print({n}); {n}", on_stdout=lambda m: out.append(m.line))
                assert execution.text == str(n)
            assert out == ["0\n", "1\n", "2\n"]
            assert _on_socket(sbx) is None and sbx._core._socket_offered is False  # type: ignore[attr-defined]
            assert [row["outcome"] for row in _audit(server, sbx.sandbox_id)] == ["ok"] * 3
    finally:
        server.stop()


def test_a_server_that_never_answers_the_upgrade_is_not_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connected, then nothing (a proxy or server that swallows the upgrade): the SDK
    must not wait on it cell after cell, it goes over HTTP."""
    import sandlot._remote

    monkeypatch.setattr(sandlot._remote, "CONNECT_TIMEOUT", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as quiet:  # listens, never answers
        url = f"http://127.0.0.1:{quiet.getsockname()[1]}"
        with pytest.raises(NoCellSocket, match="handshake failed"):
            CellSocket.connect(url, "sl_x_y", "sandbox")
