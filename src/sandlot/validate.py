"""The argument checks every SDK call makes, in one place.

``Sandbox`` and ``AsyncSandbox`` run them before anything is sent (whatever the
core behind them, local or remote), and a server in front of sandlot (``sandlot
serve`` among them) runs the same ones so that bad input is a 400 before a
response starts streaming. Each check raises :class:`sandlot.InvalidArgumentError`
(or :class:`sandlot.PathNotAllowedError` for a path outside the workspace) and
returns the normalised value.
"""

from __future__ import annotations

import io
import math
import numbers
import posixpath
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any

from sandlot._exceptions import InvalidArgumentError, PathNotAllowedError
from sandlot._models import Context
from sandlot.policy import MiB, Resources
from sandlot.protocol import (
    CHUNK_BYTES,
    DEFAULT_BASH_CONTEXT,
    NAME_MAX,
    PATH_MAX,
    WORKSPACE_ROOTS,
    metadata_problem,
)

__all__ = [
    "DEFAULT_CELL_TIMEOUT",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_CONTEXT",
    "DEFAULT_SANDBOX_TIMEOUT",
    "LANGUAGES",
    "cell_context",
    "cell_timeout",
    "check_cmd",
    "check_envs",
    "check_file_path",
    "check_metadata",
    "check_path",
    "check_upload",
    "chunks",
    "context_id",
    "kernel_language",
    "known_size",
    "seconds",
    "upload_chunks",
]

DEFAULT_CELL_TIMEOUT = 60.0
"""Seconds a cell may run when ``run_code(timeout=None)``."""
DEFAULT_COMMAND_TIMEOUT = 60.0
"""Seconds a command may run when ``commands.run(timeout=None)`` (as E2B)."""
DEFAULT_SANDBOX_TIMEOUT = 300
"""Seconds a sandbox lives unless ``timeout`` says otherwise (as E2B)."""
DEFAULT_CONTEXT = "default"
"""The code context a cell runs in when none is named."""
LANGUAGES = (None, "python", "py", "python3", "bash")
"""What ``run_code(language=...)`` accepts: Python, and bash (its own persistent context)."""
_KERNELS = {None: "python", "": "python", "python": "python", "py": "python"}
_KERNELS.update(python3="python", bash="bash")


def seconds(timeout: float) -> float:
    """A timeout as positive, finite seconds, or InvalidArgumentError."""
    # Not bool (an int), not a str; NaN and inf used to pass "<= 0" and then broke the
    # deadline arithmetic (an instant host-side kill, or OverflowError in a wait).
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not math.isfinite(timeout)
        or not 0 < timeout <= threading.TIMEOUT_MAX
    ):
        raise InvalidArgumentError(f"timeout must be positive, finite seconds, not {timeout!r}")
    return float(timeout)


def cell_timeout(code: object, language: str | None, timeout: float | None) -> float:
    """Check ``run_code``'s code and language; return the cell's timeout in seconds."""
    if not isinstance(code, str):
        raise InvalidArgumentError(f"code must be str, not {type(code).__name__}")
    kernel_language(language)
    return DEFAULT_CELL_TIMEOUT if timeout is None else seconds(timeout)


def kernel_language(language: object) -> str:
    """The kernel a ``language`` names: ``"python"`` or ``"bash"``, or InvalidArgumentError."""
    kernel = _KERNELS.get(language) if language is None or isinstance(language, str) else None
    if kernel is None:
        raise InvalidArgumentError(
            f"language {language!r} is not supported: sandlot runs Python and bash "
            "(JavaScript, TypeScript, R and Java kernels are not available)"
        )
    return kernel


def cell_context(language: str | None, context: Context | str | None) -> str:
    """The context a cell runs in: the one named, or the language's default context
    (``run_code(code, language="bash")`` runs in a persistent bash context)."""
    if kernel_language(language) == "bash":
        if context is not None:
            raise InvalidArgumentError(
                "pass either language or context, not both: a context has its own language"
            )
        return DEFAULT_BASH_CONTEXT
    return context_id(context)


def check_cmd(cmd: object) -> str:
    """A shell command line: a non-empty str."""
    if not isinstance(cmd, str) or not cmd.strip():
        raise InvalidArgumentError("cmd must be a non-empty string")
    return cmd


