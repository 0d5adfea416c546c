"""The SDK (``Sandbox``, ``AsyncSandbox``) against :class:`sandlot.testing.FakeBackend`.

Everything the SDK decides on the host side is tested here without a sandbox:
folding, callbacks, restarts after a lost sandbox, the host-side timeout backstop,
file chunking, error mapping and argument validation.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import sandlot._local as local_module
import sandlot.validate as validate_module
from sandlot import (
    AsyncSandbox,
    Context,
    ContextNotFoundError,
    Execution,
    ExecutionError,
    FileOperationError,
    FileType,
    InvalidArgumentError,
    NotFoundError,
    OutputMessage,
    PathNotAllowedError,
    Resources,
    Result,
    Sandbox,
    SandboxClosed,
    SandboxLost,
)
from sandlot.backends import get_backend
from sandlot.policy import SandboxSpec
from sandlot.protocol import CHUNK_BYTES
from sandlot.testing import Die, FakeBackend, echo_handler

Request = dict[str, Any]
Events = Iterator[dict[str, Any]]


def reply(value: Any = None) -> dict[str, Any]:
    return {"type": "reply", "ok": True, "value": value}


def failure(name: str, message: str) -> dict[str, Any]:
    return {"type": "reply", "ok": False, "error": {"name": name, "message": message}}


def cell_ok(request: Request) -> Events:
    """A well-behaved runner's answer to ``x = 1; print('hi'); x + 1``."""
    yield {"type": "stdout", "text": "hi\n"}
    yield {"type": "result", "data": {"text/plain": "2"}, "is_main_result": True}
    yield {"type": "exit", "status": "ok", "execution_count": 1}


class Runner:
    """A handler dispatching on request type; tests set ``self.on[type]``."""

    def __init__(self, **on: Callable[[Request], Any]) -> None:
        self.on: dict[str, Callable[[Request], Any]] = {"execute": cell_ok, **on}

    def __call__(self, request: Request) -> Any:
        handler = self.on.get(request["type"])
        if handler is None:
            return [failure("FileOperationError", f"not faked: {request['type']}")]
        return handler(request)


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Sandbox, FakeBackend]]]:
    """``make(handler, **kwargs)`` -> (sandbox, backend); sandboxes die after the test."""
    started: list[Sandbox] = []

    def start(handler: Any = None, **kwargs: Any) -> tuple[Sandbox, FakeBackend]:
        backend = FakeBackend(handler or Runner())
        kwargs.setdefault("timeout", None)
        sbx = Sandbox(backend=backend, **kwargs)
        started.append(sbx)
        return sbx, backend

    yield start
    for sbx in started:
        sbx.kill()


# --- the fake itself ------------------------------------------------------------------


def test_get_backend_accepts_an_instance() -> None:
    backend = FakeBackend(echo_handler)
    assert get_backend(backend) is backend
    probe = FakeBackend.probe()
    assert probe.name == "fake" and probe.available


