"""What a batch runs and what it returns: :class:`Program` and :class:`BatchExecution`.

Both cross process boundaries (driver -> node actor -> driver) by pickle, so they are
plain dataclasses of plain values; a Program is checked on the driver, before anything
is submitted, so bad input fails the call at once instead of as one bad Execution later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandlot import Execution, ExecutionError, InvalidArgumentError

DEFAULT_PROGRAM_TIMEOUT = 30.0
"""Seconds a program's cell may run when neither it nor the batch says otherwise."""


@dataclass(frozen=True, slots=True)
class Program:
    """One independent program of a batch: files to put in a fresh sandbox, then code.

    :param code: the cell to run; its last expression is the main result.
    :param files: ``{path: text or bytes}`` written into the workspace first (relative
        paths land in ``/home/user``).
    :param timeout: seconds the cell may run (None: the batch's ``timeout``).
    :param memory_mb: memory of the whole sandbox, MiB (None: the batch's ``memory_mb``,
        else sandlot's default).
    :param envs: environment variables for the cell's sandbox.
    :param language: the kernel, as for ``Sandbox.run_code`` (None: Python).
    """

    code: str
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    timeout: float | None = None
    memory_mb: int | None = None
    envs: Mapping[str, str] = field(default_factory=dict)
    language: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.code, str):
            raise InvalidArgumentError(f"Program.code must be a str, not {type(self.code)!r}")
        if not isinstance(self.files, Mapping):
            raise InvalidArgumentError("Program.files must be a mapping of path to str/bytes")
        for path, data in self.files.items():
            if not isinstance(path, str) or not isinstance(data, str | bytes):
                raise InvalidArgumentError(
                    f"Program.files maps str paths to str or bytes, not {path!r}: "
                    f"{type(data).__name__}"
                )
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or not self.timeout > 0
        ):
            raise InvalidArgumentError(
                f"Program.timeout must be a positive number, not {self.timeout!r}"
            )
        if self.memory_mb is not None and (
            isinstance(self.memory_mb, bool)
            or not isinstance(self.memory_mb, int)
            or self.memory_mb < 1
        ):
            raise InvalidArgumentError(
                f"Program.memory_mb must be an integer >= 1, not {self.memory_mb!r}"
            )
        if not isinstance(self.envs, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.envs.items()
        ):
            raise InvalidArgumentError("Program.envs must map str to str")

    @classmethod
    def coerce(cls, value: Program | str) -> Program:
        """A Program as is, or a bare code string as a Program with no files."""
        if isinstance(value, Program):
            return value
        if isinstance(value, str):
            return cls(value)
        raise InvalidArgumentError(f"a batch takes Program or str items, not {type(value)!r}")


@dataclass(slots=True)
class BatchExecution(Execution):
    """An :class:`sandlot.Execution` that also says where it ran.

    A program whose node left the cluster comes back with ``status == "died"`` and
    ``error.name == "SandboxLostError"``; one no node could take (none alive, all
    draining) with ``status == "error"`` and ``error.name == "NoCapacity"``."""

    node_id: str | None = None
    """The Ray node ID (hex) of the node that ran it, or held it when it was lost."""
    node_ip: str | None = None
    """That node's address."""

    @classmethod
    def of(
        cls, execution: Execution, *, node_id: str | None, node_ip: str | None
    ) -> BatchExecution:
        values = {f.name: getattr(execution, f.name) for f in dataclasses.fields(Execution)}
        return cls(**values, node_id=node_id, node_ip=node_ip)

    @classmethod
    def failed(
        cls,
        status: Any,
        name: str,
        value: str,
        *,
        node_id: str | None = None,
        node_ip: str | None = None,
    ) -> BatchExecution:
        """An outcome the program's code never produced (its node was lost, no node)."""
        return cls(
            status=status,
            error=ExecutionError(name=name, value=value),
            node_id=node_id,
            node_ip=node_ip,
        )

    def to_dict(self) -> dict[str, Any]:
        out = Execution.to_dict(self)
        out["node_id"] = self.node_id
        out["node_ip"] = self.node_ip
        return out
