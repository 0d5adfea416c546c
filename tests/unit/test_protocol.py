"""The wire codec: what the host accepts from a runner it does not trust."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sandlot import protocol
from sandlot.protocol import (
    EXIT_STATUSES,
    HOST_REQUESTS,
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    RUNNER_MESSAGES,
    ProtocolViolation,
    decode,
    encode,
)

# One valid example of every message type; the tests below break them one field at a time.
VALID_EVENTS: dict[str, dict[str, Any]] = {
    "ready": {"type": "ready", "version": PROTOCOL_VERSION, "python": "3.11.9"},
    "fatal": {"type": "fatal", "reason": "limits", "message": "nofile limit 9 is above 8"},
    "started": {"type": "started", "id": "r1", "pid": 7},
    "stdout": {"type": "stdout", "id": "r1", "text": "hello\n"},
    "stderr": {"type": "stderr", "id": "r1", "text": "oops\n"},
    "result": {"type": "result", "id": "r1", "data": {"text/plain": "2"}, "is_main_result": True},
    "error": {"type": "error", "id": "r1", "name": "ValueError", "value": "x", "traceback": ""},
    "exit": {"type": "exit", "id": "r1", "status": "ok"},
    "data": {"type": "data", "id": "r1", "data": "aGk="},
    "reply": {"type": "reply", "id": "r1", "ok": True},
    "watching": {"type": "watching", "id": "r1"},
    "fs_event": {"type": "fs_event", "id": "r1", "event": "create", "name": "a.txt"},
}

VALID_REQUESTS: dict[str, dict[str, Any]] = {
    "configure": {"config": {"rlimits": {"cpu": 1}, "envs": {"A": "b"}}},
    "execute": {"code": "1", "context": "default", "envs": {}, "timeout": 1.5},
    "interrupt": {"context": "default"},
    "create_context": {"cwd": "", "language": "python"},
    "list_contexts": {},
    "restart_context": {"context": "default"},
    "remove_context": {"context": "c1"},
    "command": {"cmd": "ls", "cwd": "", "envs": {"A": "b"}, "timeout": 3},
    "process_start": {"cmd": "sleep 9", "cwd": "", "envs": {}, "timeout": 0, "stdin": True},
    "process_connect": {"pid": 7},
    "process_detach": {"target": "sbx-2"},
    "process_list": {},
    "process_kill": {"pid": 7},
    "process_stdin": {"pid": 7, "data": "aGkK"},
    "process_close_stdin": {"pid": 7},
    "pty_resize": {"pid": 7, "rows": 24, "cols": 80},
    "fs_read": {"path": "a.txt"},
    "fs_write": {"path": "a.txt", "data": "", "append": False},
    "fs_list": {"path": ".", "depth": 1},
    "fs_stat": {"path": "a.txt"},
    "fs_remove": {"path": "a.txt"},
    "fs_mkdir": {"path": "d"},
    "fs_rename": {"src": "a", "dst": "b"},
    "fs_watch": {"path": ".", "recursive": True},
    "fs_watch_stop": {"target": "sbx-2"},
    "checkpoint": {},
    "resumed": {},
    "shutdown": {},
}


def _line(message: Any) -> bytes:
    return (json.dumps(message) + "\n").encode()


def test_examples_cover_every_message_type() -> None:
    assert set(VALID_EVENTS) == set(RUNNER_MESSAGES)
    assert set(VALID_REQUESTS) == set(HOST_REQUESTS)


@pytest.mark.parametrize("kind", sorted(VALID_EVENTS))
def test_runner_message_round_trip(kind: str) -> None:
    message = VALID_EVENTS[kind]
    line = encode(message)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode(line, RUNNER_MESSAGES) == message


@pytest.mark.parametrize("kind", sorted(VALID_REQUESTS))
def test_host_request_round_trip(kind: str) -> None:
    message = {"type": kind, "id": "sbx-1", **VALID_REQUESTS[kind]}
    assert decode(encode(message), HOST_REQUESTS) == message


def test_encode_is_compact_utf8_and_escapes_newlines() -> None:
    line = encode({"type": "stdout", "id": "r1", "text": "é\nline 2"})
    assert line == '{"type":"stdout","id":"r1","text":"é\\nline 2"}\n'.encode()
    assert decode(line, RUNNER_MESSAGES)["text"] == "é\nline 2"


def test_encode_survives_lone_surrogates() -> None:
    # Text decoded with "surrogateescape" (e.g. a file name) is not valid UTF-8; it
    # must still travel (escaped) instead of failing the whole request.
    message = {"type": "stdout", "id": "r1", "text": "bad \udcff byte"}
    line = encode(message)
    assert line.endswith(b"\n")
    assert decode(line, RUNNER_MESSAGES) == message


def test_extra_fields_are_allowed() -> None:
    message = {**VALID_EVENTS["exit"], "execution_count": 3, "new_field": [1, 2]}
    assert decode(encode(message), RUNNER_MESSAGES) == message


def test_decode_rejects_oversized_line() -> None:
    line = b'{"type":"stdout","id":"r1","text":"' + b"x" * MAX_LINE_BYTES + b'"}\n'
    with pytest.raises(ProtocolViolation, match="exceeds"):
        decode(line, RUNNER_MESSAGES)


def test_decode_checks_size_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 10)
    with pytest.raises(ProtocolViolation, match="exceeds"):
        decode(b'{"type": "reply", "id": "r1", "ok": true}', RUNNER_MESSAGES)


@pytest.mark.parametrize(
    "line",
    [b"", b"not json", b'{"type": "exit"', b"\xff\xfe\x00garbage", b"{'type': 'exit'}"],
    ids=["empty", "text", "unterminated", "binary", "single-quotes"],
)
def test_decode_rejects_non_json(line: bytes) -> None:
    with pytest.raises(ProtocolViolation, match="not JSON"):
        decode(line, RUNNER_MESSAGES)


def test_decode_rejects_deeply_nested_json() -> None:
    # A hostile runner must not crash the host's reader thread with a RecursionError.
    depth = 200_000
    line = b'{"type":"result","id":"r1","is_main_result":false,"data":{"x":' + b"[" * depth
    line += b"]" * depth + b"}}\n"
    with pytest.raises(ProtocolViolation):
        decode(line, RUNNER_MESSAGES)


@pytest.mark.parametrize("value", [[], "exit", 1, None, True], ids=repr)
def test_decode_rejects_non_object(value: Any) -> None:
    with pytest.raises(ProtocolViolation, match="not a JSON object"):
        decode(_line(value), RUNNER_MESSAGES)


@pytest.mark.parametrize("kind", ["nope", None, 3, "", "execute"], ids=repr)
def test_decode_rejects_unknown_type(kind: Any) -> None:
    # "execute" is a host request, never a runner message.
    with pytest.raises(ProtocolViolation, match="unknown message type"):
        decode(_line({"type": kind, "id": "r1"}), RUNNER_MESSAGES)


def test_decode_rejects_missing_type() -> None:
    with pytest.raises(ProtocolViolation, match="unknown message type"):
        decode(_line({"id": "r1", "text": "x"}), RUNNER_MESSAGES)


def test_decode_rejects_runner_message_as_request() -> None:
    with pytest.raises(ProtocolViolation, match="unknown message type"):
        decode(_line({"type": "reply", "id": "r1", "ok": True}), HOST_REQUESTS)


_FIELD_CASES = [(kind, name) for kind, fields in RUNNER_MESSAGES.items() for name in fields]


@pytest.mark.parametrize(("kind", "name"), _FIELD_CASES)
def test_decode_rejects_missing_field(kind: str, name: str) -> None:
    message = dict(VALID_EVENTS[kind])
    del message[name]
    with pytest.raises(ProtocolViolation, match=rf"{kind}\.{name} missing"):
        decode(_line(message), RUNNER_MESSAGES)


def _wrong_value(types: tuple[type, ...]) -> Any:
    """A JSON value of none of ``types``."""
    for candidate in ("text", 1.5, {"a": 1}, [1], None):
        if not isinstance(candidate, types):
            return candidate
    raise AssertionError(types)


@pytest.mark.parametrize(("kind", "name"), _FIELD_CASES)
def test_decode_rejects_mistyped_field(kind: str, name: str) -> None:
    message = {**VALID_EVENTS[kind], name: _wrong_value(RUNNER_MESSAGES[kind][name])}
    with pytest.raises(ProtocolViolation, match=rf"{kind}\.{name}"):
        decode(_line(message), RUNNER_MESSAGES)


def test_decode_rejects_null_field() -> None:
    with pytest.raises(ProtocolViolation, match=r"stdout\.text"):
        decode(_line({"type": "stdout", "id": "r1", "text": None}), RUNNER_MESSAGES)


@pytest.mark.parametrize("value", [True, False])
def test_decode_rejects_bool_for_number(value: bool) -> None:
    # bool is an int subclass in Python; JSON true is not a number.
    with pytest.raises(ProtocolViolation, match=r"ready\.version"):
        decode(_line({**VALID_EVENTS["ready"], "version": value}), RUNNER_MESSAGES)
    request = {"type": "execute", "id": "r1", **VALID_REQUESTS["execute"], "timeout": value}
    with pytest.raises(ProtocolViolation, match=r"execute\.timeout"):
        decode(_line(request), HOST_REQUESTS)
    request = {"type": "fs_list", "id": "r1", "path": ".", "depth": value}
    with pytest.raises(ProtocolViolation, match=r"fs_list\.depth"):
        decode(_line(request), HOST_REQUESTS)


def test_decode_accepts_bool_where_bool_is_expected() -> None:
    assert decode(_line(VALID_EVENTS["reply"]), RUNNER_MESSAGES)["ok"] is True


def test_decode_rejects_int_for_bool() -> None:
    with pytest.raises(ProtocolViolation, match=r"reply\.ok"):
        decode(_line({"type": "reply", "id": "r1", "ok": 1}), RUNNER_MESSAGES)


def test_decode_rejects_float_for_int() -> None:
    with pytest.raises(ProtocolViolation, match=r"fs_list\.depth"):
        decode(_line({"type": "fs_list", "id": "r1", "path": ".", "depth": 1.0}), HOST_REQUESTS)


@pytest.mark.parametrize("status", sorted(EXIT_STATUSES))
def test_decode_accepts_every_exit_status(status: str) -> None:
    assert decode(_line({"type": "exit", "id": "r1", "status": status}), RUNNER_MESSAGES)


@pytest.mark.parametrize("status", ["OK", "", "killed", "ok "])
def test_decode_rejects_bad_exit_status(status: str) -> None:
    with pytest.raises(ProtocolViolation, match=r"exit\.status"):
        decode(_line({"type": "exit", "id": "r1", "status": status}), RUNNER_MESSAGES)


@pytest.mark.parametrize("rid", [None, 1, True, ["r1"]], ids=repr)
def test_host_requests_need_a_string_id(rid: Any) -> None:
    message: dict[str, Any] = {"type": "list_contexts"}
    if rid is not None:
        message["id"] = rid
    with pytest.raises(ProtocolViolation, match="without a string id"):
        decode(_line(message), HOST_REQUESTS)


def test_runner_messages_need_a_string_id_except_ready() -> None:
    with pytest.raises(ProtocolViolation, match=r"stdout\.id"):
        decode(_line({"type": "stdout", "id": 1, "text": "x"}), RUNNER_MESSAGES)
    assert "id" not in RUNNER_MESSAGES["ready"]


def test_protocol_violation_is_a_value_error() -> None:
    assert issubclass(ProtocolViolation, ValueError)


# --- the codec's fast path: json.loads's answer for every line ------------------------
def _outcome(parse: Any, line: bytes) -> tuple[str, Any]:
    try:
        return "ok", json.dumps(parse(line), sort_keys=True)
    except RecursionError:
        return "RecursionError", None
    except UnicodeDecodeError:
        return "UnicodeDecodeError", None
    except ValueError:
        return "ValueError", None


LOADS_EDGES = [
    b"{}",
    b'{"a":1}\n',
    b'{"a":1} \t\r\n\n',
    b'{"a":1}x',
    b'{"a":1}\n{"b":2}\n',  # two messages on one "line"
    b'{"a":1}\x00',
    b'{"a":NaN,"b":-Infinity}',
    b'{"a":"\xed\xb2\x80"}',  # a lone surrogate as raw bytes (json.loads: surrogatepass)
    b'{"a":"\xff"}',  # not UTF-8
    b"{",
    b"{\x00",
    b'{\x00"\x00a\x00"\x00:\x001\x00}\x00',  # UTF-16-LE, which json.loads detects
    '{"a":"é"}'.encode("utf-16-le"),
    '{"a":"é"}'.encode("utf-32-le"),
    b'\xef\xbb\xbf{"a":1}',  # a UTF-8 byte order mark
    b'{"a":"x","a":"y"}',
    b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"a":"\\ud800"}',
    b"[1]",
    b" {}",
]


@pytest.mark.parametrize("line", LOADS_EDGES, ids=range(len(LOADS_EDGES)))
def test_loads_answers_as_json_loads(line: bytes) -> None:
    assert _outcome(protocol.loads, line) == _outcome(json.loads, line)


def test_decode_still_rejects_what_json_loads_rejects() -> None:
    for line in (b'{"type":"ready"}x', b'{"type":"ready","version":5,"python":"\xff"}'):
        with pytest.raises(ProtocolViolation):
            decode(line, RUNNER_MESSAGES)


def test_encode_matches_json_dumps() -> None:
    """The encoder made once writes what ``json.dumps`` wrote per call."""
    messages: list[dict[str, Any]] = [
        {
            "id": "x",
            "type": "result",
            "data": {"text/plain": "é 😀", "n": 1.5},
            "is_main_result": True,
        },
        {"type": "stdout", "id": "x", "text": 'a\nb"c\\'},
        {"type": "exit", "id": "x", "status": "ok", "execution_count": 7, "nan": float("nan")},
    ]
    for message in messages:
        head = {"type": message["type"], "id": message["id"]}
        ordered = {**head, **message}
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False)
        assert encode(message) == (text + "\n").encode()
    lone = {"type": "stdout", "id": "x", "text": "\udcff"}
    assert encode(lone) == (json.dumps(lone, separators=(",", ":")) + "\n").encode()
