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

from sandlot._exceptions import SandboxLost
from sandlot.backends._base import EventStream
from sandlot.backends._channel import ChannelHandle
from sandlot.protocol import MAX_LINE_BYTES, encode

READY = {"type": "ready", "version": 1, "python": "3.11.9"}


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
