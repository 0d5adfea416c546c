"""What the supervisor passes on from a kernel as the kernel wrote it, in-process.

A kernel's result, plain output and exit lines go to the host unencoded when they are
exactly what the supervisor would have written (``KernelProcess.on_kernel_event``).
The kernel is user code, so every line here is one it could write: the tests check
that only the canonical ones go through as they are, and that the others still reach
the host, encoded again from what the supervisor parsed (or not at all, as before).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from sandlot.protocol import encode
from sandlot.runner._contexts import VERBATIM_BYTES, Cell, Deadlines, KernelProcess, OutputBudget

RID = "0123456789abcdef-42"
A = "a" * 100
"""Text long enough that its line is not refused for its length alone."""


class FakeSupervisor:
    """The parts of the supervisor a kernel's listener uses; records what it sends."""

    def __init__(self, output_bytes: int | None = None) -> None:
        self.config: dict[str, Any] = {}
        self.output_bytes = output_bytes
        self.max_results: int | None = None
        self.result_bytes: int | None = None
        self.deadlines = Deadlines(lambda task: None)
        self.sent: list[tuple[str, bytes]] = []  # ("raw" | "encoded", line)

    def send(self, message: dict[str, Any]) -> None:
        self.sent.append(("encoded", encode(message)))

    def send_line(self, data: bytes) -> None:
        self.sent.append(("raw", data))


def _listener(output_bytes: int | None = None) -> tuple[KernelProcess, FakeSupervisor]:
    supervisor = FakeSupervisor(output_bytes)
    kernel = KernelProcess.__new__(KernelProcess)  # no kernel process: its listener alone
    kernel.supervisor = supervisor  # type: ignore[assignment]
    kernel.exec_lock = threading.Lock()
    kernel.preloaded = threading.Event()
    kernel.pipes = {}
    cell = Cell(RID, OutputBudget(supervisor, RID))  # type: ignore[arg-type]
    cell.watcher_releases = True
    kernel.cell = cell
    return kernel, supervisor


def _feed(kernel: KernelProcess, line: bytes) -> None:
    kernel.on_kernel_event(line, -1, -1, set())


def _canonical(message: dict[str, Any]) -> bytes:
    return encode({**message, "id": RID})[:-1]


@pytest.mark.parametrize(
    "message",
    [
        {"type": "result", "data": {"text/plain": "2"}, "is_main_result": True},
        {"type": "stdout", "text": "hello\n"},
        {"type": "stderr", "text": "caf\u00e9 \u2603\n"},
        {"type": "exit", "status": "ok", "execution_count": 7},
        {"type": "exit", "status": "error", "execution_count": 8},
    ],
)
def test_canonical_lines_go_on_as_they_are(message: dict[str, Any]) -> None:
    kernel, supervisor = _listener()
    line = _canonical(message)
    _feed(kernel, line)
    assert supervisor.sent == [("raw", line + b"\n")]


