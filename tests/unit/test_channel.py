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
from collections.abc import Iterator

import pytest

from sandlot._exceptions import IsolationUnavailable, SandboxLost, SandboxStartError
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
    runner.sendall(line)
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
