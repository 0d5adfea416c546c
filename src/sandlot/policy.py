"""Sandbox policy: inert data that every backend compiles into its own settings.

Nothing here has side effects. A backend turns a :class:`SandboxSpec` into native
configuration with a pure function (for bubblewrap, ``backends.bwrap._compile``),
which is golden-tested without privileges.

Every field states its default and what ``None`` means. Defaults are the safe,
conservative choice; anything that weakens isolation is named ``allow_*`` or
``unsafe_*`` and is off by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sandlot._exceptions import PolicyError

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Resources:
    """Limits for one sandbox. ``None`` means "no limit of this kind" (never the default).

    In this release the limits are enforced per process with rlimits and by the
    runner (a best effort: N processes can together use N times ``memory_mb``);
    cgroup-exact limits for the whole sandbox are planned.
    """

    memory_mb: int | None = 2048
    """Address space per process (RLIMIT_AS), MiB. Default 2048."""
    cpu_seconds: int | None = 600
    """CPU time per process over its life (RLIMIT_CPU), seconds. Default 600.
    The per-cell wall-clock ``timeout`` is the tighter bound in practice."""
    pids: int | None = 256
    """Processes and threads the sandbox user may have at once (RLIMIT_NPROC). Default 256."""
    disk_mb: int | None = 1024
    """Size of the writable workspace ``/home/user`` (a tmpfs), MiB. Default 1024."""
    tmp_mb: int | None = 256
    """Size of the private ``/tmp`` and of ``/dev/shm`` (tmpfs each), MiB. Default 256."""
    file_size_mb: int | None = 1024
    """Largest file any process may write (RLIMIT_FSIZE), MiB. Default 1024."""
    open_files: int | None = 1024
    """Open file descriptors per process (RLIMIT_NOFILE). Default 1024."""
    output_bytes: int | None = 1 * MiB
    """stdout + stderr a single cell or command may produce before it is truncated
    with a marker. Default 1 MiB."""
    max_results: int | None = 64
    """Rich results (displays, figures) per cell; extra ones are dropped with a marker."""
    result_bytes: int | None = 16 * MiB
    """Largest single rich result (e.g. one PNG), bytes. Default 16 MiB."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise PolicyError(
                    f"resources.{f.name} must be a positive integer or None, not {value!r}"
                )

    @classmethod
    def coerce(cls, value: Resources | Mapping[str, Any] | None) -> Resources:
        """Accept a Resources, a mapping of its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, Resources):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise PolicyError(f"unknown resource(s) {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise PolicyError(f"resources must be a Resources or a mapping, not {type(value).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSpec:
    """Everything a backend needs to start one sandbox."""

    template: str = "python-data"
    """Name of the template (the Python environment the sandbox sees read-only)."""
    resources: Resources = field(default_factory=Resources)
    envs: Mapping[str, str] = field(default_factory=dict)
    """Environment variables for everything in the sandbox, on top of the minimal
    ``PATH``, ``HOME`` and ``LANG``. Nothing from the host's environment is passed."""
    allow_network: bool = False
    """Reserved: the sandbox always gets a private network namespace with only
    loopback. ``True`` is refused until the egress proxy exists."""

    def __post_init__(self) -> None:
        for key, value in self.envs.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise PolicyError("envs must map str to str")
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise PolicyError(f"invalid environment variable name or value: {key!r}")
        if self.allow_network:
            raise PolicyError(
                "allow_network=True is not supported yet: sandboxes have no network "
                "(only their own loopback)"
            )

    def with_resources(self, **changes: Any) -> SandboxSpec:
        return replace(self, resources=replace(self.resources, **changes))
