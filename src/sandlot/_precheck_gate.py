"""The advisory pre-check as ``run_code`` applies it: off, report, approve or refuse.

Advice and audit only: the operating-system sandbox is the boundary, whatever this
lets through. Shared by local and remote mode (the approval hook is the caller's own
code, so it runs in the caller's process either way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, get_args

from sandlot._exceptions import InvalidArgumentError
from sandlot._models import Execution, ExecutionError
from sandlot.precheck import PrecheckReport, check

PrecheckMode = Literal["off", "report", "approve", "refuse"]
"""What ``run_code`` does with the advisory :func:`sandlot.precheck.check` report:
``off`` skips it; ``report`` (default) attaches it to the Execution; ``approve`` asks
``on_precheck`` about flagged cells; ``refuse`` refuses flagged cells."""
PrecheckHook = Callable[[str, PrecheckReport], "bool | str"]
"""``on_precheck(code, report)``: True runs the cell, False refuses it, a str runs that
code instead (an edit). Called only for flagged cells, in ``approve`` mode."""


@dataclass(frozen=True, slots=True)
class PrecheckPolicy:
    """How ``run_code`` uses the pre-check. Advice and audit only: the OS sandbox is the
    boundary, whatever this lets through."""

    mode: PrecheckMode = "report"
    hook: PrecheckHook | None = None
    allowed_imports: frozenset[str] | None = None

    @classmethod
    def build(
        cls,
        mode: str,
        hook: PrecheckHook | None,
        allowed_imports: Iterable[str] | None,
    ) -> PrecheckPolicy:
        """Validate the SDK arguments (InvalidArgumentError before anything starts)."""
        if mode not in get_args(PrecheckMode):
            raise InvalidArgumentError(
                f"precheck must be one of {', '.join(get_args(PrecheckMode))}, not {mode!r}"
            )
        if hook is not None and not callable(hook):
            raise InvalidArgumentError("on_precheck must be callable")
        if mode == "approve" and hook is None:
            raise InvalidArgumentError('precheck="approve" needs an on_precheck callback')
        if mode != "approve" and hook is not None:
            raise InvalidArgumentError(
                f'on_precheck is only used with precheck="approve", not {mode!r}'
            )
        if isinstance(allowed_imports, str):
            raise InvalidArgumentError("allowed_imports must be a collection of module names")
        imports = None if allowed_imports is None else frozenset(allowed_imports)
        if imports is not None and not all(isinstance(name, str) and name for name in imports):
            raise InvalidArgumentError("allowed_imports must hold non-empty module names")
        return cls(mode, hook, imports)  # type: ignore[arg-type]  # mode checked above

    def gate(
        self, code: str, language: str = "python"
    ) -> tuple[str, PrecheckReport | None, Execution | None]:
        """(code to run, its report, None) or (code, report, the refused Execution).

        Only Python is checked: a bash cell gets no report (it is a shell by intent)."""
        if self.mode == "off" or language != "python":
            return code, None, None
        report = _check(code, self.allowed_imports)
        if not report.flagged or self.mode == "report":
            return code, report, None
        if self.mode == "refuse":
            return code, report, refused(report, 'the precheck policy is "refuse"')
        assert self.hook is not None  # build() guarantees it in approve mode
        verdict = self.hook(code, report)
        if verdict is True:
            return code, report, None
        if isinstance(verdict, str):
            # The approver wrote this code: run it, and report on what actually runs.
            return verdict, check(verdict, allowed_imports=self.allowed_imports), None
        # False, or anything that is not a clear yes (fail closed).
        return code, report, refused(report, f"on_precheck answered {verdict!r}")


CACHED_CELL_CHARS = 4096
"""Cells up to this long have their report remembered (:func:`_check`)."""


def _check(code: str, allowed_imports: frozenset[str] | None) -> PrecheckReport:
    """:func:`check`, remembered for the last few hundred short cells: a report is
    immutable and depends on nothing but its arguments, and agents send the same small
    cells again and again (parsing one costs about ten microseconds of every cell)."""
    if len(code) > CACHED_CELL_CHARS:
        return check(code, allowed_imports=allowed_imports)
    return _check_cached(code, allowed_imports)


@functools.lru_cache(maxsize=256)
def _check_cached(code: str, allowed_imports: frozenset[str] | None) -> PrecheckReport:
    return check(code, allowed_imports=allowed_imports)


def refused(report: PrecheckReport, reason: str) -> Execution:
    value = f"the cell was not run: {reason}. Findings:\n{report.summary()}"
    return Execution(
        error=ExecutionError("PrecheckRefused", value), status="error", precheck=report
    )
