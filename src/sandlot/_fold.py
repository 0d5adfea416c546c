"""Folding protocol events into result values (pure; shared by the sync and async SDKs).

The runner enforces output limits itself, but it shares a sandbox with untrusted
code, so the host enforces them again here and never trusts a count it was sent.
What a cell may make the host parse is bounded earlier, where its bytes arrive
(:mod:`sandlot.backends._channel`); that layer reports what it dropped with a host-made
``limit`` event, folded here into ``truncated`` and a marker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandlot._models import (
    CommandResult,
    Execution,
    ExecutionError,
    ExecutionStatus,
    OutputMessage,
    Result,
)
from sandlot.policy import Resources

TRUNCATION_MARKER = "\n[sandlot: output truncated: more than {limit} bytes of stdout/stderr]\n"
LIMIT_MARKER = (
    "[sandlot: this cell sent more than {limit} bytes of results (counted as the host "
    "would hold them once parsed); the host dropped the rest unread]\n"
)
# The runner's own marker and a partial UTF-8 sequence may push a cell a little over.
_SLACK = 4096


_STREAM_ONLY = "__sandlot_stream_only__"


def stream_only(callback: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an output or result callback as taking what it is given *instead of* the
    Execution: what it receives is not also kept in ``logs`` / ``results``. For callers
    that forward everything and need only the outcome (the server), so that the memory
    a cell costs them does not grow with its output."""

    def forward(value: Any) -> Any:
        return callback(value)

    setattr(forward, _STREAM_ONLY, True)
    return forward


def _keeps(callback: Callable[..., Any] | None) -> bool:
    return callback is None or not getattr(callback, _STREAM_ONLY, False)


@dataclass(slots=True)
class Callbacks:
    on_stdout: Callable[[OutputMessage], Any] | None = None
    on_stderr: Callable[[OutputMessage], Any] | None = None
    on_result: Callable[[Result], Any] | None = None
    on_error: Callable[[ExecutionError], Any] | None = None


class ExecutionBuilder:
    """Accumulates one cell's events into an :class:`Execution`, calling callbacks."""

    def __init__(self, resources: Resources, callbacks: Callbacks | None = None) -> None:
        self.execution = Execution()
        self.callbacks = callbacks or Callbacks()
        self._output_limit = resources.output_bytes
        self._max_results = resources.max_results
        self._result_bytes = resources.result_bytes
        self._output_used = 0
        self._results = 0
        self._marked = False
        self._markers: set[str] = set()
        self.finished = False

    def add(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind in ("stdout", "stderr"):
            self._text(kind, event["text"])
        elif kind == "result":
            self._result(event)
        elif kind == "error":
            self.set_error(ExecutionError(event["name"], event["value"], event["traceback"]))
        elif kind == "exit":
            self._exit(event)
        elif kind == "limit":
            self._dropped(LIMIT_MARKER.format(limit=event.get("limit")))

    def _text(self, kind: str, text: str) -> None:
        if self._output_limit is not None:
            if self._marked:
                return  # already cut: drop everything after the marker
            data = text.encode("utf-8", "replace")
            room = self._output_limit + _SLACK - self._output_used
            self._output_used += len(data)
            if len(data) > room:
                # Cut once, with the marker. room can be 0 when earlier chunks filled the
                # budget exactly; the marker must still show (it used to be skipped then).
                text = data[:room].decode("utf-8", "ignore")
                text += TRUNCATION_MARKER.format(limit=self._output_limit)
                self.execution.truncated = True
                self._marked = True
        logs = self.execution.logs.stdout if kind == "stdout" else self.execution.logs.stderr
        callback = self.callbacks.on_stdout if kind == "stdout" else self.callbacks.on_stderr
        if _keeps(callback):
            logs.append(text)
        if callback is not None:
            callback(OutputMessage(text, error=kind == "stderr"))

    def _result(self, event: dict[str, Any]) -> None:
        if self._max_results is not None and self._results >= self._max_results:
            self._dropped(
                f"[sandlot: more than {self._max_results} results in one cell; "
                "the rest were dropped]\n"
            )
            return
        if (
            self._result_bytes is not None
            and len(json.dumps(event["data"])) > self._result_bytes + _SLACK
        ):
            self._dropped(
                f"[sandlot: a result larger than {self._result_bytes} bytes was dropped]\n"
            )
            return
        result = Result.from_bundle(event["data"], is_main_result=event["is_main_result"])
        self._results += 1
        if _keeps(self.callbacks.on_result):
            self.execution.results.append(result)
        if self.callbacks.on_result is not None:
            self.callbacks.on_result(result)

    def _dropped(self, marker: str) -> None:
        """A result the host refused (the runner should have); say so, once per reason."""
        self.execution.truncated = True
        if marker in self._markers:
            return
        self._markers.add(marker)
        self.execution.logs.stderr.append(marker)
        if self.callbacks.on_stderr is not None:
            self.callbacks.on_stderr(OutputMessage(marker, error=True))

    def set_error(self, error: ExecutionError) -> None:
        if self.execution.error is None:
            self.execution.error = error
            if self.callbacks.on_error is not None:
                self.callbacks.on_error(error)

    def _exit(self, event: dict[str, Any]) -> None:
        self.finished = True
        status: ExecutionStatus = event["status"]
        self.execution.status = status
        count = event.get("execution_count")
        if isinstance(count, int) and not isinstance(count, bool):
            self.execution.execution_count = count
        if event.get("truncated") is True:
            self.execution.truncated = True
        if status != "ok" and self.execution.error is None:
            # The runner always sends an error first; a hostile one might not.
            self.set_error(ExecutionError("SandboxError", f"the cell ended with status {status}"))

    def abort(self, status: ExecutionStatus, name: str, value: str) -> Execution:
        """End the cell from the host side (sandbox lost, host-side timeout)."""
        self.finished = True
        self.execution.status = status
        self.execution.error = None
        self.set_error(ExecutionError(name, value))
        return self.execution


class CommandBuilder:
    """Accumulates a command's events into a :class:`CommandResult`."""

    def __init__(self, resources: Resources, callbacks: Callbacks | None = None) -> None:
        self._inner = ExecutionBuilder(resources, callbacks)
        self.exit_code = -1
        self.error: str | None = None
        self.finished = False

    def add(self, event: dict[str, Any]) -> None:
        if event["type"] == "exit":
            self.finished = True
            code = event.get("exit_code")
            self.exit_code = code if isinstance(code, int) and not isinstance(code, bool) else -1
            if event["status"] == "timeout":
                self.error = "timeout"
            elif event["status"] not in ("ok", "error"):
                self.error = event["status"]
            if event.get("truncated") is True:
                self._inner.execution.truncated = True
            return
        if event["type"] in ("stdout", "stderr", "limit"):
            self._inner.add(event)

    def abort(self, error: str) -> None:
        self.finished = True
        self.error = error

    def result(self) -> CommandResult:
        logs = self._inner.execution.logs
        error = self.error
        if error is None and self._inner.execution.truncated:
            error = "output truncated"
        return CommandResult(
            stdout="".join(logs.stdout),
            stderr="".join(logs.stderr),
            exit_code=self.exit_code,
            error=error,
        )
