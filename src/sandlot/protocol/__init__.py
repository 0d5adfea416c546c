"""The host <-> runner wire protocol: message types and the NDJSON codec.

This module is the only code both sides of the sandbox boundary import. It is
stdlib-only and must stay importable by the guest interpreter of any template
(Python >= 3.10), because the backend mounts it read-only into the sandbox next to
``sandlot.runner``. ``docs/protocol.md`` is the normative description; this module
is its executable form.

Framing: one JSON object per line (UTF-8, ``\\n``-terminated) on a dedicated
channel (for bubblewrap, an inherited socket on fd 3), never the user's stdout.
Every message has a ``type``. Messages that belong to a request carry that
request's ``id``.

Trust: the runner shares a sandbox with untrusted code, so the host treats every
message it receives as hostile input. :func:`decode` enforces a size limit and
checks the shape of each message against :data:`RUNNER_MESSAGES`; anything else
is a :class:`ProtocolViolation`.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Tuple

from sandlot.protocol import layout as _layout

PROTOCOL_VERSION = 5
"""Bumped on any incompatible change; the runner announces it in ``ready``.
2: the ``fatal`` event. 3: background processes and terminals (``process_*``,
``pty_resize``, the ``started`` event). 4: directory watches (``fs_watch``,
``fs_watch_stop``, the ``watching`` and ``fs_event`` events). 5: file metadata
(``fs_write``'s ``metadata``, entries' ``metadata``) and entries in watch events
(``fs_watch``'s ``include_entry``, ``fs_event``'s ``entry``)."""

MAX_LINE_BYTES = 64 * 1024 * 1024
"""Largest single message the host accepts from a runner (a big PNG fits)."""

CHUNK_BYTES = 4 * 1024 * 1024
"""Size of one file chunk in ``fs_write`` requests and ``data`` events (before base64)."""

PATH_MAX = 4096
"""Longest path (UTF-8 bytes) a files.* request may name, as Linux's PATH_MAX."""
NAME_MAX = 255
"""Longest single path component (UTF-8 bytes), as Linux's NAME_MAX."""

WORKSPACE_ROOTS = _layout.WORKSPACE_ROOTS
"""The directories the files.* API may reach (see :mod:`sandlot.protocol.layout`)."""

METADATA_XATTR_PREFIX = "user.e2b."
"""Where a file's metadata lives: one extended attribute per key, this prefix then the
key. The same namespace E2B's sandboxes use, so a template's tools and a file written
through either SDK read the same metadata; other ``user.*`` attributes are not metadata."""
METADATA_KEY_MAX = 255 - len(METADATA_XATTR_PREFIX)
"""Longest metadata key (bytes): Linux's 255-byte attribute name, less the prefix."""
METADATA_HEADER = "X-Metadata-"
"""How an HTTP upload carries a file's metadata (not part of this protocol: the server's
and the remote SDK's, kept next to the limits): one ``X-Metadata-<key>: <value>`` header
per key."""
METADATA_TOTAL_MAX = 4096
"""Most metadata one file may carry (bytes): every key with the prefix, plus every
value. This also bounds the number of keys (at most 409 one-byte keys fit)."""

