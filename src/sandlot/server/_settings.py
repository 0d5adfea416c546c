"""``ServerSettings``: everything ``sandlot serve`` can be told, as one frozen value."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from sandlot import InvalidArgumentError
from sandlot.policy import MiB, NetworkPolicy, Resources

TIMEOUT_CEILINGS = ("sandbox_timeout", "cell_timeout")
"""Per-tenant ceilings that are not resources: seconds a sandbox may live, a cell run."""


E2B_TEMPLATES: Mapping[str, str] = {
    "base": "python-data",
    "code-interpreter-v1": "python-data",
    "code-interpreter": "python-data",
}
"""The default E2B template aliases: the names the E2B SDKs create sandboxes from by
default (``base``, ``code-interpreter-v1``) run sandlot's ``python-data``."""


def check_ceilings(ceilings: Resources, where: str = "ceilings") -> None:
    """A server never runs a sandbox without a limit: every ceiling must be set."""
    missing = [name for name in Resources.__dataclass_fields__ if getattr(ceilings, name) is None]
    if missing:
        raise InvalidArgumentError(
            f"{where}: {', '.join(missing)} must have a value on a server "
            "(a tenant's request may ask for the ceiling or less, never for no limit)"
        )


def default_state_dir() -> Path:
    """Where the server keeps its database and upload spool (``$SANDLOT_SERVER_DIR``)."""
    configured = os.environ.get("SANDLOT_SERVER_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "sandlot" / "server"


@dataclass(frozen=True, slots=True)
class Quotas:
    """Per-tenant limits. A tenant's own values (``sandlot keys create``) override these."""

    max_sandboxes: int = 10
    """Sandboxes a tenant may have alive at once."""
    creates_per_minute: int = 60
    """Sandboxes a tenant may create in any 60-second window."""
    max_memory_mb: int = 16384
    """Sum of ``resources.memory_mb`` over a tenant's live sandboxes."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"quota {f.name} must be a positive integer")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Configuration of one server (one ``create_app`` call); no module globals."""

    state_dir: Path = field(default_factory=default_state_dir)
    database_url: str | None = None
    """SQLAlchemy URL of the key store and audit trail. None: SQLite in ``state_dir``."""
    keep_code: bool = True
    """Store the code of every cell in the audit trail; False keeps only its SHA-256."""
    quotas: Quotas = field(default_factory=Quotas)
    idle_ttl: float = 600.0
    """Seconds a sandbox may go unused before the reaper kills it."""
    max_sandbox_timeout: float = 24 * 3600.0
    """Largest ``timeout`` a client may ask for (and the timeout of ``timeout: null``).
    A tenant's own ``sandbox_timeout`` ceiling (``sandlot keys create --ceiling``)
    overrides it."""
    client_stall_timeout: float = 60.0
    """Seconds a client may read nothing of a cell's stream while the messages waiting
    for it are at their bound (8 MiB) before the cell is cut (``ClientTooSlow``)."""
    max_cell_timeout: float = 24 * 3600.0
    """Largest timeout of one cell or command; a tenant's ``cell_timeout`` overrides it."""
    ceilings: Resources = field(default_factory=Resources)
    """The most of each resource a tenant's sandbox may have (``sandlot serve --ceiling``;
    a tenant's own values from ``sandlot keys create --ceiling`` override them). A field
    a request leaves out gets the ceiling; a value above it is refused (400), and so is
    ``null``, which would mean no limit. Every field must be set. Default: sandlot's
    defaults (``Resources()``)."""
    e2b_templates: Mapping[str, str] = field(default_factory=lambda: dict(E2B_TEMPLATES))
    """E2B template names -> sandlot templates, for E2B's control plane
    (``sandlot serve --e2b-template NAME=TEMPLATE`` adds or overrides entries). A name
    neither here nor among the table's templates is refused (404)."""
    e2b_cell_timeout: float = 3600.0
    """Cell timeout on the E2B routes, whose client sends none (it bounds the wait itself
    and disconnects, which interrupts the cell)."""
    reap_interval: float = 1.0
    max_upload_bytes: int = 512 * MiB
    """Largest file upload; the sandbox's own ``disk_mb`` also applies."""
    max_body_bytes: int = 8 * MiB
    """Largest JSON request body (code, envs, metadata)."""
    shutdown_grace: float = 10.0
    """Seconds graceful shutdown lets running cells finish before it interrupts them."""
    worker_threads: int = 256
    """Threads for blocking sandbox calls (each running cell holds one)."""
    backend: str = "auto"
    pool_size: int = 2
    """Ready sandboxes kept per warmed template (``sandlot serve --pool-size``), started
    with the server's default resources (``ceilings``) and the data stack imported, so a
    create that leaves ``resources`` out (as the E2B client does) takes one at once. A
    shape asked for within the pool's TTL is kept warm too. 0: every create starts cold."""
    pool_templates: tuple[str, ...] = ("python-data",)
    """Templates kept warm from start-up (``sandlot serve --pool-template``)."""
    unsafe_best_effort_limits: bool = False
    """Start sandboxes even where whole-sandbox cgroup limits cannot be applied."""
    checkpointable: bool = False
    """Start every sandbox without a network policy so that it can be paused,
    snapshotted and forked (``sandlot serve --checkpointable``): a bubblewrap cold start
    instead of the warm pool's; needs root and CRIU 4.x (docs/persistence.md)."""
    egress: NetworkPolicy = field(default_factory=NetworkPolicy)
    """The most a tenant's sandbox may be allowed to reach (``sandlot serve
    --egress-allow``). A tenant's ``network.allow_out`` must lie within its
    ``allow_out`` and its caps within these caps (else 400); its ``deny_out`` is added
    to every sandbox's, and the server's proxy checks every connection against it too.
    Default: empty, so tenants cannot enable network access at all."""
    egress_hosts: Mapping[str, Sequence[str]] | None = None
    """Resolve names for the egress proxy from this table only (``name -> addresses``;
    other names do not resolve). None: the host's resolver. For air-gapped hosts,
    pinned addresses, and tests that must never look up an outside name."""

    audit_max_age: float | None = None
    """Seconds the audit trail keeps a row (cells by start, egress records by time);
    None (the default): until the row cap. ``sandlot serve --audit-max-age DAYS``. Off by
    default so that an upgrade never deletes records an operator meant to keep."""
    audit_max_rows: int | None = 1_000_000
    """Rows each audit table (cells, egress records) keeps at most, oldest deleted
    first; None: no cap. ``sandlot serve --audit-max-rows``."""
    audit_sync: Literal["normal", "full"] = "normal"
    """SQLite's commit of each audit and key row (``sandlot serve --audit-sync``):
    ``normal`` survives a crash or kill of the server (the row is in the write-ahead log
    before the cell runs); ``full`` also survives a power loss or kernel crash, at an
    fsync per row (several milliseconds per cell on common disks). PostgreSQL commits as
    its own settings say."""
    audit_prune_interval: float = 60.0
    """Seconds between two applications of the retention (also applied at start; the
    egress row cap is also applied on every write)."""

    def __post_init__(self) -> None:
        check_ceilings(self.ceilings)
        for name in ("max_sandbox_timeout", "max_cell_timeout", "client_stall_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InvalidArgumentError(f"{name} must be a positive number of seconds")
        if self.audit_max_age is not None and not self.audit_max_age > 0:
            raise InvalidArgumentError("audit_max_age must be positive (None: keep forever)")
        if self.audit_max_rows is not None and self.audit_max_rows < 1:
            raise InvalidArgumentError("audit_max_rows must be positive (None: no cap)")

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.state_dir / 'sandlot.db'}"

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def paused_dir(self) -> Path:
        """Who owns each paused sandbox and snapshot (their checkpoints are in the
        machine's checkpoint store)."""
        return self.state_dir / "checkpoints"

    def replace(self, **changes: Any) -> ServerSettings:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ServerSettings(**values)