def test_start_passes_the_spec(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, backend = make(resources={"pids": 7}, envs={"A": "1"}, template="tiny")
    assert len(backend.handles) == 1
    spec = backend.handle.spec
    assert spec.resources == Resources(pids=7)
    assert spec.template == "tiny"
    assert dict(spec.envs) == {"A": "1"}
    assert sbx.resources == Resources(pids=7)
    assert sbx.is_running()
    assert backend.requests == []  # starting sends nothing


def test_echo_handler(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, _ = make(echo_handler)
    execution = sbx.run_code("1 + 1")
    assert execution.logs.stdout == ["1 + 1"]
    assert execution.text == "1 + 1"
    assert sbx.commands.run("ls").stdout == "ls"
    with pytest.raises(FileOperationError, match="fs_read"):
        sbx.files.read("x")


def test_fake_handle_directly() -> None:
    handle = FakeBackend(echo_handler).start(SandboxSpec())
    stream = handle.request(
        {"type": "execute", "code": "x", "context": "default", "envs": {}, "timeout": 1}
    )
    events = [stream.next(1), stream.next(1), stream.next(1)]
    assert [e["type"] for e in events if e] == ["stdout", "result", "exit"]
    assert all(e is not None and e["id"] == "r1" for e in events)
    assert stream.next(1) is None  # finished
    assert handle.requests[0]["id"] == "r1"
    handle.kill()
    handle.kill()  # idempotent
    assert not handle.alive
    assert handle.death_reason == "the sandbox was killed"
    with pytest.raises(SandboxLost, match="killed"):
        handle.request({"type": "list_contexts"}).next(1)
    assert len(handle.requests) == 1  # nothing reaches a dead sandbox


def test_fake_rejects_requests_the_protocol_forbids() -> None:
    from sandlot.protocol import ProtocolViolation

    handle = FakeBackend(echo_handler).start(SandboxSpec())
    with pytest.raises(ProtocolViolation):
        handle.request({"type": "fs_read"})


def _handle(handler: Any) -> Any:
    return FakeBackend(handler).start(SandboxSpec())


LIST = {"type": "list_contexts"}


def test_fake_stops_at_the_terminal_event_and_closes_the_handler() -> None:
    closed: list[bool] = []

    def handler(request: Request) -> Events:
        try:
            yield reply(1)
            yield reply(2)  # never delivered
        finally:
            closed.append(True)

    stream = _handle(handler).request(LIST)
    event = stream.next(1)
    assert event is not None and event["value"] == 1
    assert closed == [True]
    assert stream.next(1) is None


def test_fake_routes_by_id_like_the_channel() -> None:
    stream = _handle(lambda r: [{"type": "stdout", "id": "other", "text": "x"}, reply()]).request(
        LIST
    )
    event = stream.next(1)
    assert event is not None and event["type"] == "reply"


def test_fake_hung_runner_waits_and_wakes_on_kill() -> None:
    handle = _handle(lambda r: [])
    stream = handle.request(LIST)
    started = time.monotonic()
    assert stream.next(0.05) is None
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, handle.kill).start()
    with pytest.raises(SandboxLost, match="killed"):
        stream.next(None)  # would block forever without the kill
    assert stream.next(None) is None  # a lost stream is finished


def test_die_reaches_every_open_stream() -> None:
    def handler(request: Request) -> Events:
        if request["type"] == "fs_stat":
            raise Die("oom")
        yield {"type": "data", "data": ""}

    handle = _handle(handler)
    waiting = handle.request({"type": "fs_read", "path": "a"})
    assert waiting.next(1) is not None
    with pytest.raises(SandboxLost, match="oom"):
        handle.request({"type": "fs_stat", "path": "a"}).next(1)
    with pytest.raises(SandboxLost, match="oom"):
        waiting.next(1)
    assert handle.death_reason == "oom"


def test_fake_handler_mistakes_are_loud() -> None:
    with pytest.raises(TypeError, match="returned None"):
        _handle(lambda r: None).request(LIST).next(1)
    with pytest.raises(TypeError, match="not JSON"):
        _handle(lambda r: [{"type": "reply", "ok": True, "value": object()}]).request(LIST).next(1)
    with pytest.raises(TypeError, match="not a dict"):
        _handle(lambda r: ["reply"]).request(LIST).next(1)


def test_fake_handler_gets_a_copy_of_the_request() -> None:
    def handler(request: Request) -> Events:
        request["envs"]["INJECTED"] = "1"
        yield {"type": "exit", "status": "ok"}

    handle = _handle(handler)
    message = {"type": "execute", "code": "1", "context": "c", "envs": {"A": "b"}, "timeout": 1}
    handle.request(message).next(1)
    assert handle.requests[0]["envs"] == {"A": "b"}
    assert message["envs"] == {"A": "b"}


def test_backend_handle_before_any_start() -> None:
    with pytest.raises(LookupError):
        FakeBackend(echo_handler).handle  # noqa: B018


# --- run_code -------------------------------------------------------------------------


def test_run_code_folds_events(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, backend = make()
    execution = sbx.run_code("x = 1; print('hi'); x + 1")
    assert execution.logs.stdout == ["hi\n"]
    assert execution.text == "2"
    assert execution.execution_count == 1
    assert execution.status == "ok" and execution.error is None
    assert execution.duration > 0
    (request,) = backend.requests
    assert request["type"] == "execute"
    assert request["code"] == "x = 1; print('hi'); x + 1"
    assert request["context"] == "default"
    assert request["envs"] == {}
    assert request["timeout"] == validate_module.DEFAULT_CELL_TIMEOUT
    assert request["id"].startswith(sbx.sandbox_id)


def test_run_code_passes_context_envs_timeout(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    sbx, backend = make()
    sbx.run_code("1", context="c1", envs={"K": "v"}, timeout=2.5, language="python")
    sbx.run_code("1", context=Context(id="c2", language="python", cwd="/home/user"))
    first, second = backend.requests
    assert (first["context"], first["envs"], first["timeout"]) == ("c1", {"K": "v"}, 2.5)
    assert second["context"] == "c2"
    assert first["id"] != second["id"]


def test_user_errors_are_values(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def cell(request: Request) -> Events:
        yield {"type": "stdout", "text": "before\n"}
        yield {
            "type": "error",
            "name": "ZeroDivisionError",
            "value": "division by zero",
            "traceback": "Traceback ...",
        }
        yield {"type": "exit", "status": "error", "execution_count": 4}

    sbx, _ = make(Runner(execute=cell))
    execution = sbx.run_code("1/0")
    assert execution.status == "error"
    assert execution.error == ExecutionError(
        "ZeroDivisionError", "division by zero", "Traceback ..."
    )
    assert execution.logs.stdout == ["before\n"]
    assert execution.execution_count == 4


def test_callbacks_in_event_order(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def cell(request: Request) -> Events:
        yield {"type": "stdout", "text": "1"}
        yield {"type": "stderr", "text": "2"}
        yield {"type": "result", "data": {"text/plain": "3"}, "is_main_result": False}
        yield {"type": "stdout", "text": "4"}
        yield {"type": "error", "name": "E", "value": "5", "traceback": ""}
        yield {"type": "exit", "status": "error"}

    calls: list[tuple[str, Any]] = []
    sbx, _ = make(Runner(execute=cell))
    sbx.run_code(
        "...",
        on_stdout=lambda m: calls.append(("stdout", m)),
        on_stderr=lambda m: calls.append(("stderr", m)),
        on_result=lambda r: calls.append(("result", r)),
        on_error=lambda e: calls.append(("error", e)),
    )
    assert [kind for kind, _ in calls] == ["stdout", "stderr", "result", "stdout", "error"]
    assert isinstance(calls[0][1], OutputMessage) and calls[0][1].line == "1"
    assert calls[1][1].error is True
    assert isinstance(calls[2][1], Result) and calls[2][1].text == "3"
    assert isinstance(calls[4][1], ExecutionError) and calls[4][1].value == "5"


def test_callbacks_run_while_the_cell_streams(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    seen_by_handler: list[int] = []
    calls: list[str] = []

    def cell(request: Request) -> Events:
        yield {"type": "stdout", "text": "a"}
        seen_by_handler.append(len(calls))  # the callback for "a" already ran
        yield {"type": "exit", "status": "ok"}

    sbx, _ = make(Runner(execute=cell))
    sbx.run_code("...", on_stdout=lambda m: calls.append(m.line))
    assert seen_by_handler == [1]


def test_host_truncates_a_chatty_runner(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def cell(request: Request) -> Events:
        for _ in range(100):
            yield {"type": "stdout", "text": "x" * 1000}
        yield {"type": "exit", "status": "ok"}

    sbx, _ = make(Runner(execute=cell), resources={"output_bytes": 2000})
    execution = sbx.run_code("...")
    assert execution.truncated
    assert len("".join(execution.logs.stdout)) < 2000 + 4096 + 200
    assert "output truncated" in execution.logs.stdout[-1]


# --- a sandbox that dies --------------------------------------------------------------


def test_sandbox_dying_mid_cell(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def dies(request: Request) -> Events:
        yield {"type": "stdout", "text": "printed before\n"}
        raise Die("the sandbox process was killed by signal 9")

    errors: list[ExecutionError] = []
    runner = Runner(execute=dies)
    sbx, backend = make(runner)
    execution = sbx.run_code("...", on_error=errors.append)
    assert execution.status == "died"
    assert execution.error is not None
    assert execution.error.name == "SandboxLostError"
    assert "killed by signal 9" in execution.error.value
    assert execution.logs.stdout == ["printed before\n"]
    assert errors == [execution.error]
    first = backend.handle
    assert not first.alive
    assert first.death_reason == "the sandbox process was killed by signal 9"
    assert not sbx.is_running()

    # The next call starts a new sandbox, transparently.
    runner.on["execute"] = cell_ok
    again = sbx.run_code("x + 1")
    assert again.error is None and again.text == "2"
    assert len(backend.handles) == 2
    assert backend.handle is not first and backend.handle.alive
    assert sbx._core.restarts == 1
    assert sbx.is_running()


def test_die_before_any_event(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def dies(request: Request) -> list[dict[str, Any]]:
        raise Die("gone")

    sbx, _ = make(Runner(execute=dies))
    execution = sbx.run_code("...")
    assert execution.status == "died"
    assert execution.logs.stdout == []


def test_protocol_violation_kills_the_sandbox(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    def hostile(request: Request) -> Events:
        yield {"type": "stdout", "text": "ok\n"}
        yield {"type": "exit", "status": "pwned"}

    sbx, backend = make(Runner(execute=hostile))
    execution = sbx.run_code("...")
    assert execution.status == "died"
    assert execution.error is not None
    assert "broke the protocol" in execution.error.value
    assert execution.logs.stdout == ["ok\n"]
    assert not backend.handle.alive


def test_killed_from_outside_between_cells(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    sbx, backend = make()
    backend.handle.kill()  # e.g. the OOM killer took the whole sandbox
    assert not sbx.is_running()
    assert sbx.run_code("1").text == "2"
    assert len(backend.handles) == 2


def test_runner_that_never_exits_hits_the_host_backstop(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "HOST_BACKSTOP", 0.1)

    def hangs(request: Request) -> Events:
        yield {"type": "stdout", "text": "started\n"}
        # ... and never an exit: a hung or hostile runner.

    runner = Runner(execute=hangs)
    sbx, backend = make(runner)
    started = time.monotonic()
    execution = sbx.run_code("while True: pass", timeout=0.1)
    elapsed = time.monotonic() - started
    assert elapsed >= 0.2
    assert execution.status == "timeout"
    assert execution.error is not None
    assert execution.error.name == "TimeoutError"
    assert "destroyed" in execution.error.value
    assert execution.logs.stdout == ["started\n"]
    assert not backend.handle.alive  # the whole sandbox was killed

    runner.on["execute"] = cell_ok
    assert sbx.run_code("1").text == "2"
    assert len(backend.handles) == 2


def test_runner_reported_timeout_keeps_the_sandbox(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    def times_out(request: Request) -> Events:
        yield {"type": "error", "name": "TimeoutError", "value": "cell timed out", "traceback": ""}
        yield {"type": "exit", "status": "timeout"}

    sbx, backend = make(Runner(execute=times_out))
    execution = sbx.run_code("...", timeout=1)
    assert execution.status == "timeout"
    assert execution.error is not None and execution.error.name == "TimeoutError"
    assert backend.handle.alive
    assert len(backend.handles) == 1


def test_killed_sandbox_refuses_calls(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, backend = make()
    sbx.kill()
    sbx.kill()  # idempotent
    assert not backend.handle.alive
    assert not sbx.is_running()
    with pytest.raises(SandboxClosed):
        sbx.run_code("1")
    with pytest.raises(SandboxClosed):
        sbx.files.read("a")
    assert len(backend.handles) == 1


def test_context_manager_kills(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    backend = FakeBackend(Runner())
    with Sandbox(backend=backend, timeout=None) as sbx:
        assert sbx.run_code("1").text == "2"
    assert not backend.handle.alive


def test_sandbox_timeout_kills_it() -> None:
    backend = FakeBackend(Runner())
    sbx = Sandbox(backend=backend, timeout=0.05)
    deadline = time.monotonic() + 5
    while sbx.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sbx.is_running()
    assert not backend.handle.alive
    with pytest.raises(SandboxClosed):
        sbx.run_code("1")


def test_a_short_timeout_fires_on_time_behind_a_long_one() -> None:
    # Every sandbox's timeout is on one thread, which waits for the earliest: a sandbox
    # made later with a shorter timeout must wake it, and the long one must not fire.
    long = Sandbox(backend=FakeBackend(Runner()), timeout=60)
    started = [long]
    try:
        for _ in range(2):  # the second: the thread is surely waiting for the long one
            short = Sandbox(backend=FakeBackend(Runner()), timeout=0.05)
            started.append(short)
            deadline = time.monotonic() + 5
            while short.is_running() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not short.is_running()
        assert long.is_running()
    finally:
        for sbx in started:
            sbx.kill()


def test_set_timeout_none_cancels(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, _ = make(timeout=0.1)
    sbx.set_timeout(None)
    time.sleep(0.2)
    assert sbx.is_running()


# --- commands -------------------------------------------------------------------------


def test_commands_run(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def command(request: Request) -> Events:
        yield {"type": "stdout", "text": "out\n"}
        yield {"type": "stderr", "text": "err\n"}
        yield {"type": "exit", "status": "error", "exit_code": 3}

    lines: list[str] = []
    sbx, backend = make(Runner(command=command))
    result = sbx.commands.run(
        "false", cwd="sub", envs={"A": "b"}, on_stdout=lambda m: lines.append(m.line)
    )
    assert (result.stdout, result.stderr, result.exit_code, result.error) == (
        "out\n",
        "err\n",
        3,
        None,
    )
    assert lines == ["out\n"]
    request = backend.requests[0]
    assert (request["cmd"], request["cwd"], request["envs"]) == ("false", "sub", {"A": "b"})
    assert request["timeout"] == validate_module.DEFAULT_COMMAND_TIMEOUT


def test_command_host_backstop(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "HOST_BACKSTOP", 0.05)
    sbx, backend = make(Runner(command=lambda r: iter([{"type": "stdout", "text": "x"}])))
    result = sbx.commands.run("sleep 100", timeout=0.05)
    assert result.error == "timeout"
    assert result.exit_code == -1
    assert result.stdout == "x"
    assert not backend.handle.alive


def test_command_sandbox_lost(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    def dies(request: Request) -> Events:
        yield {"type": "stdout", "text": "x"}
        raise Die("boom")

    sbx, _ = make(Runner(command=dies))
    result = sbx.commands.run("x")
    assert result.error == "sandbox lost: boom"
    assert result.stdout == "x"


@pytest.mark.parametrize("cmd", ["", "   ", None, 1])
def test_command_must_be_a_string(
    make: Callable[..., tuple[Sandbox, FakeBackend]], cmd: Any
) -> None:
    sbx, backend = make()
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run(cmd)
    assert backend.requests == []


# --- files ----------------------------------------------------------------------------


class Files:
    """An in-memory fake of the runner's file operations, chunked like the real one."""

    def __init__(self, chunk: int = 3) -> None:
        self.data: dict[str, bytes] = {}
        self.chunk = chunk

    def entry(self, path: str) -> dict[str, Any]:
        name = path.rsplit("/", 1)[-1]
        return {
            "name": name,
            "type": "file",
            "path": f"/home/user/{path}",
            "size": len(self.data[path]),
        }

    def runner(self) -> Runner:
        return Runner(fs_write=self.write, fs_read=self.read, fs_stat=self.stat)

    def write(self, request: Request) -> Events:
        chunk = base64.b64decode(request["data"])
        path = request["path"]
        self.data[path] = (self.data[path] if request["append"] else b"") + chunk
        yield reply(self.entry(path))

    def read(self, request: Request) -> Events:
        path = request["path"]
        if path not in self.data:
            yield failure("NotFoundError", f"{path}: no such file")
            return
        data = self.data[path]
        for offset in range(0, len(data), self.chunk):
            yield {
                "type": "data",
                "data": base64.b64encode(data[offset : offset + self.chunk]).decode(),
            }
        yield reply()

    def stat(self, request: Request) -> Events:
        path = request["path"]
        if path not in self.data:
            yield failure("NotFoundError", f"{path}: no such file")
        else:
            yield reply(self.entry(path))


def test_write_and_read_round_trip(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    files = Files()
    sbx, _ = make(files.runner())
    info = sbx.files.write("hello.txt", "héllo wörld")
    assert (info.name, info.type, info.path) == ("hello.txt", FileType.FILE, "/home/user/hello.txt")
    assert sbx.files.read("hello.txt") == "héllo wörld"
    assert sbx.files.read("hello.txt", format="bytes") == "héllo wörld".encode()
    chunks = list(sbx.files.read("hello.txt", format="stream"))
    assert len(chunks) > 1 and b"".join(chunks) == "héllo wörld".encode()
    assert sbx.files.exists("hello.txt")
    assert not sbx.files.exists("nope.txt")
    assert sbx.files.get_info("hello.txt").size == len("héllo wörld".encode())


def test_big_write_is_chunked_with_append(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    files = Files()
    sbx, backend = make(files.runner())
    payload = bytes(range(256)) * ((2 * CHUNK_BYTES + 1000) // 256)
    assert len(payload) > 2 * CHUNK_BYTES
    sbx.files.write("big.bin", payload)
    writes = [r for r in backend.requests if r["type"] == "fs_write"]
    assert [w["append"] for w in writes] == [False, True, True]
    assert all(w["path"] == "big.bin" for w in writes)
    sizes = [len(base64.b64decode(w["data"])) for w in writes]
    assert sizes == [CHUNK_BYTES, CHUNK_BYTES, len(payload) - 2 * CHUNK_BYTES]
    assert files.data["big.bin"] == payload


def test_write_from_file_objects(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "CHUNK_BYTES", 4)
    files = Files()
    sbx, backend = make(files.runner())
    sbx.files.write("b.bin", io.BytesIO(b"0123456789"))
    assert files.data["b.bin"] == b"0123456789"
    assert [r["append"] for r in backend.requests] == [False, True, True]
    sbx.files.write("t.txt", io.StringIO("abcdé"))
    assert files.data["t.txt"] == "abcdé".encode()
    sbx.files.write("m.bin", memoryview(b"xyz"))
    assert files.data["m.bin"] == b"xyz"


def test_empty_write_still_creates_the_file(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    files = Files()
    sbx, backend = make(files.runner())
    sbx.files.write("empty", b"")
    assert files.data["empty"] == b""
    assert [(r["data"], r["append"]) for r in backend.requests] == [("", False)]


def test_write_larger_than_the_workspace_is_refused(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    files = Files()
    sbx, backend = make(files.runner(), resources={"disk_mb": 1})
    with pytest.raises(InvalidArgumentError, match="disk_mb"):
        sbx.files.write("big", b"x" * (2 * 1024 * 1024))
    assert backend.requests == []


def test_uploads_over_the_upload_limit_are_refused_before_sending(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    files = Files()
    sbx, backend = make(files.runner(), resources={"upload_bytes": 1000})
    with pytest.raises(InvalidArgumentError, match="upload_bytes"):
        sbx.files.write("big", b"x" * 1001)
    with pytest.raises(InvalidArgumentError, match="upload_bytes"):
        sbx.files.write("big", io.BytesIO(b"x" * 1001))  # seekable: size known up front
    assert backend.requests == []
    sbx.files.write("fits", b"x" * 1000)
    [request] = backend.requests
    assert request["max_bytes"] == 1000  # the runner checks again


def test_a_stream_growing_past_the_upload_limit_leaves_no_partial_file(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "CHUNK_BYTES", 4)
    files = Files()
    runner = files.runner()
    removed: list[str] = []

    def remove(request: Request) -> Events:
        removed.append(request["path"])
        files.data.pop(request["path"], None)
        yield reply()

    runner.on["fs_remove"] = remove

    class Pipe(io.RawIOBase):  # not seekable: the size shows only while reading
        def __init__(self) -> None:
            self.left = 10

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            count = min(len(buffer), self.left)
            buffer[:count] = b"y" * count
            self.left -= count
            return count

    sbx, _ = make(runner, resources={"upload_bytes": 6})
    with pytest.raises(InvalidArgumentError, match="upload limit"):
        sbx.files.write("stream.bin", Pipe())
    assert removed == ["stream.bin"] and "stream.bin" not in files.data


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "../../etc/passwd",
        "a/../../../etc/shadow",
        "/home/user/../user2/x",
        "/tmp/../etc/hosts",
        "//etc/passwd",
        "/dev/shm/x",
        "/proc/1/environ",
        "/opt/sandlot/lib/sandlot/runner/_supervisor.py",
    ],
)
def test_paths_outside_the_workspace_are_refused_on_the_host(
    make: Callable[..., tuple[Sandbox, FakeBackend]], path: str
) -> None:
    sbx, backend = make(Files().runner())
    calls: list[Callable[[], Any]] = [
        lambda: sbx.files.read(path),
        lambda: sbx.files.read(path, format="stream"),
        lambda: sbx.files.write(path, "x"),
        lambda: sbx.files.list(path),
        lambda: sbx.files.exists(path),
        lambda: sbx.files.get_info(path),
        lambda: sbx.files.remove(path),
        lambda: sbx.files.make_dir(path),
        lambda: sbx.files.rename("ok.txt", path),
        lambda: sbx.files.rename(path, "ok.txt"),
    ]
    for call in calls:
        with pytest.raises(PathNotAllowedError) as info:
            call()
        assert isinstance(info.value, PermissionError)
        assert isinstance(info.value, FileOperationError)
    assert backend.requests == []


@pytest.mark.parametrize(
    "path", ["ok.txt", "a/b/../c.txt", "/home/user/x", "/tmp/x", "../user/x", "../../tmp/y", "."]
)
def test_paths_inside_the_workspace_are_sent_as_given(
    make: Callable[..., tuple[Sandbox, FakeBackend]], path: str
) -> None:
    sbx, backend = make(Runner(fs_stat=lambda r: [reply({"name": "x", "path": r["path"]})]))
    sbx.files.get_info(path)
    assert backend.requests[-1]["path"] == path  # resolved (and symlinks checked) inside


@pytest.mark.parametrize("path", ["", "a\0b", "x" * 4097, "dir/" + "n" * 256, 7, None])
def test_malformed_paths_are_invalid_arguments(
    make: Callable[..., tuple[Sandbox, FakeBackend]], path: Any
) -> None:
    sbx, backend = make(Files().runner())
    with pytest.raises(InvalidArgumentError):
        sbx.files.read(path)
    with pytest.raises(InvalidArgumentError):
        sbx.files.write(path, "x")
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("true", cwd=path) if path else sbx.files.list(path)
    assert backend.requests == []


def test_path_refusals_from_the_runner_are_typed(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    message = "/home/user/link is a symlink to /etc/passwd, outside the sandbox workspace"
    sbx, _ = make(Runner(fs_read=lambda r: [failure("PathNotAllowedError", message)]))
    with pytest.raises(PathNotAllowedError, match="outside the sandbox workspace"):
        sbx.files.read("link")


def test_error_replies_map_to_exceptions(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    runner = Runner(
        fs_read=lambda r: [failure("NotFoundError", "a.txt: no such file")],
        fs_remove=lambda r: [failure("FileOperationError", "permission denied")],
        fs_mkdir=lambda r: [failure("SomethingNew", "odd")],
        fs_list=lambda r: [{"type": "reply", "ok": False}],
        restart_context=lambda r: [failure("ContextNotFoundError", "no context c9")],
        create_context=lambda r: [failure("InvalidArgumentError", "bad cwd")],
    )
    sbx, _ = make(runner)
    with pytest.raises(NotFoundError, match="no such file") as info:
        sbx.files.read("a.txt")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(FileOperationError, match="permission denied"):
        sbx.files.remove("a.txt")
    with pytest.raises(FileOperationError, match="odd"):
        sbx.files.make_dir("d")
    with pytest.raises(FileOperationError, match="operation failed"):
        sbx.files.list(".")
    with pytest.raises(ContextNotFoundError, match="no context c9"):
        sbx.restart_code_context("c9")
    with pytest.raises(InvalidArgumentError, match="bad cwd"):
        sbx.create_code_context(cwd="/nope")


def test_file_operations_send_the_right_requests(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    entry = {"name": "b", "type": "dir", "path": "/home/user/b"}
    runner = Runner(
        fs_list=lambda r: [reply([entry])],
        fs_remove=lambda r: [reply()],
        fs_mkdir=lambda r: [reply(True)],
        fs_rename=lambda r: [reply(entry)],
    )
    sbx, backend = make(runner)
    assert sbx.files.list("sub", depth=2)[0].type is FileType.DIR
    sbx.files.remove("a")
    assert sbx.files.make_dir("b") is True
    assert sbx.files.rename("a", "b").path == "/home/user/b"
    assert [{k: v for k, v in r.items() if k != "id"} for r in backend.requests] == [
        {"type": "fs_list", "path": "sub", "depth": 2},
        {"type": "fs_remove", "path": "a"},
        {"type": "fs_mkdir", "path": "b"},
        {"type": "fs_rename", "src": "a", "dst": "b"},
    ]


def test_unanswered_request_raises_sandbox_lost_and_restarts(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "REQUEST_TIMEOUT", 0.05)
    runner = Runner(fs_stat=lambda r: [])  # never replies
    sbx, backend = make(runner)
    with pytest.raises(SandboxLost, match="did not answer fs_stat"):
        sbx.files.get_info("a")
    # The silent sandbox is not trusted with the next call: a new one starts.
    assert not backend.handles[0].alive
    runner.on["fs_stat"] = lambda r: [reply({"name": "a", "type": "file", "path": "/a"})]
    assert sbx.files.get_info("a").name == "a"
    assert len(backend.handles) == 2


def test_stalled_read_raises_sandbox_lost_and_restarts(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "REQUEST_TIMEOUT", 0.05)
    sbx, backend = make(Runner(fs_read=lambda r: [{"type": "data", "data": "AA=="}]))
    with pytest.raises(SandboxLost, match="stopped sending"):
        sbx.files.read("a")
    assert not backend.handles[0].alive


# --- contexts -------------------------------------------------------------------------


def test_code_contexts(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    ctx = {"id": "c1", "language": "python", "cwd": "/home/user/w"}
    runner = Runner(
        create_context=lambda r: [reply(ctx)],
        list_contexts=lambda r: [
            reply([{"id": "default", "language": "python", "cwd": "/home/user"}, ctx])
        ],
        restart_context=lambda r: [reply()],
        remove_context=lambda r: [reply()],
        interrupt=lambda r: [reply()],
    )
    sbx, backend = make(runner)
    context = sbx.create_code_context(cwd="w")
    assert context == Context(id="c1", language="python", cwd="/home/user/w")
    assert [c.id for c in sbx.list_code_contexts()] == ["default", "c1"]
    sbx.restart_code_context()
    sbx.restart_code_context(context)
    sbx.remove_code_context(context)
    sbx.interrupt("c1")
    assert [(r["type"], r.get("context", r.get("cwd"))) for r in backend.requests] == [
        ("create_context", "w"),
        ("list_contexts", None),
        ("restart_context", "default"),
        ("restart_context", "c1"),
        ("remove_context", "c1"),
        ("interrupt", "c1"),
    ]
    assert backend.requests[0]["language"] == "python"


@pytest.mark.parametrize(
    "context", ["default", Context(id="default", language="python", cwd="/home/user")]
)
def test_default_context_cannot_be_removed(
    make: Callable[..., tuple[Sandbox, FakeBackend]], context: Any
) -> None:
    sbx, backend = make()
    with pytest.raises(InvalidArgumentError, match="default context cannot be removed"):
        sbx.remove_code_context(context)
    assert backend.requests == []


# --- argument validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"language": "r"},
        {"language": "javascript"},
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"timeout": True},
        {"timeout": "10"},
        {"context": ""},
        {"context": 3},
        {"envs": {"A=B": "x"}},
        {"envs": {"": "x"}},
        {"envs": {"A": 1}},
        {"envs": {1: "x"}},
        {"envs": {"A": "x\0y"}},
    ],
    ids=repr,
)
def test_run_code_rejects_invalid_arguments(
    make: Callable[..., tuple[Sandbox, FakeBackend]], kwargs: dict[str, Any]
) -> None:
    sbx, backend = make()
    with pytest.raises(InvalidArgumentError):
        sbx.run_code("1", **kwargs)
    assert backend.requests == []


def test_run_code_rejects_non_string_code(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    sbx, _ = make()
    with pytest.raises(InvalidArgumentError, match="code must be str"):
        sbx.run_code(b"1")  # type: ignore[arg-type]


@pytest.mark.parametrize("language", [None, "python", "py", "python3"])
def test_python_language_names(
    make: Callable[..., tuple[Sandbox, FakeBackend]], language: str | None
) -> None:
    sbx, _ = make()
    assert sbx.run_code("1", language=language).text == "2"


@pytest.mark.parametrize("path", ["", "a\0b", None, 3])
def test_file_calls_reject_invalid_paths(
    make: Callable[..., tuple[Sandbox, FakeBackend]], path: Any
) -> None:
    sbx, backend = make(Files().runner())
    for call in (
        lambda: sbx.files.read(path),
        lambda: sbx.files.read(path, format="stream"),
        lambda: sbx.files.write(path, "x"),
        lambda: sbx.files.list(path),
        lambda: sbx.files.get_info(path),
        lambda: sbx.files.exists(path),
        lambda: sbx.files.remove(path),
        lambda: sbx.files.make_dir(path),
        lambda: sbx.files.rename(path, "b"),
        lambda: sbx.files.rename("a", path),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    assert backend.requests == []


def test_other_invalid_file_arguments(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, backend = make(Files().runner())
    with pytest.raises(InvalidArgumentError, match="format"):
        sbx.files.read("a", format="json")  # type: ignore[call-overload]
    with pytest.raises(InvalidArgumentError, match="depth"):
        sbx.files.list(".", depth=0)
    assert backend.requests == []


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout": 0}, {"timeout": float("nan")}, {"envs": {"A=B": "x"}}, {"cwd": "a\0b"}],
    ids=repr,
)
def test_commands_reject_invalid_arguments(
    make: Callable[..., tuple[Sandbox, FakeBackend]], kwargs: dict[str, Any]
) -> None:
    sbx, backend = make()
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("ls", **kwargs)
    assert backend.requests == []


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), float("inf")], ids=repr)
def test_sandbox_timeout_must_be_positive(timeout: float) -> None:
    backend = FakeBackend(Runner())
    with pytest.raises(InvalidArgumentError):
        Sandbox(backend=backend, timeout=timeout)
    assert backend.handles == []


def test_invalid_resources_are_refused_before_start() -> None:
    from sandlot import PolicyError

    backend = FakeBackend(Runner())
    with pytest.raises(PolicyError):
        Sandbox(backend=backend, resources={"memory": 1})
    assert backend.handles == []


# --- AsyncSandbox ---------------------------------------------------------------------


def test_async_sandbox_with_async_callbacks() -> None:
    def cell(request: Request) -> Events:
        yield {"type": "stdout", "text": "a"}
        yield {"type": "stderr", "text": "b"}
        yield {"type": "result", "data": {"text/plain": "c"}, "is_main_result": True}
        yield {"type": "stdout", "text": "d"}
        yield {"type": "exit", "status": "ok"}

    backend = FakeBackend(Runner(execute=cell))

    async def main() -> tuple[Execution, list[tuple[str, str, bool]], int]:
        loop_thread = threading.get_ident()
        calls: list[tuple[str, str, bool]] = []

        async def on_stdout(message: OutputMessage) -> None:
            await asyncio.sleep(0)
            calls.append(("stdout", message.line, threading.get_ident() == loop_thread))

        def on_stderr(message: OutputMessage) -> None:  # plain callbacks work too
            calls.append(("stderr", message.line, threading.get_ident() == loop_thread))

        async def on_result(result: Result) -> None:
            calls.append(("result", result.text or "", threading.get_ident() == loop_thread))

        sbx = await AsyncSandbox.create(backend=backend, timeout=None)
        async with sbx:
            execution = await sbx.run_code(
                "...", on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result
            )
            assert await sbx.is_running()
        return execution, calls, len(backend.handles)

    execution, calls, starts = asyncio.run(main())
    assert execution.text == "c"
    assert calls == [
        ("stdout", "a", True),
        ("stderr", "b", True),
        ("result", "c", True),
        ("stdout", "d", True),
    ]
    assert starts == 1
    assert not backend.handle.alive  # async with killed it


def test_async_files_commands_and_lost_sandbox() -> None:
    files = Files()
    runner = files.runner()
    runner.on["command"] = lambda r: [
        {"type": "stdout", "text": "ok"},
        {"type": "exit", "status": "ok", "exit_code": 0},
    ]

    def dies(request: Request) -> Events:
        yield {"type": "stdout", "text": "partial"}
        raise Die("gone")

    runner.on["execute"] = dies
    backend = FakeBackend(runner)

    async def main() -> None:
        sbx = await AsyncSandbox.create(backend=backend, timeout=None)
        try:
            await sbx.files.write("a.txt", "hi")
            assert await sbx.files.read("a.txt") == "hi"
            assert await sbx.files.read("a.txt", format="bytes") == b"hi"
            assert await sbx.files.exists("a.txt")
            lines: list[str] = []
            result = await sbx.commands.run("echo ok", on_stdout=lambda m: lines.append(m.line))
            assert (result.stdout, result.exit_code) == ("ok", 0)
            assert lines == ["ok"]
            execution = await sbx.run_code("...")
            assert execution.status == "died"
            assert execution.logs.stdout == ["partial"]
            with pytest.raises(InvalidArgumentError):
                await sbx.remove_code_context("default")
        finally:
            await sbx.kill()

    asyncio.run(main())
    assert len(backend.handles) == 1


def test_the_testing_module_docstring_example_runs() -> None:
    import textwrap

    import sandlot.testing

    doc = sandlot.testing.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n\n", 1)[0]
    lines = block.split("\nThe fake behaves", 1)[0]
    exec(compile(textwrap.dedent(lines), "sandlot.testing docstring", "exec"), {})


# --- file metadata and watch entries ----------------------------------------------------


def test_write_sends_checked_metadata_with_every_chunk_and_reports_what_was_stored(
    make: Callable[..., tuple[Sandbox, FakeBackend]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "CHUNK_BYTES", 4)
    stored: dict[str, Any] = {}

    def write(request: Request) -> Events:
        if not request["append"]:
            stored.clear()
            stored.update(request["metadata"])
        name = request["path"]
        yield reply({"name": name, "type": "file", "path": name, "metadata": dict(stored)})

    sbx, backend = make(Runner(fs_write=write))
    info = sbx.files.write("a.bin", b"0123456789", metadata={"Author": "me"})
    assert info.metadata == {"author": "me"}  # keys lowercased before they are sent
    assert [(r["append"], r["metadata"]) for r in backend.requests] == [
        (False, {"author": "me"}),
        (True, {"author": "me"}),
        (True, {"author": "me"}),
    ]
    assert sbx.files.write("b.txt", "").metadata is None  # none: the runner clears it
    assert backend.requests[-1]["metadata"] == {}


def test_bad_metadata_sends_nothing(make: Callable[..., tuple[Sandbox, FakeBackend]]) -> None:
    sbx, backend = make(Files().runner())
    for bad in ({"a b": "v"}, {"k": "\n"}, {"A": "1", "a": "2"}, {"k": "v" * 4096}, ["k"]):
        with pytest.raises(InvalidArgumentError):
            sbx.files.write("x", "y", metadata=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            sbx.files.write_files([{"path": "x", "data": "y"}], metadata=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        sbx.files.write_files([{"path": "x"}])  # type: ignore[list-item]
    # Every path is checked before the first file is written.
    with pytest.raises(PathNotAllowedError):
        sbx.files.write_files([{"path": "ok", "data": "1"}, {"path": "/etc/x", "data": "2"}])
    assert backend.requests == []


def test_a_runners_metadata_and_entries_are_kept_by_shape_only(
    make: Callable[..., tuple[Sandbox, FakeBackend]],
) -> None:
    """The runner is untrusted: odd shapes become None or strings, never a crash."""

    def stat(request: Request) -> Events:
        yield reply({"name": "s", "type": "file", "path": "/home/user/s", "metadata": {"k": 1}})

    def watch(request: Request) -> Events:
        assert request["include_entry"] is True
        yield {"type": "watching"}
        yield {"type": "fs_event", "event": "write", "name": "a", "entry": {"size": "huge"}}
        yield {"type": "fs_event", "event": "write", "name": "b", "entry": ["not", "a", "dict"]}
        entry = {"name": "c", "type": "file", "path": "/home/user/c", "metadata": {"t": "v"}}
        yield {"type": "fs_event", "event": "write", "name": "c", "entry": entry}
        yield {"type": "exit", "status": "ok"}

    sbx, _ = make(Runner(fs_stat=stat, fs_watch=watch))
    assert sbx.files.get_info("s").metadata == {"k": "1"}
    handle = sbx.files.watch_dir(".", include_entry=True)
    assert handle.wait(10)
    events = handle.get_new_events()
    assert [(e.name, e.entry is None) for e in events] == [("a", True), ("b", True), ("c", False)]
    assert events[2].entry is not None and events[2].entry.metadata == {"t": "v"}
    with pytest.raises(InvalidArgumentError):
        sbx.files.watch_dir(".", include_entry="yes")  # type: ignore[arg-type]