# --- requests: host -> runner -------------------------------------------------------
# name -> required fields (besides "type" and "id") and their JSON types.
HOST_REQUESTS: Dict[str, Dict[str, Tuple[type, ...]]] = {
    # First message on a new channel, before "ready": limits, envs, paths. Sent on the
    # channel because argv is readable by everything in the sandbox and on the host.
    "configure": {"config": (dict,)},
    "execute": {"code": (str,), "context": (str,), "envs": (dict,), "timeout": (int, float)},
    "interrupt": {"context": (str,)},
    "create_context": {"cwd": (str,), "language": (str,)},
    "list_contexts": {},
    "restart_context": {"context": (str,)},
    "remove_context": {"context": (str,)},
    "command": {"cmd": (str,), "cwd": (str,), "envs": (dict,), "timeout": (int, float)},
    # A background process (or, with an optional "pty": {"rows", "cols"}, a terminal
    # running bash) that outlives this request: answered by "started" {pid}, its output
    # (stdout/stderr; "data" for a terminal), then "exit"; or a failed "reply".
    # timeout: seconds until it is killed, 0 for none. Optional: "tag" (str).
    "process_start": {
        "cmd": (str,),
        "cwd": (str,),
        "envs": (dict,),
        "timeout": (int, float),
        "stdin": (bool,),
    },
    # Subscribe to a running process: "started", the output the runner still keeps
    # (a bounded ring), the live output, "exit"; or a failed "reply".
    "process_connect": {"pid": (int,)},
    # Stop streaming to the subscription of request ``target`` (the process runs on).
    "process_detach": {"target": (str,)},
    "process_list": {},
    "process_kill": {"pid": (int,)},
    "process_stdin": {"pid": (int,), "data": (str,)},
    "process_close_stdin": {"pid": (int,)},
    "pty_resize": {"pid": (int,), "rows": (int,), "cols": (int,)},
    "fs_read": {"path": (str,)},
    # Optional "max_bytes": int. Optional "metadata": {key: value} (str, see
    # METADATA_*): a write with append false replaces the file's metadata with it
    # (none given: the file keeps none).
    "fs_write": {"path": (str,), "data": (str,), "append": (bool,)},
    "fs_list": {"path": (str,), "depth": (int,)},
    "fs_stat": {"path": (str,)},
    "fs_remove": {"path": (str,)},
    "fs_mkdir": {"path": (str,)},
    "fs_rename": {"src": (str,), "dst": (str,)},
    # Watch a directory (optional "recursive", "include_entry": bool): answered by
    # "watching", then one "fs_event" per change until fs_watch_stop (or the directory
    # goes), then "exit"; or a failed "reply" (WatchLimitError at the sandbox's cap or
    # inotify quota).
    "fs_watch": {"path": (str,)},
    # End the watch of request ``target``; replies whether it was running.
    "fs_watch_stop": {"target": (str,)},
    # Before the host checkpoints the sandbox (CRIU): the runner answers, then puts a
    # placeholder in place of its end of this channel (CRIU cannot take a socket of the
    # host's) and waits for "resumed", which comes over the new channel the restored
    # sandbox is handed in its place; it answers that with "ready".
    "checkpoint": {},
    "resumed": {},
    "shutdown": {},
}

# --- events: runner -> host ---------------------------------------------------------
RUNNER_MESSAGES: Dict[str, Dict[str, Tuple[type, ...]]] = {
    # Sent once, without an id, when the runner is ready to take requests.
    "ready": {"version": (int,), "python": (str,)},
    # Sent at most once, without an id, INSTEAD of "ready" when the runner cannot start
    # as configured; it exits right after. ``reason`` is one of FATAL_REASONS (the host
    # treats any other as a plain start failure); ``message`` says what failed.
    "fatal": {"reason": (str,), "message": (str,)},
    # First event of process_start / process_connect: the process's pid in the sandbox.
    "started": {"id": (str,), "pid": (int,)},
    # First event of fs_watch: the directory is watched from now on.
    "watching": {"id": (str,)},
    # A change in a watched directory. event: create | write | remove | rename | chmod,
    # or "overflow" (events were lost, or a new subdirectory is past the cap); name:
    # relative to the watched directory. With include_entry, an "entry" (as fs_stat's)
    # when what the event names still exists as it is reported.
    "fs_event": {"id": (str,), "event": (str,), "name": (str,)},
    # Streamed output of an execute or command request.
    "stdout": {"id": (str,), "text": (str,)},
    "stderr": {"id": (str,), "text": (str,)},
    # A rich display (MIME bundle). ``is_main_result`` marks a cell's last expression.
    "result": {"id": (str,), "data": (dict,), "is_main_result": (bool,)},
    # The cell raised (or hit a limit: name "TimeoutError", "OutOfMemoryError", ...).
    "error": {"id": (str,), "name": (str,), "value": (str,), "traceback": (str,)},
    # Terminal event of execute and command requests.
    #   status: ok | error | timeout | oom | interrupted | died
    "exit": {"id": (str,), "status": (str,)},
    # A chunk of a file read, or of a terminal's output (base64).
    "data": {"id": (str,), "data": (str,)},
    # Terminal event of every other request. ok=False carries error={name, message}.
    "reply": {"id": (str,), "ok": (bool,)},
}

TERMINAL_EVENTS = frozenset({"exit", "reply"})

FATAL_LIMITS = "limits"
"""``fatal.reason``: a resource limit of the ``configure`` message cannot be applied
(above the hard limit the sandbox was started with). The host refuses the sandbox
(fail closed) with :class:`sandlot.IsolationUnavailable`."""
FATAL_REASONS = frozenset({FATAL_LIMITS})

KERNEL_LANGUAGES = frozenset({"python", "bash"})
"""What a code context runs: Python, or bash with its variables, functions, aliases and
working directory kept from cell to cell."""
DEFAULT_BASH_CONTEXT = "default-bash"
"""The context ``run_code(language="bash")`` runs in; made on first use."""

EXIT_STATUSES = frozenset({"ok", "error", "timeout", "oom", "interrupted", "died"})


