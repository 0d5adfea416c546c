"""The supervisor's batched writes (sandlot.runner._supervisor.Batch), in-process.

A kernel's listener keeps one Batch and enters it for every read from its kernel: what
the block sends must go to the host in one write at its end, nested blocks must not
write early, and a block left by an exception must still write what it held.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sandlot.protocol import encode
from sandlot.runner._supervisor import BATCH_BYTES, Supervisor


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.writes.append(bytes(data))


def _supervisor(tmp_path: Any) -> tuple[Supervisor, Recorder]:
    sock = Recorder()
    return Supervisor(sock, None, {"workdir": str(tmp_path)}), sock  # type: ignore[arg-type]


def _out(text: str) -> dict[str, Any]:
    return {"type": "stdout", "id": "r", "text": text}


def test_a_reused_batch_writes_once_per_block_and_nested_blocks_do_not_write(
    tmp_path: Any,
) -> None:
    supervisor, sock = _supervisor(tmp_path)
    batch = supervisor.batched()
    for round_ in range(3):
        with batch:
            supervisor.send(_out("a"))
            with supervisor.batched():
                supervisor.send(_out("b"))
            with batch:
                supervisor.send(_out("c"))
            assert len(sock.writes) == round_
        assert sock.writes[-1] == b"".join(encode(_out(t)) for t in "abc")
    with batch:
        pass
    assert len(sock.writes) == 3  # an empty block writes nothing
    supervisor.send(_out("d"))  # outside a block: at once
    assert sock.writes[-1] == encode(_out("d"))


def test_a_block_left_by_an_exception_still_writes(tmp_path: Any) -> None:
    supervisor, sock = _supervisor(tmp_path)
    batch = supervisor.batched()
    with pytest.raises(RuntimeError), batch:
        supervisor.send(_out("x"))
        raise RuntimeError
    assert sock.writes == [encode(_out("x"))]
    with batch:  # and the batch is usable again
        supervisor.send(_out("y"))
    assert sock.writes[-1] == encode(_out("y"))


def test_big_batches_are_written_as_they_fill_and_other_threads_are_not_held(
    tmp_path: Any,
) -> None:
    supervisor, sock = _supervisor(tmp_path)
    chunk = "z" * (BATCH_BYTES // 4)
    with supervisor.batched():
        for _ in range(5):
            supervisor.send(_out(chunk))
        assert len(sock.writes) == 1  # flushed once past BATCH_BYTES
        other = threading.Thread(target=supervisor.send, args=(_out("other"),))
        other.start()
        other.join()
        assert sock.writes[-1] == encode(_out("other"))
    assert b"".join(sock.writes).count(b'"stdout"') == 6