def check_path(path: object) -> str:
    """A path to send into the sandbox: a non-empty str without NUL, of sane length."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidArgumentError(f"invalid path {path!r}")
    encoded = path.encode("utf-8", "surrogatepass")
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise InvalidArgumentError(
            f"path too long: at most {PATH_MAX} bytes, {NAME_MAX} per name ({path[:60]!r}...)"
        )
    return path


def check_file_path(path: object) -> str:
    """A files.* path: also inside the workspace once ``..`` is resolved (symlinks are
    checked inside the sandbox, where they live)."""
    checked = check_path(path)
    lexical = posixpath.normpath(posixpath.join(WORKSPACE_ROOTS[0], checked))
    if not any(lexical == root or lexical.startswith(root + "/") for root in WORKSPACE_ROOTS):
        raise PathNotAllowedError(
            f"{checked!r} is outside the sandbox workspace ({', '.join(WORKSPACE_ROOTS)}); "
            "the files API reaches only those directories"
        )
    return checked


def check_envs(envs: Mapping[str, str] | None) -> dict[str, str]:
    """Environment variables for a cell, a command or a sandbox."""
    if not envs:
        return {}
    if not isinstance(envs, Mapping):
        raise InvalidArgumentError(f"envs must be a mapping, not {type(envs).__name__}")
    checked = {}
    for key, value in envs.items():
        # NUL as in SandboxSpec: it cannot be in an environment; the runner would fail.
        if (
            not isinstance(key, str)
            or not isinstance(value, str)
            or not key
            or "=" in key
            or "\0" in key + value
        ):
            raise InvalidArgumentError(f"invalid environment variable {key!r}")
        checked[key] = value
    return checked


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A file's metadata for ``files.write``: keys lowercased (they travel as HTTP
    header names too, which know no case), then checked against the limits
    (``sandlot.protocol.METADATA_*``). None is no metadata."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(
            f"metadata must be a mapping of str to str, not {type(metadata).__name__}"
        )
    lowered: dict[str, str] = {}
    for key, value in metadata.items():
        name = key.lower() if isinstance(key, str) else key
        if name in lowered:
            raise InvalidArgumentError(f"metadata key {key!r} is given twice (keys know no case)")
        lowered[name] = value
    problem = metadata_problem(lowered)
    if problem is not None:
        raise InvalidArgumentError(problem)
    return lowered


def context_id(context: Context | str | None) -> str:
    """The id of a code context given as a Context, its id, or None (the default)."""
    if context is None:
        return DEFAULT_CONTEXT
    if isinstance(context, Context):
        return context.id
    if isinstance(context, str) and context:
        return context
    raise InvalidArgumentError(f"invalid context {context!r}")


def check_upload(resources: Resources, path: str, size: int) -> None:
    """Refuse an upload of ``size`` bytes that the sandbox's limits cannot take."""
    if resources.upload_bytes is not None and size > resources.upload_bytes:
        raise InvalidArgumentError(
            f"{path}: upload larger than the upload limit ({resources.upload_bytes} "
            "bytes); raise Resources(upload_bytes=...)"
        )
    if resources.disk_mb is not None and size > resources.disk_mb * MiB:
        raise InvalidArgumentError(
            f"{path}: upload larger than the sandbox workspace ({resources.disk_mb} MiB); "
            "raise Resources(disk_mb=...)"
        )


def known_size(data: bytes | IO[Any]) -> int | None:
    """Bytes left in ``data`` when that can be known without reading it."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    if isinstance(data, io.TextIOBase):
        return None  # positions are opaque cookies and sizes are characters
    try:
        if not data.seekable():
            return None
        position = data.tell()
        end = data.seek(0, io.SEEK_END)
        data.seek(position)
    except (AttributeError, OSError, ValueError):
        return None
    return max(0, end - position)


def chunks(data: bytes | IO[Any], size: int | None = None) -> Iterator[bytes]:
    """``data`` (bytes, or a binary or text file object) as chunks of at most ``size``
    bytes (default: the protocol's chunk size)."""
    size = CHUNK_BYTES if size is None else size  # read now: tests shrink it
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for offset in range(0, len(view), size):
            yield bytes(view[offset : offset + size])
        return
    while True:
        chunk = data.read(size)
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


def upload_chunks(
    resources: Resources, path: str, data: str | bytes | IO[Any], size: int | None = None
) -> Iterator[bytes]:
    """What ``files.write`` sends, checked against the upload limits.

    A size known up front is checked before this returns (nothing is sent); a stream
    is counted as it is read, and raises when it grows past a limit (the core then
    removes what it had written).
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    total = known_size(payload)
    if total is not None:
        check_upload(resources, path, total)
    return _counted(resources, path, chunks(payload, size))


def _counted(resources: Resources, path: str, source: Iterator[bytes]) -> Iterator[bytes]:
    total = 0
    for chunk in source:
        total += len(chunk)
        check_upload(resources, path, total)
        yield chunk
