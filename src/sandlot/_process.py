"""Handles on background commands and terminals: :class:`CommandHandle`.

A core (local or remote) opens a :class:`ProcessStream` for a started or reattached
process; the handle folds its events into a :class:`sandlot.CommandResult`, shaped
as E2B's handle: ``pid``, iteration over ``(stdout, stderr, pty)`` tuples, ``wait()``
(which raises :class:`sandlot.CommandExitError` on a non-zero exit), ``kill()``,
``disconnect()``, ``send_stdin()``, ``close_stdin()``. The asyncio twin,
``AsyncCommandHandle`` (``_async.py``), wraps a handle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from sandlot._exceptions import CommandExitError, InvalidArgumentError, SandboxLost
from sandlot._models import CommandResult

__all__ = ["CommandHandle", "ProcessControl", "ProcessEvent", "ProcessStream"]


@dataclass(frozen=True, slots=True)
class ProcessEvent:
    """One event of a process stream: output, or its end (``end=True``)."""

    stdout: str | None = None
    stderr: str | None = None
    pty: bytes | None = None
    end: bool = False
    exit_code: int = -1
    """With ``end``: the exit status; ``-N`` when killed by signal N."""
    error: str | None = None
    """With ``end``: why it did not finish normally (``"timeout"``, ``"output
    truncated"``), else None."""


class ProcessStream(Protocol):
    """The events of one process, as a core delivers them (blocking iterator)."""

    @property
    def pid(self) -> int: ...

    def events(self) -> Iterator[ProcessEvent]:
        """Output, then one ``end`` event; stops early once :meth:`close` is called."""
        ...

    def close(self) -> None:
        """Stop listening; the process runs on. Idempotent, callable from any thread."""
        ...


class ProcessControl(Protocol):
    """What a handle needs of its core (a part of :class:`sandlot._core.Core`)."""

    def kill_process(self, pid: int) -> bool: ...

    def send_stdin(self, pid: int, data: bytes) -> None: ...

    def close_stdin(self, pid: int) -> None: ...


class CommandHandle:
    """A background command (or terminal) running in the sandbox.

    Returned by ``commands.run(..., background=True)``, ``commands.connect(pid)`` and
    ``pty.create(...)``. Iterate over it for ``(stdout, stderr, pty)`` tuples (one of
    the three set), or call :meth:`wait`. Output is also accumulated on
    :attr:`stdout` / :attr:`stderr`.

    Call :meth:`wait` (or iterate to the end) or :meth:`disconnect` when done with a
    handle: until then the host keeps the output it receives for it (at most
    ``output_bytes``).
    """

    def __init__(self, stream: ProcessStream, core: ProcessControl) -> None:
        self._stream = stream
        self._core = core
        self._events: Iterator[ProcessEvent] = stream.events()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._result: CommandResult | None = None

    @property
    def pid(self) -> int:
        """The process's pid in the sandbox."""
        return self._stream.pid

    @property
    def stdout(self) -> str:
        """The stdout received so far."""
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        """The stderr received so far."""
        return "".join(self._stderr)

    @property
    def exit_code(self) -> int | None:
        """The exit code once the process has ended (as seen by this handle), else None."""
        return None if self._result is None else self._result.exit_code

    @property
    def error(self) -> str | None:
        """Why the process did not finish normally, once it has ended, else None."""
        return None if self._result is None else self._result.error

    def __iter__(self) -> Iterator[tuple[str | None, str | None, bytes | None]]:
        for event in self._events:
            if event.end:
                self._result = CommandResult(self.stdout, self.stderr, event.exit_code, event.error)
                return
            if event.stdout is not None:
                self._stdout.append(event.stdout)
            elif event.stderr is not None:
                self._stderr.append(event.stderr)
            yield event.stdout, event.stderr, event.pty

    def wait(
        self,
        on_pty: Callable[[bytes], Any] | None = None,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
    ) -> CommandResult:
        """Wait for the process to end and return its result.

        Callbacks get each chunk as it arrives (``str``; ``bytes`` for a terminal).
        Raises :class:`sandlot.CommandExitError` (with the result's fields) on a
        non-zero exit, and :class:`sandlot.SandboxLost` if the handle was disconnected
        or the sandbox died before the end.
        """
        for stdout, stderr, pty in self:
            if stdout is not None and on_stdout is not None:
                on_stdout(stdout)
            elif stderr is not None and on_stderr is not None:
                on_stderr(stderr)
            elif pty is not None and on_pty is not None:
                on_pty(pty)
        if self._result is None:
            raise SandboxLost(
                f"process {self.pid}: the handle stopped listening before the process "
                "ended (disconnected); reattach with commands.connect(pid)"
            )
        if self._result.exit_code != 0:
            result = self._result
            raise CommandExitError(result.stdout, result.stderr, result.exit_code, result.error)
        return self._result

    def kill(self) -> bool:
        """Kill the process, its process group and every descendant (SIGKILL).
        False if it had already ended."""
        return self._core.kill_process(self.pid)

    def disconnect(self) -> None:
        """Stop receiving output; the process keeps running. Reattach with
        ``commands.connect(pid)``."""
        self._stream.close()

    def send_stdin(self, data: str | bytes) -> None:
        """Write to the process's stdin (it must have been started with ``stdin=True``;
        a terminal always has one)."""
        self._core.send_stdin(self.pid, input_bytes(data))

    def close_stdin(self) -> None:
        """Close the process's stdin (it reads EOF)."""
        self._core.close_stdin(self.pid)


def input_bytes(data: str | bytes) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise InvalidArgumentError(f"stdin data must be str or bytes, not {type(data).__name__}")
