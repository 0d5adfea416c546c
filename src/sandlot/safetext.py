"""Text a sandbox controls, made safe to log, store and print: :func:`escape`.

A sandbox chooses many strings the host writes down: the host names it asks the egress
proxy for (and so the reasons that quote them), HTTP methods, exception names, error
messages. Written raw, a newline forges a second log line or audit row, a terminal
escape rewrites what an operator's terminal shows, and a 64 KiB name fills a database.
Every place that logs, stores or prints such a string passes it through :func:`escape`
first, with a length cap where it is stored.

The escaped form is printable and single-line, and escaping is idempotent (escaped
text is left as it is), so every layer on the way (proxy, store, CLI) can apply it
without double escapes. Backslashes are not doubled: the form is for people and
line-oriented tools to read safely, not to be decoded back (a literal ``\\n`` the
sandbox sent and an escaped newline look the same, both saying the sandbox sent
something odd).
"""

from __future__ import annotations

__all__ = ["MIN_LIMIT", "escape"]

MIN_LIMIT = 32
"""The smallest ``limit`` :func:`escape` accepts (room for some text and the marker)."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(value: object, limit: int | None = None) -> str:
    """``value`` as printable, single-line text of at most ``limit`` characters.

    Every character that is not printable (``str.isprintable``: control characters
    such as newlines and ESC, which starts terminal escapes; line and paragraph
    separators; format characters such as bidirectional overrides; unassigned code
    points) becomes a Python-style escape (``\\n``, ``\\x1b``, ``\\u202e``). With a
    ``limit``, longer text is cut and ends with a marker saying how many characters
    of the original were left out, e.g. ``aaaa...[cut 65210 chars]``; the result,
    marker included, is never longer than ``limit``.
    """
    text = value if isinstance(value, str) else str(value)
    if limit is not None and limit < MIN_LIMIT:
        raise ValueError(f"escape: limit must be at least {MIN_LIMIT}, not {limit}")
    if (limit is None or len(text) <= limit) and text.isprintable():
        return text  # the common case, at C speed
    pieces: list[str] = []
    size = 0
    for char in text:
        piece = char if char.isprintable() else _escape_char(char)
        if limit is not None and size + len(piece) > limit:
            break
        pieces.append(piece)
        size += len(piece)
    else:
        return "".join(pieces)
    assert limit is not None
    # Cut: drop whole pieces (never half an escape) until the marker fits.
    while True:
        marker = f"...[cut {len(text) - len(pieces)} chars]"
        if size + len(marker) <= limit:
            return "".join(pieces) + marker
        size -= len(pieces.pop())


def _escape_char(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
