"""Background commands, handles and terminals in the SDK, against the shipped fake
(:class:`sandlot.testing.FakeBackend`): what the host side folds, maps and sends."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import pytest

from sandlot import (
    AsyncSandbox,
    CommandExitError,
    CommandHandle,
    InvalidArgumentError,
    ProcessInfo,
    ProcessLimitError,
    ProcessNotFoundError,
    PtySize,
    Sandbox,
    SandboxLost,
)
from sandlot.testing import ECHO_PID, Die, FakeBackend, echo_handler


def _reply(value: Any = None) -> dict[str, Any]:
    return {"type": "reply", "ok": True, "value": value}


def _failure(name: str, message: str) -> dict[str, Any]:
    return {"type": "reply", "ok": False, "error": {"name": name, "message": message}}


def handler(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    kind = request["type"]
    if kind == "process_start":
        if request["cmd"] == "full":
            yield _failure("ProcessLimitError", "this sandbox already runs 16")
            return
        yield {"type": "started", "pid": 42}
        if "pty" in request:
            yield {"type": "data", "data": base64.b64encode(b"\x1b[1mbash$ ").decode()}
            yield {"type": "exit", "status": "ok", "exit_code": 0}
            return
        yield {"type": "stdout", "text": "out\n"}
        yield {"type": "stderr", "text": "err\n"}
        if request["cmd"] == "die":
            raise Die("the sandbox died")
        if request["cmd"] == "slow":
            yield {"type": "exit", "status": "timeout", "exit_code": -9}
        else:
            yield {"type": "exit", "status": "error", "exit_code": 3, "truncated": True}
    elif kind == "process_connect":
        if request["pid"] != 42:
            yield _failure("ProcessNotFoundError", f"no running process with pid {request['pid']}")
            return
        yield {"type": "started", "pid": 42}
        yield {"type": "stdout", "text": "replayed\n"}
        yield {"type": "exit", "status": "ok", "exit_code": 0}
    elif kind == "process_list":
        info = {"pid": 42, "tag": None, "cmd": "/bin/sh", "args": ["-c", "x"], "envs": {"A": "b"}}
        yield _reply([{**info, "cwd": "/home/user"}])
    elif kind == "process_kill":
        yield _reply(request["pid"] == 42)
    else:
        yield _reply()


@pytest.fixture
def fake() -> Iterator[tuple[Sandbox, FakeBackend]]:
    backend = FakeBackend(handler)
    with Sandbox(backend=backend) as sbx:
        yield sbx, backend


def test_wait_folds_output_and_raises_on_a_non_zero_exit(
    fake: tuple[Sandbox, FakeBackend],
) -> None:
    sbx, backend = fake
    handle = sbx.commands.run("exit 3", background=True, envs={"A": "b"}, timeout=0)
    assert isinstance(handle, CommandHandle) and handle.pid == 42
    request = backend.requests[-1]
    assert request["type"] == "process_start"
    assert request["timeout"] == 0 and request["stdin"] is False and request["envs"] == {"A": "b"}
    seen: list[str] = []
    with pytest.raises(CommandExitError) as caught:
        handle.wait(on_stdout=seen.append, on_stderr=seen.append)
    assert (caught.value.stdout, caught.value.stderr) == ("out\n", "err\n")
    assert caught.value.exit_code == 3 and caught.value.error == "output truncated"
    assert str(caught.value) == "Command exited with code 3 and error:\nerr\n"
    assert seen == ["out\n", "err\n"]
    assert handle.exit_code == 3 and handle.stdout == "out\n"


def test_a_timeout_is_the_error(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, _ = fake
    with pytest.raises(CommandExitError) as caught:
        sbx.commands.run("slow", background=True, timeout=5).wait()
    assert caught.value.error == "timeout" and caught.value.exit_code == -9


def test_the_refusals_are_typed(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, _ = fake
    with pytest.raises(ProcessLimitError):
        sbx.commands.run("full", background=True)
    with pytest.raises(ProcessNotFoundError):
        sbx.commands.connect(7)
    assert sbx.commands.kill(7) is False
    assert sbx.commands.kill(42) is True


def test_list_and_connect(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, _ = fake
    assert sbx.commands.list() == [
        ProcessInfo(
            pid=42, tag=None, cmd="/bin/sh", args=["-c", "x"], envs={"A": "b"}, cwd="/home/user"
        )
    ]
    assert list(sbx.commands.connect(42)) == [("replayed\n", None, None)]


def test_stdin_goes_as_base64(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, backend = fake
    sbx.commands.send_stdin(42, "é\n")
    assert backend.requests[-1]["type"] == "process_stdin"
    assert base64.b64decode(backend.requests[-1]["data"]) == "é\n".encode()
    sbx.commands.close_stdin(42)
    assert backend.requests[-1] == {
        "type": "process_close_stdin",
        "id": backend.requests[-1]["id"],
        "pid": 42,
    }


def test_a_sandbox_that_dies_mid_stream_is_lost(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, _ = fake
    handle = sbx.commands.run("die", background=True)
    with pytest.raises(SandboxLost):
        handle.wait()


def test_a_terminal_streams_bytes(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, backend = fake
    handle = sbx.pty.create(PtySize(rows=30, cols=90), timeout=None)
    assert backend.requests[-1]["pty"] == {"rows": 30, "cols": 90}
    chunks: list[bytes] = []
    assert handle.wait(on_pty=chunks.append).exit_code == 0
    assert chunks == [b"\x1b[1mbash$ "]
    sbx.pty.resize(42, PtySize(rows=10, cols=20))
    assert backend.requests[-1]["rows"] == 10


def test_bad_arguments(fake: tuple[Sandbox, FakeBackend]) -> None:
    sbx, _ = fake
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("cat", stdin=True)
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("cat", background=True, on_stdout=print)
    with pytest.raises(InvalidArgumentError):
        sbx.commands.kill(-1)
    with pytest.raises(InvalidArgumentError):
        sbx.commands.send_stdin(42, 5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        sbx.pty.create(PtySize(rows=0, cols=80))
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("sleep 1", background=True, timeout=-1)


def test_the_echo_handler_fakes_the_new_verbs() -> None:
    with Sandbox(backend=FakeBackend(echo_handler)) as sbx:
        handle = sbx.commands.run("echo hi", background=True)
        assert handle.pid == ECHO_PID
        assert handle.wait().stdout == "echo hi"
        assert sbx.commands.list() == []
        assert sbx.commands.kill(ECHO_PID) is False
        with pytest.raises(ProcessNotFoundError):
            sbx.commands.connect(ECHO_PID)
        with pytest.raises(ProcessNotFoundError):
            sbx.commands.send_stdin(ECHO_PID, "x")


def test_the_async_twin() -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create(backend=FakeBackend(handler))
        try:
            handle = await sbx.commands.run("x", background=True)
            items = [item async for item in handle]
            assert items == [("out\n", None, None), (None, "err\n", None)]
            assert handle.exit_code == 3
            assert [p.pid for p in await sbx.commands.list()] == [42]
            assert await sbx.commands.kill(42) is True
            again = await sbx.commands.connect(42)
            assert (await again.wait()).stdout == "replayed\n"
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_the_host_caps_output_a_runner_sends_beyond_the_limit() -> None:
    # A runner that ignores output_bytes (compromised, or buggy) cannot make the host
    # keep more than the limit plus the marker's slack.
    def flood(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield {"type": "started", "pid": 9}
        for _ in range(64):
            yield {"type": "stdout", "text": "x" * 65536}
        yield {"type": "exit", "status": "ok", "exit_code": 0}

    with Sandbox(backend=FakeBackend(flood), resources={"output_bytes": 1024}) as sbx:
        result = sbx.commands.run("flood", background=True).wait()
    assert len(result.stdout) <= 1024 + 4096
    assert result.error == "output truncated"