class ProtocolViolation(ValueError):
    """A message does not follow this protocol (raised by :func:`decode`)."""


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"))
# Made once: ``json.dumps`` with any argument builds a new encoder per call, and
# ``json.loads`` of bytes sniffs their encoding first; both are a few microseconds
# of every message, and a cell's round trip is a dozen messages.
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def encode(message: Mapping[str, Any]) -> bytes:
    """Serialise one message to a newline-terminated line of compact JSON.

    ``type`` and ``id`` come first: the host reads them off the start of a line to
    route it, and to account for its cost, before it parses the rest (see
    ``docs/protocol.md``, "Framing").
    """
    if "type" in message:
        head = {"type": message["type"]}
        if "id" in message:
            head["id"] = message["id"]
        message = {**head, **message}
    text = _ENCODER.encode(message)
    try:
        return (text + "\n").encode()
    except UnicodeEncodeError:
        # Lone surrogates (text decoded with "surrogateescape", e.g. a file name) are
        # not UTF-8. ASCII-escaped JSON carries them as \udcxx and decodes them back.
        return (_ASCII_ENCODER.encode(message) + "\n").encode()


def loads(line: bytes) -> Any:
    """``json.loads(line)`` for one protocol line, without its per-call overhead.

    The same result and the same errors (``ValueError``, ``UnicodeDecodeError``,
    ``RecursionError``) as ``json.loads`` for every input: a line that starts with
    ``{`` and no NUL is UTF-8 by JSON's own detection rule and is parsed here;
    anything else (UTF-16 and -32 start with a NUL byte) goes to ``json.loads``.
    """
    if line[:1] != b"{" or line[1:2] == b"\x00":
        return json.loads(line)
    text = line.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
    value, end = _DECODER.raw_decode(text)
    if end != len(text) and text[end:].strip(_WHITESPACE):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def decode(line: bytes, schema: Mapping[str, Mapping[str, Tuple[type, ...]]]) -> Dict[str, Any]:
    """Parse and validate one line against ``schema`` (``RUNNER_MESSAGES`` or ``HOST_REQUESTS``).

    Raises :class:`ProtocolViolation` for oversized lines, invalid JSON, unknown
    types, and missing or mistyped fields. Extra fields are allowed so that a newer
    peer can add optional data without breaking an older one.
    """
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolViolation(f"message of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        message = loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: deeply nested arrays (cheap to send, fatal to an unguarded
        # reader thread) are a violation like any other malformed input.
        raise ProtocolViolation(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolViolation("message is not a JSON object")
    kind = message.get("type")
    fields = schema.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolViolation(f"unknown message type {kind!r}")
    if schema is HOST_REQUESTS and not isinstance(message.get("id"), str):
        raise ProtocolViolation(f"{kind} request without a string id")
    for name, types in fields.items():
        value = message.get(name)
        # bool is an int subclass; never accept it where a number is expected.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolViolation(f"{kind}.{name} missing or not {types[0].__name__}")
    if kind == "exit" and message["status"] not in EXIT_STATUSES:
        raise ProtocolViolation(
            f"exit.status {message['status']!r} is not one of {sorted(EXIT_STATUSES)}"
        )
    return message


_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
"""The characters of a metadata key: an HTTP header name's (RFC 9110 ``token``), so a
key travels as an ``X-Metadata-<key>`` header too."""


def metadata_problem(metadata: Any) -> str | None:
    """What is wrong with ``metadata`` (a file's: {key: value}), or None if nothing is.

    Keys: non-empty, lowercase, HTTP token characters, at most
    :data:`METADATA_KEY_MAX` bytes; values: printable ASCII (space to ``~``); all of it
    within :data:`METADATA_TOTAL_MAX`. Both sides check it: the host before it sends a
    write, the runner before it stores one.
    """
    if not isinstance(metadata, dict):
        return "metadata must be a mapping of str keys to str values"
    total = 0
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return "metadata keys and values must be str, not %s: %s" % (
                type(key).__name__,
                type(value).__name__,
            )
        if not key or not set(key) <= _TOKEN or key != key.lower():
            return (
                "invalid metadata key %r: keys are non-empty, lowercase, and use only "
                "letters, digits and !#$%%&'*+-.^_`|~" % key[:64]
            )
        if len(key) > METADATA_KEY_MAX:
            return "metadata key %r... is longer than %d bytes" % (key[:32], METADATA_KEY_MAX)
        if any(not " " <= c <= "~" for c in value):
            return "invalid metadata value for key %r: values must be printable ASCII" % key
        total += len(METADATA_XATTR_PREFIX) + len(key) + len(value)
    if total > METADATA_TOTAL_MAX:
        return (
            "metadata of %d bytes is over the limit of %d (keys, each with %d bytes of "
            "prefix, plus values)" % (total, METADATA_TOTAL_MAX, len(METADATA_XATTR_PREFIX))
        )
    return None