def _forged(text: str) -> bytes:
    return text.replace("RID", RID).replace('"A"', f'"{A}"').encode()


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        # The type or the id given twice: the start is not what the parsed line says.
        (
            _forged('{"type":"stderr","id":"RID","type":"stdout","text":"A"}'),
            {"type": "stdout", "id": RID, "text": A},
        ),
        (
            _forged('{"type":"stdout","id":"x","id":"RID","text":"A"}'),
            {"type": "stdout", "id": RID, "text": A},
        ),
        (
            _forged('{"type":"stdout","id":"RID-1","id":"RID","text":"A"}'),
            {"type": "stdout", "id": RID, "text": A},
        ),
        (
            _forged('{"type":"error","id":"RID","type":"result","data":{},"is_main_result":false}'),
            {"type": "result", "id": RID, "data": {}, "is_main_result": False},
        ),
        # Plain output with a field beside its text; padded past twice its text.
        (
            _forged('{"type":"stdout","id":"RID","text":"A","x":[0,0,0]}'),
            {"type": "stdout", "id": RID, "text": A},
        ),
        (
            _forged('{"type":"stdout","id":"RID","text":"a"' + " " * 200 + "}"),
            {"type": "stdout", "id": RID, "text": "a"},
        ),
        # A result padded past VERBATIM_BYTES.
        (
            _forged(
                '{"type":"result","id":"RID","data":{},"is_main_result":true'
                + " " * VERBATIM_BYTES
                + "}"
            ),
            {"type": "result", "id": RID, "data": {}, "is_main_result": True},
        ),
        # Exits: a field more (truncated, forged), a count that is not an int, a status
        # the supervisor handles itself.
        (
            _forged('{"type":"exit","id":"RID","status":"ok","truncated":false}'),
            {"type": "exit", "id": RID, "status": "ok"},
        ),
        (
            _forged('{"type":"exit","id":"RID","status":"ok","execution_count":3,"x":[0]}'),
            {"type": "exit", "id": RID, "status": "ok", "execution_count": 3},
        ),
        (
            _forged('{"type":"result","id":"RID","type":"exit","status":"ok","execution_count":3}'),
            {"type": "exit", "id": RID, "status": "ok", "execution_count": 3},
        ),
        (
            _forged('{"type":"exit","id":"RID","status":"ok","execution_count":true}'),
            {"type": "exit", "id": RID, "status": "ok", "execution_count": True},
        ),
        (
            _forged('{"type":"exit","id":"RID","status":"interrupted","execution_count":3}'),
            {"type": "exit", "id": RID, "status": "interrupted", "execution_count": 3},
        ),
    ],
)
def test_other_lines_are_encoded_again(line: bytes, expect: dict[str, Any]) -> None:
    kernel, supervisor = _listener()
    _feed(kernel, line)
    assert supervisor.sent == [("encoded", encode(expect))]


@pytest.mark.parametrize(
    "line",
    [
        _forged('{"type":"stdout","id":"RID-9","text":"another cell"}'),
        _forged('{"type":"stdout","id":"RID","id":"x","text":"the last id counts"}'),
        _forged('{"type":"stdout","id":"RID","text":""}'),
        b'{"type":"stdout","id":"' + RID.encode() + b'","text":"\xff"}',
        _forged('{"type":"stdout","id":"RID","text":"a"} trailing'),
    ],
)
def test_lines_for_no_one_are_dropped(line: bytes) -> None:
    kernel, supervisor = _listener()
    _feed(kernel, line)
    assert supervisor.sent == []


def test_nothing_goes_on_after_the_exit() -> None:
    kernel, supervisor = _listener()
    _feed(kernel, _canonical({"type": "exit", "status": "ok", "execution_count": 1}))
    for message in (
        {"type": "stdout", "text": "late\n"},
        {"type": "result", "data": {"text/plain": "1"}, "is_main_result": False},
        {"type": "exit", "status": "error", "execution_count": 2},
    ):
        _feed(kernel, _canonical(message))
    assert [kind for kind, _ in supervisor.sent] == ["raw"]


def test_a_cut_cell_says_so_on_its_exit() -> None:
    kernel, supervisor = _listener(output_bytes=4)
    _feed(kernel, _canonical({"type": "stdout", "text": "0123456789\n"}))
    _feed(kernel, _canonical({"type": "stdout", "text": "more\n"}))  # dropped: cut
    _feed(kernel, _canonical({"type": "exit", "status": "ok", "execution_count": 1}))
    kinds = [kind for kind, _ in supervisor.sent]
    assert kinds == ["encoded", "encoded"]
    assert "output truncated" in json.loads(supervisor.sent[0][1])["text"]
    assert json.loads(supervisor.sent[1][1]) == {
        "type": "exit",
        "id": RID,
        "status": "ok",
        "execution_count": 1,
        "truncated": True,
    }


def test_a_timed_out_cell_exits_as_timed_out() -> None:
    kernel, supervisor = _listener()
    assert kernel.cell is not None
    kernel.cell.timed_out = True
    _feed(kernel, _canonical({"type": "exit", "status": "ok", "execution_count": 1}))
    sent = [json.loads(line) for _, line in supervisor.sent]
    assert [m["type"] for m in sent] == ["error", "exit"]
    assert sent[1]["status"] == "timeout"
    assert all(kind == "encoded" for kind, _ in supervisor.sent)
