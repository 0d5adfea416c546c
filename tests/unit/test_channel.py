"""ChannelHandle (``backends._channel``) against a real socket and a real process.

The runner shares the sandbox with untrusted code, so the host treats every byte
from the channel as hostile: a message that breaks the protocol kills the sandbox
process and fails every waiting call. The "sandbox" here is a ``sleep`` process; the
test plays the runner on the other end of a socketpair.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from sandlot._exceptions import IsolationUnavailable, SandboxLost, SandboxStartError
from sandlot.backends import _reaper
from sandlot.backends._base import EventStream
from sandlot.backends._channel import ChannelHandle
from sandlot.protocol import MAX_LINE_BYTES, PROTOCOL_VERSION, encode

READY = {"type": "ready", "version": PROTOCOL_VERSION, "python": "3.11.9"}
LIMITS = {"type": "fatal", "reason": "limits", "message": "nofile limit 9 is above 8"}


@pytest.fixture
def channel() -> Iterator[tuple[ChannelHandle, socket.socket, subprocess.Popen[bytes]]]:
    host, runner = socket.socketpair()
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    handle = ChannelHandle(host, process)
    try:
        runner.sendall(encode(READY))
        assert handle.wait_ready(5)["type"] == "ready"
        yield handle, runner, process
    finally:
        handle.kill()
        runner.close()
        if process.poll() is None:
            process.kill()
        process.wait()


def _send_behind(runner: socket.socket, data: bytes) -> threading.Thread:
    """Send ``data`` from another thread, as a runner (another process) would: the host
    reads the channel only while a caller waits, so a large send blocks until then."""
    sender = threading.Thread(target=runner.sendall, args=(data,), daemon=True)
    sender.start()
    return sender


def _request(handle: ChannelHandle, runner: socket.socket) -> tuple[EventStream, str]:
    """Send a request through the handle; return its stream and the id the runner sees."""
    stream = handle.request({"type": "fs_stat", "path": "a.txt"})
    line = runner.makefile("rb").readline()
    return stream, json.loads(line)["id"]


def test_well_formed_events_reach_their_stream(
    channel: tuple[ChannelHandle, socket.socket, subprocess.Popen[bytes]],
) -> None:
    # Control for the tests below: the same set-up with valid messages works.
    handle, runner, process = channel
    stream, rid = _request(handle, runner)
    runner.sendall(encode({"type": "reply", "id": rid, "ok": True}))
    event = stream.next(5)
    assert event is not None and event["type"] == "reply" and event["ok"] is True
    assert handle.alive and process.poll() is None


@pytest.mark.parametrize(
    "line",
    [
        b'{"type": "result", "id": 42, "forged": true}\n',  # the old hijack payload
        b"not json\n",
        b'{"type": "nope", "id": "x"}\n',
        b'{"type": "reply", "id": "x"}\n',  # a required field missing
        b"x" * (MAX_LINE_BYTES + 10) + b"\n",  # over the size limit
    ],
    ids=["forged", "not-json", "unknown-type", "missing-field", "too-long"],
)
def test_a_malformed_message_kills_the_sandbox(
    channel: tuple[ChannelHandle, socket.socket, subprocess.Popen[bytes]], line: bytes
) -> None:
    handle, runner, process = channel
    stream, _ = _request(handle, runner)
    _send_behind(runner, line)
    with pytest.raises(SandboxLost, match="protocol"):
        stream.next(10)
    assert not handle.alive
    assert "broke the protocol" in handle.death_reason
    # The sandbox process itself was killed, not only the channel dropped.
    assert process.wait(timeout=10) == -signal.SIGKILL
    # Later calls fail at once.
    with pytest.raises(SandboxLost):
        handle.request({"type": "fs_stat", "path": "b.txt"}).next(1)


# --- the start-up handshake: "ready", or "fatal" with a typed reason ----------------------


def _starting(stderr: str = "") -> tuple[ChannelHandle, socket.socket, subprocess.Popen[bytes]]:
    """A handle whose "runner" has not said ready yet; the sandbox process is a real one."""
    host, runner = socket.socketpair()
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    return ChannelHandle(host, process, stderr_tail=lambda: stderr), runner, process


def test_fatal_limits_refuses_the_sandbox_as_isolation_unavailable() -> None:
    handle, runner, process = _starting()
    try:
        runner.sendall(encode(LIMITS))
        with pytest.raises(IsolationUnavailable) as caught:
            handle.wait_ready(5)
        assert "could not apply its resource limits" in str(caught.value)
        assert "nofile limit 9 is above 8" in str(caught.value)
        assert "ulimit -H" in str(caught.value)  # says how to fix the host
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        runner.close()


def test_fatal_is_read_even_when_the_process_is_seen_dead_first() -> None:
    # The runner sends "fatal" and exits: the waiter may notice the exit before the
    # reader has read the line. The handle must still report the typed reason.
    host, runner = socket.socketpair()
    process = subprocess.Popen(["true"], stdin=subprocess.DEVNULL)
    process.wait()  # dead before the handle even starts watching it
    handle = ChannelHandle(host, process)
    runner.sendall(encode(LIMITS))
    runner.close()
    with pytest.raises(IsolationUnavailable, match="nofile limit 9"):
        handle.wait_ready(5)


def test_a_limits_line_on_stderr_alone_is_a_plain_start_failure() -> None:
    # The host decides on the typed message, not on text anyone in the sandbox could
    # write to stderr.
    handle, runner, process = _starting(stderr="sandlot runner: cannot apply resource limits")
    runner.close()
    process.kill()
    with pytest.raises(SandboxStartError) as caught:
        handle.wait_ready(5)
    assert not isinstance(caught.value, IsolationUnavailable)


def test_an_unknown_fatal_reason_is_a_start_failure_with_the_message() -> None:
    handle, runner, _ = _starting()
    try:
        runner.sendall(encode({"type": "fatal", "reason": "mystery", "message": "x" * 5000}))
        with pytest.raises(SandboxStartError, match=r"could not start \(mystery\)") as caught:
            handle.wait_ready(5)
        assert not isinstance(caught.value, IsolationUnavailable)
        assert len(str(caught.value)) < 1200  # the sandbox's text is bounded
    finally:
        runner.close()


def test_fatal_after_ready_is_ignored(
    channel: tuple[ChannelHandle, socket.socket, subprocess.Popen[bytes]],
) -> None:
    handle, runner, process = channel
    runner.sendall(encode(LIMITS) * 3)
    stream, rid = _request(handle, runner)
    runner.sendall(encode({"type": "reply", "id": rid, "ok": True}))
    event = stream.next(5)
    assert event is not None and event["type"] == "reply"
    assert handle.alive and process.poll() is None


def _execute(handle: ChannelHandle, runner: socket.socket) -> tuple[EventStream, str]:
    stream = handle.request({"type": "execute", "code": "", "context": "c", "envs": {}})
    return stream, json.loads(runner.makefile("rb").readline())["id"]


def test_results_over_the_cells_budget_are_dropped_unparsed_and_the_cell_is_told() -> None:
    # A result of two-letter strings costs the host twelve times its text once parsed.
    # The budget is result_bytes of that parsed cost per cell, checked before parsing.
    from sandlot.policy import MiB, Resources

    host, runner = socket.socketpair()
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    handle = ChannelHandle(host, process, resources=Resources(result_bytes=1 * MiB))
    try:
        runner.sendall(encode(READY))
        handle.wait_ready(5)
        stream, rid = _execute(handle, runner)
        small = {"type": "result", "id": rid, "data": {"text/plain": "1"}, "is_main_result": False}
        junk = f'{{"type":"result","id":"{rid}","is_main_result":false,"data":{{"a":['
        junk += '"ab",' * (400 * 1024 // 5) + '"x"]}}\n'  # 400 KiB of text, ~5 MiB parsed
        exit_event = encode({"type": "exit", "id": rid, "status": "ok"})
        _send_behind(runner, encode(small) + junk.encode() * 3 + encode(small) + exit_event)
        kinds = []
        while (event := stream.next(5)) is not None:
            kinds.append(event["type"])
            if event["type"] == "limit":
                assert event["limit"] == 1 * MiB
            if event["type"] == "exit":
                break
        # Both small results fit (the slack is for errors and markers); no junk did.
        assert kinds == ["result", "limit", "result", "exit"], kinds
        assert handle.alive and process.poll() is None
    finally:
        handle.kill()
        runner.close()


@pytest.mark.parametrize(
    "line",
    [
        b'{"id": "x", "type": "reply", "ok": true}\n',  # the id is not after the type
        b'{"type":"reply","ok":true,"id":"x"}\n',
        b'{"type":"reply","id":"RID","ok":true,"id":"other"}\n',  # two ids
    ],
    ids=["type-not-first", "id-not-second", "id-twice"],
)
def test_a_message_whose_type_and_id_do_not_lead_kills_the_sandbox(
    channel: tuple[ChannelHandle, socket.socket, subprocess.Popen[bytes]], line: bytes
) -> None:
    # The host charges a line to the request named at its start before parsing it, so a
    # line that names its request anywhere else could dodge that request's budget.
    handle, runner, process = channel
    stream, rid = _request(handle, runner)
    runner.sendall(line.replace(b"RID", rid.encode()))
    with pytest.raises(SandboxLost, match="protocol"):
        stream.next(5)
    assert process.wait(5) == -signal.SIGKILL


def _deep_size(value: object) -> int:
    """Bytes held by a parsed JSON value: every container and leaf once."""
    seen: set[int] = set()
    total = 0
    todo = [value]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
    return total


@pytest.mark.parametrize(
    "item",
    ['"ab",', "[],", "{},", "1.5,", '{"a":1},', "[[]],", '{"a":{}},', "1000,", '"\\u00e9",'],
)
@pytest.mark.parametrize("size", [4096, 2 * 1024 * 1024])  # counted exactly / by bytes
def test_the_cost_charged_before_parsing_covers_what_parsing_takes(item: str, size: int) -> None:
    # The budget is only as good as this estimate: measure what json.loads keeps.
    from sandlot.backends._channel import frame_cost

    text = "[" + item * (size // len(item)) + "0]"
    line = text.encode()
    # Walked object by object rather than read from tracemalloc, which counts every
    # thread's allocations (a thread another test left in this worker adds to them) and
    # misses objects the interpreter reuses from its free lists.
    value = json.loads(line)
    kept = _deep_size(value)
    del value
    _, cost = frame_cost(line)
    assert cost >= kept, (item, cost, kept)


# --- no reader thread: the waiting caller reads ------------------------------------------


def test_what_the_sandbox_sent_before_it_died_comes_before_the_loss() -> None:
    # Its exit is noticed on another thread (the reaper), possibly before anyone read
    # what it sent last: that output still reaches the cell, then SandboxLost.
    host, runner = socket.socketpair()
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    handle = ChannelHandle(host, process)
    try:
        runner.sendall(encode(READY))
        handle.wait_ready(5)
        stream, rid = _execute(handle, runner)
        runner.sendall(encode({"type": "stdout", "id": rid, "text": "last words"}))
        runner.close()
        process.kill()
        deadline = time.monotonic() + 10
        while handle.alive:  # the reaper saw the exit; nothing has read the channel yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        event = stream.next(5)
        assert event is not None and event["text"] == "last words"
        with pytest.raises(SandboxLost, match="signal 9"):
            stream.next(5)
    finally:
        handle.kill()


def test_a_large_request_does_not_deadlock_against_a_runner_that_is_writing() -> None:
    # A runner blocked writing to the host reads nothing until the host reads; the host
    # sending a request larger than the socket's buffers must read meanwhile.
    host, runner = socket.socketpair()
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    handle = ChannelHandle(host, process)
    try:
        runner.sendall(encode(READY))
        handle.wait_ready(5)
        stream, rid = _request(handle, runner)
        chatter = encode({"type": "stdout", "id": rid, "text": "x" * 1000}) * 4000  # 4 MB
        received = bytearray()

        def play_runner() -> None:
            runner.sendall(chatter)  # blocks until the host reads
            while len(received) < 4 * 1024 * 1024:
                data = runner.recv(1 << 20)
                if not data:
                    return
                received.extend(data)

        player = threading.Thread(target=play_runner, daemon=True)
        player.start()
        sender = threading.Thread(
            target=handle.request,
            args=({"type": "fs_write", "path": "a", "data": "y" * (4 * 1024 * 1024)},),
            daemon=True,
        )
        sender.start()
        sender.join(30)
        assert not sender.is_alive(), "the host's send and the runner's deadlocked"
        player.join(30)
        assert len(received) >= 4 * 1024 * 1024
        for _ in range(4000):  # and the runner's events all reached their stream
            event = stream.next(5)
            assert event is not None and event["type"] == "stdout"
    finally:
        handle.kill()
        runner.close()


def test_kill_returns_at_once_and_the_reaper_cleans_up() -> None:
    host, runner = socket.socketpair()
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    cleaned = threading.Event()
    handle = ChannelHandle(host, process, on_exit=cleaned.set)
    runner.sendall(encode(READY))
    handle.wait_ready(5)
    stream, _ = _request(handle, runner)
    handle.kill()
    assert not handle.alive
    with pytest.raises(SandboxLost, match="killed"):
        stream.next(1)
    assert _reaper.drain(10)
    assert cleaned.is_set()
    assert process.returncode == -signal.SIGKILL  # reaped, not left a zombie
    runner.close()
