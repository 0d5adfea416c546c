"""The sandbox registry: who owns which sandbox, quotas, expiry, and shutdown.

Sandboxes are ordinary local :class:`sandlot.Sandbox` objects; the manager adds
ownership (a tenant sees only its own: any other id is "not found"), quotas
checked and reserved under one lock (so concurrent creates cannot overshoot), a
server-side expiry (``timeout``) and idle TTL enforced by :meth:`reap`, and the
bookkeeping that lets a restarted server clean up after a crash.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandlot import (
    InvalidArgumentError,
    IsolationUnavailable,
    Pool,
    QuotaExceeded,
    Resources,
    Sandbox,
    SandlotError,
    SnapshotInfo,
)
from sandlot.backends import (
    Backend,
    RecoveryToken,
    SandboxHandle,
    cleanup_orphans,
    get_backend,
    reap,
)
from sandlot.safetext import escape
from sandlot.server._egress import ServerEgress, policy_dict
from sandlot.server._settings import Quotas, ServerSettings
from sandlot.server._store import Principal, Store

log = logging.getLogger("sandlot.server")
PROBE_SECONDS = 2.0
"""How long the reaper waits for idle sandboxes to say whether a background process
runs in them; one that has not answered by then is idle."""
DEFAULT_MARK = "sandlot:default"
"""Metadata key of a tenant's default sandbox (the one ``/e2b`` uses)."""


class ApiError(Exception):
    """An HTTP error with a machine-readable ``type`` (the server turns it into JSON)."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message


@dataclass(eq=False)
class ManagedSandbox:
    sandbox: Sandbox
    tenant: str
    template: str
    metadata: dict[str, str]
    resources: Resources
    created_at: float
    expires_at: float
    last_used: float
    active: int = 0
    """Requests in progress; a sandbox is never idle-reaped while one runs."""
    auto_pause: bool = False
    """Paused, not killed, when its timeout comes (E2B's ``on_timeout: "pause"``)."""
    pausing: bool = False
    wire: dict[str, Any] = field(default_factory=dict)
    """What the E2B wire keeps of it across a pause (its access token, E2B template)."""

    @property
    def sandbox_id(self) -> str:
        return self.sandbox.sandbox_id

    def info(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "template": self.template,
            "metadata": dict(self.metadata),
            "resources": _resources_dict(self.resources),
            "started_at": self.created_at,
            "expires_at": self.expires_at,
            "running": self.sandbox.is_running(),
            "restarts": self.sandbox.restarts,
            "network": policy_dict(self.sandbox.network),
        }


@dataclass
class RunningCell:
    execution_id: str
    entry: ManagedSandbox
    context: str
    done: threading.Event = field(default_factory=threading.Event)
    interrupted_by: str | None = None


def _resources_dict(resources: Resources) -> dict[str, int | float | None]:
    return {name: getattr(resources, name) for name in Resources.__dataclass_fields__}


class SandboxManager:
    """Owns every sandbox the server started. Thread-safe; methods block (call them in threads)."""

    def __init__(
        self, settings: ServerSettings, store: Store, egress: ServerEgress | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.egress = egress or ServerEgress(settings, store)
        self._lock = threading.Lock()
        self._sandboxes: dict[str, ManagedSandbox] = {}
        self._pending: collections.Counter[str] = collections.Counter()
        self._pending_memory: collections.Counter[str] = collections.Counter()
        self._creations: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque
        )
        self.running: dict[str, RunningCell] = {}
        self._destroyer = ThreadPoolExecutor(8, thread_name_prefix="sandlot-destroy")
        self._prober = ThreadPoolExecutor(8, thread_name_prefix="sandlot-probe")
        """Asks idle sandboxes whether a background process runs (see :meth:`reap`)."""
        self._default_lock = threading.Lock()
        self.closing = False
        self.on_change: list[Any] = []
        """Called with the number of live sandboxes whenever it changes."""
        self.pool: Pool | None = (
            Pool(settings.pool_size, backend=settings.backend) if settings.pool_size else None
        )
        """The warm pool creates without a network policy take their sandbox from."""
        self.on_end: list[Any] = []
        """Called with a sandbox's end reason ("killed", "idle", "expired", ...), under
        the registry's lock: whoever sees the sandbox gone (a 404) sees it counted."""

    # --- start-up -----------------------------------------------------------------------
    def recover(self) -> dict[str, Any]:
        """Clean up what a previous server left: sandboxes, backends' orphans, open rows,
        upload spool.

        Backend-neutral: each sandbox the previous server left open is handed back to
        its backend's :meth:`~sandlot.backends.Backend.reap` with the recovery token
        stored when it started (bwrap sandboxes normally died with the server,
        ``--die-with-parent``; a survivor is killed only if its pid still belongs to the
        same process). Then every declared backend's ``cleanup_orphans()`` runs
        (sandbox cgroups of dead processes; containers whose creating process is gone,
        on each engine that answers; absent engines are skipped). Sandboxes and cells
        the previous server left open are closed in the database (cells become
        ``killed``).
        """
        killed = 0
        for backend, token in self.store.unfinished_recovery_tokens():
            if reap(backend, token):
                killed += 1
        boxes, cells = self.store.close_orphans()
        orphans = {name: len(removed) for name, removed in cleanup_orphans().items()}
        spooled = 0
        spool = self.settings.spool_dir
        if spool.is_dir():
            # Only the server's own upload files (see _routes' spooled uploads): anything
            # else there is not this server's to delete, and a directory cannot be unlinked.
            for leftover in spool.glob("upload-*"):
                if leftover.is_symlink() or not leftover.is_dir():
                    leftover.unlink(missing_ok=True)
                    spooled += 1
        spool.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            "sandboxes_closed": boxes,
            "sandboxes_reaped": killed,
            "orphans_removed": orphans,
            "cells_marked_killed": cells,
            "spool_files_removed": spooled,
        }
        if any(report.values()):
            log.warning("recovered from an unclean shutdown: %s", report)
        return report

    # --- create / find / kill -------------------------------------------------------------
    def create(
        self,
        principal: Principal,
        *,
        template: str,
        timeout: float | None,
        envs: Mapping[str, str],
        metadata: Mapping[str, str],
        resources: Mapping[str, Any] | None,
        network: Mapping[str, Any] | None = None,
        snapshot: str | None = None,
        auto_pause: bool = False,
    ) -> ManagedSandbox:
        """``network``: the fields of a network policy the tenant set (see
        :meth:`ServerEgress.policy_for`); None or no ``allow_out``: no network.
        ``snapshot``: start from this snapshot of the tenant's (its template, limits
        and envs) instead of afresh."""
        if self.closing:
            raise ApiError(503, "ShuttingDown", "the server is shutting down")
        if snapshot is not None:
            owned = self._owned_checkpoint(principal, snapshot, "snapshot")
            template = str(owned["template"])
            resources = owned["resources"]
            network = None
        spec = self.resources_for(principal.tenant, resources)
        policy = self.egress.policy_for(
            network, self.store.tenant_egress(principal.tenant) if network else None
        )
        if spec.memory_mb is None:
            raise InvalidArgumentError(
                "resources.memory_mb must be set on a server (it counts against the tenant's "
                "memory quota)"
            )
        lifetime = self._lifetime(timeout, principal.tenant)
        tenant = principal.tenant
        self._reserve(tenant, spec.memory_mb)
        try:
            # Sandboxes with a policy use the server's proxy (its ceiling, resolver
            # and audit trail), never the process-wide one.
            backend = self.settings.backend
            checkpointable = self.settings.checkpointable and not policy.enabled
            sandbox = Sandbox(
                template if snapshot is None else snapshot,
                backend=get_backend(backend, egress=self.egress.proxy)
                if policy.enabled
                else backend,
                network=policy,
                resources=spec,
                envs=dict(envs),
                timeout=None,  # the manager expires it (see reap), so it is accounted for
                metadata=dict(metadata),
                unsafe_best_effort_limits=self.settings.unsafe_best_effort_limits,
                # A ready one when there is one; a sandbox with a network policy has its
                # own proxy wiring and always starts cold, and so does a checkpointable one.
                pool=None if policy.enabled or checkpointable else self.pool,
                checkpointable=checkpointable,
            )
        except IsolationUnavailable as exc:
            self._release(tenant, spec.memory_mb)
            if "hard limit" in str(exc):
                # The request asks for more than this host allows: the client's to fix.
                raise InvalidArgumentError(str(exc)) from exc
            raise
        except BaseException:
            self._release(tenant, spec.memory_mb)
            raise
        entry = self._register(sandbox, tenant, template, metadata, spec, lifetime)
        entry.auto_pause = auto_pause
        return entry

    def _register(
        self,
        sandbox: Sandbox,
        tenant: str,
        template: str,
        metadata: Mapping[str, str],
        spec: Resources,
        lifetime: float,
        *,
        resumed: bool = False,
    ) -> ManagedSandbox:
        """Record and register a sandbox started for ``tenant`` (its memory reserved)."""
        assert spec.memory_mb is not None
        now = time.time()
        entry = ManagedSandbox(
            sandbox=sandbox,
            tenant=tenant,
            template=template,
            metadata=dict(metadata),
            resources=spec,
            created_at=now,
            expires_at=now + lifetime,
            last_used=now,
        )
        backend_name, token = _recovery(sandbox)
        try:
            if resumed:
                self.store.sandbox_resumed(entry.sandbox_id, backend=backend_name, recovery=token)
            else:
                self.store.sandbox_started(
                    entry.sandbox_id, tenant, template, backend=backend_name, recovery=token
                )
        except BaseException:
            self._release(tenant, spec.memory_mb)
            sandbox.kill()
            raise
        with self._lock:
            self._pending[tenant] -= 1
            self._pending_memory[tenant] -= spec.memory_mb
            self._sandboxes[entry.sandbox_id] = entry
            self._changed_locked()
        log.info(
            "sandbox %s %s for tenant %s",
            entry.sandbox_id,
            "resumed" if resumed else "created",
            tenant,
        )
        return entry

    # --- pause, resume, snapshots, fork -----------------------------------------------
    # The checkpoints themselves are in the machine's checkpoint store (the SDK's);
    # who owns each, and what the E2B wire needs to hand it back, is a JSON file of
    # the server's in ``settings.paused_dir``, so both survive a restart.
    def _owner_file(self, checkpoint_id: str) -> Path:
        if not checkpoint_id or not all(c.isalnum() or c == "-" for c in checkpoint_id):
            raise ApiError(404, "NotFound", f"{checkpoint_id!r} was not found")
        return self.settings.paused_dir / f"{checkpoint_id}.json"

    def _write_owner(self, checkpoint_id: str, record: Mapping[str, Any]) -> None:
        directory = self.settings.paused_dir
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._owner_file(checkpoint_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(record)))
        os.replace(tmp, path)

    def _owned_checkpoint(
        self, principal: Principal, checkpoint_id: str, kind: str
    ) -> dict[str, Any]:
        """The record of the tenant's paused sandbox or snapshot; 404 for any other."""
        try:
            record: dict[str, Any] = json.loads(self._owner_file(checkpoint_id).read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("tenant") != principal.tenant or record.get("kind") != kind:
            what = "snapshot" if kind == "snapshot" else "paused sandbox"
            raise ApiError(404, "NotFound", f"{what} {checkpoint_id!r} was not found")
        return record

    def paused(self, principal: Principal, sandbox_id: str) -> dict[str, Any] | None:
        """The record of the tenant's paused sandbox ``sandbox_id``, or None."""
        try:
            return self._owned_checkpoint(principal, sandbox_id, "pause")
        except ApiError:
            return None

    def checkpoints_of(self, principal: Principal, kind: str) -> list[dict[str, Any]]:
        return self._records_of(principal.tenant, kind)

    def _records_of(self, tenant: str, kind: str) -> list[dict[str, Any]]:
        directory = self.settings.paused_dir
        found = []
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record.get("tenant") == tenant and record.get("kind") == kind:
                found.append(record)
        return found

    def _room_for_checkpoint(self, entry: ManagedSandbox) -> None:
        """400 unless the server starts checkpointable sandboxes; 429 unless the
        tenant's checkpoints leave room for one more of this sandbox (at most its
        memory, disk and /tmp limits)."""
        if not self.settings.checkpointable:
            raise ApiError(
                400,
                "CheckpointError",
                "this server's sandboxes cannot be paused, snapshotted or forked: its "
                "operator starts it with sandlot serve --checkpointable to allow it",
            )
        used = sum(
            int(r.get("size") or 0)
            for kind in ("pause", "snapshot")
            for r in self._records_of(entry.tenant, kind)
        )
        r = entry.resources
        most = ((r.memory_mb or 0) + (r.disk_mb or 0) + (r.tmp_mb or 0)) * 1024 * 1024
        quota = self._quotas(entry.tenant).max_checkpoint_mb
        if used + most > quota * 1024 * 1024:
            raise QuotaExceeded(
                f"tenant {entry.tenant!r} has {used // (1024 * 1024)} MiB of paused sandboxes "
                f"and snapshots; one more of this sandbox may take {most // (1024 * 1024)} MiB "
                f"and the quota is {quota} MiB (delete snapshots or kill paused sandboxes)"
            )

    def expire_checkpoints(self) -> list[str]:
        """Delete the paused sandboxes and snapshots older than ``checkpoint_ttl``."""
        ttl = self.settings.checkpoint_ttl
        directory = self.settings.paused_dir
        now = time.time()
        gone = []
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            born = float(record.get("paused_at") or record.get("created") or now)
            if now - born < ttl:
                continue
            checkpoint_id = str(record.get("id"))
            try:
                if record.get("kind") == "snapshot":
                    Sandbox.delete_snapshot(checkpoint_id)
                else:
                    Sandbox.kill(checkpoint_id)
            except SandlotError:
                log.exception("could not delete expired checkpoint %s", checkpoint_id)
                continue
            path.unlink(missing_ok=True)
            gone.append(checkpoint_id)
        return gone

    def pause(self, entry: ManagedSandbox) -> None:
        """Checkpoint the sandbox and let it go: unregistered (it counts against no
        quota while paused, and has no timeout), recorded as ended ``paused``, its
        owner's record written (with :attr:`ManagedSandbox.wire`)."""
        self._room_for_checkpoint(entry)
        entry.sandbox.pause()
        with self._lock:
            self._unregister_locked(entry, "paused")
        self._write_owner(
            entry.sandbox_id,
            {
                "kind": "pause",
                "id": entry.sandbox_id,
                "tenant": entry.tenant,
                "template": entry.template,
                "metadata": entry.metadata,
                "resources": _resources_dict(entry.resources),
                "created_at": entry.created_at,
                "paused_at": time.time(),
                "auto_pause": entry.auto_pause,
                "wire": dict(entry.wire),
                "size": Sandbox.checkpoint_size(entry.sandbox_id),
            },
        )
        try:
            self.store.sandbox_ended(entry.sandbox_id, "paused")
        except Exception:
            log.exception("could not record the pause of sandbox %s", entry.sandbox_id)

    def resume(
        self, principal: Principal, sandbox_id: str, timeout: float | None
    ) -> ManagedSandbox:
        """The tenant's paused sandbox, running again under its id (its memory is
        reserved against the tenant's quota again)."""
        if self.closing:
            raise ApiError(503, "ShuttingDown", "the server is shutting down")
        record = self._owned_checkpoint(principal, sandbox_id, "pause")
        spec = Resources.coerce(record["resources"])
        assert spec.memory_mb is not None
        lifetime = self._lifetime(timeout, principal.tenant)
        self._reserve(principal.tenant, spec.memory_mb)
        try:
            sandbox = Sandbox.connect(sandbox_id)
        except BaseException:
            self._release(principal.tenant, spec.memory_mb)
            raise
        self._owner_file(sandbox_id).unlink(missing_ok=True)
        entry = self._register(
            sandbox, principal.tenant, str(record["template"]), record.get("metadata") or {},
            spec, lifetime, resumed=True,
        )  # fmt: skip
        entry.auto_pause = bool(record.get("auto_pause"))
        entry.wire = dict(record.get("wire") or {})
        return entry

    def create_snapshot(self, entry: ManagedSandbox, name: str | None) -> SnapshotInfo:
        self._room_for_checkpoint(entry)
        info = entry.sandbox.create_snapshot(name)
        self._write_owner(
            info.snapshot_id,
            {
                "kind": "snapshot",
                "id": info.snapshot_id,
                "tenant": entry.tenant,
                "template": entry.template,
                "resources": _resources_dict(entry.resources),
                "sandbox_id": entry.sandbox_id,
                "name": name or "",
                "created": time.time(),
                "size": Sandbox.checkpoint_size(info.snapshot_id),
            },
        )
        return info

    def delete_snapshot(self, principal: Principal, snapshot_id: str) -> bool:
        try:
            self._owned_checkpoint(principal, snapshot_id, "snapshot")
        except ApiError:
            return False
        Sandbox.delete_snapshot(snapshot_id)
        self._owner_file(snapshot_id).unlink(missing_ok=True)
        return True

    def fork(
        self, entry: ManagedSandbox, count: int, timeout: float | None
    ) -> list[ManagedSandbox | Exception]:
        """``count`` copies of the sandbox as it is now, each a sandbox of its tenant
        (quotas apply to each: a copy over the quota is an error in its place)."""
        self._room_for_checkpoint(entry)
        copies = entry.sandbox.fork(count)
        lifetime = self._lifetime(timeout, entry.tenant)
        spec = entry.resources
        assert spec.memory_mb is not None
        out: list[ManagedSandbox | Exception] = []
        for copy in copies:
            if isinstance(copy, Exception):
                out.append(copy)
                continue
            try:
                self._reserve(entry.tenant, spec.memory_mb)
            except BaseException as exc:
                copy.kill()
                out.append(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
                continue
            out.append(
                self._register(copy, entry.tenant, entry.template, entry.metadata, spec, lifetime)
            )
        return out

    def kill_paused(self, principal: Principal, sandbox_id: str) -> bool:
        """Delete the tenant's paused sandbox for good; False if there is none."""
        if self.paused(principal, sandbox_id) is None:
            return False
        Sandbox.kill(sandbox_id)
        self._owner_file(sandbox_id).unlink(missing_ok=True)
        return True

    # --- ceilings -------------------------------------------------------------------------
    def ceilings(self, tenant: str) -> tuple[Resources, float, float]:
        """``(resources, sandbox_timeout, cell_timeout)``: the most ``tenant`` may ask for
        (its own ceilings where it has them, else the server's)."""
        own = self.store.tenant_ceilings(tenant)
        server = self.settings.ceilings
        values = {
            name: own.get(name, getattr(server, name)) for name in Resources.__dataclass_fields__
        }
        return (
            Resources(**values),
            float(own.get("sandbox_timeout", self.settings.max_sandbox_timeout)),
            float(own.get("cell_timeout", self.settings.max_cell_timeout)),
        )

    def resources_for(self, tenant: str, requested: Mapping[str, Any] | None) -> Resources:
        """The resources of a new sandbox: what the tenant asked for, each at most its
        ceiling; a field left out gets the ceiling. ``null`` is refused: on a server it
        would mean no limit at all, which is what ceilings exist to prevent."""
        ceiling = self.ceilings(tenant)[0]
        asked = dict(requested or {})
        unknown = sorted(set(asked) - set(Resources.__dataclass_fields__))
        if unknown:
            raise InvalidArgumentError(f"unknown resource(s) {unknown}")
        values: dict[str, Any] = {}
        for name in Resources.__dataclass_fields__:
            cap = getattr(ceiling, name)
            if name not in asked:
                values[name] = cap
                continue
            value = asked[name]
            if value is None:
                raise InvalidArgumentError(
                    f"resources.{name} may not be null on this server (that would mean no "
                    f"limit); leave it out to get the most allowed ({cap}) or ask for less"
                )
            if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
                raise InvalidArgumentError(
                    f"resources.{name}={value} is above this server's ceiling of {cap} "
                    f"for tenant {tenant!r}"
                )
            values[name] = value
        return Resources.coerce(values)

    def cell_timeout_ceiling(self, tenant: str) -> float:
        """``ceilings(tenant)[2]``, without building the resources (checked per cell)."""
        own = self.store.tenant_ceilings(tenant)
        return float(own.get("cell_timeout", self.settings.max_cell_timeout))

    def _lifetime(self, timeout: float | None, tenant: str) -> float:
        limit = self.ceilings(tenant)[1]
        if timeout is None:
            return limit
        if isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0:
            raise InvalidArgumentError("timeout must be positive, finite seconds")
        if timeout > limit:
            raise InvalidArgumentError(f"timeout must be at most {limit:g} seconds on this server")
        return float(timeout)

    def _quotas(self, tenant: str) -> Quotas:
        return effective_quotas(self.store, self.settings.quotas, tenant)

    def _reserve(self, tenant: str, memory_mb: int) -> None:
        quotas = self._quotas(tenant)
        with self._lock:
            now = time.monotonic()
            recent = self._creations[tenant]
            while recent and recent[0] < now - 60:
                recent.popleft()
            live = [e for e in self._sandboxes.values() if e.tenant == tenant]
            count = len(live) + self._pending[tenant]
            memory = sum(e.resources.memory_mb or 0 for e in live) + self._pending_memory[tenant]
            if count >= quotas.max_sandboxes:
                raise ApiError(
                    429,
                    "QuotaExceeded",
                    f"tenant {tenant!r} already has {count} sandboxes "
                    f"(quota: {quotas.max_sandboxes}); kill one first",
                )
            if len(recent) >= quotas.creates_per_minute:
                raise ApiError(
                    429,
                    "QuotaExceeded",
                    f"tenant {tenant!r} created {len(recent)} sandboxes in the last minute "
                    f"(quota: {quotas.creates_per_minute} per minute); retry later",
                )
            if memory + memory_mb > quotas.max_memory_mb:
                raise ApiError(
                    429,
                    "QuotaExceeded",
                    f"tenant {tenant!r} would use {memory + memory_mb} MiB of sandbox memory "
                    f"(quota: {quotas.max_memory_mb} MiB); kill a sandbox or ask for less",
                )
            recent.append(now)
            self._pending[tenant] += 1
            self._pending_memory[tenant] += memory_mb

    def _release(self, tenant: str, memory_mb: int) -> None:
        with self._lock:
            self._pending[tenant] -= 1
            self._pending_memory[tenant] -= memory_mb

    def tenant_default(self, principal: Principal) -> ManagedSandbox:
        """The tenant's default sandbox (for clients that cannot name one), made on first use
        and leased to the caller (see :meth:`lease`; hand it back with :meth:`release`).

        It is reaped like any other (idle TTL), and a new one starts on the next request.
        """
        with self._default_lock:
            with self._lock:
                for entry in self._sandboxes.values():
                    if (
                        entry.tenant == principal.tenant
                        and entry.metadata.get(DEFAULT_MARK) == "default"
                    ):
                        return self._lease_locked(entry)
            entry = self.create(
                principal,
                template="python-data",
                timeout=None,
                envs={},
                metadata={DEFAULT_MARK: "default"},
                resources=None,
            )
            # Leased before the reaper can see it idle (a zero idle TTL would reap it now).
            with self._lock:
                if self._sandboxes.get(entry.sandbox_id) is not entry:
                    raise ApiError(404, "SandboxNotFound", "the default sandbox was killed")
                return self._lease_locked(entry)

    def get(self, principal: Principal, sandbox_id: str) -> ManagedSandbox:
        """The tenant's sandbox, or 404: another tenant's id is indistinguishable from none."""
        with self._lock:
            entry = self._sandboxes.get(sandbox_id)
        if entry is None or entry.tenant != principal.tenant:
            raise ApiError(404, "SandboxNotFound", f"sandbox {sandbox_id!r} not found")
        return entry

    def lease(self, principal: Principal, sandbox_id: str) -> ManagedSandbox:
        """:meth:`get`, and mark the sandbox in use until :meth:`release`: the reaper never
        takes a sandbox from under a request that already holds it.

        The check and the mark are one step under the registry's lock, as is the reaper's
        decision, so a request either sees 404 or keeps its sandbox for its whole length.
        """
        with self._lock:
            entry = self._sandboxes.get(sandbox_id)
            if entry is None or entry.tenant != principal.tenant:
                raise ApiError(404, "SandboxNotFound", f"sandbox {sandbox_id!r} not found")
            return self._lease_locked(entry)

    def calls_in_progress(self) -> int:
        """Leases held on live sandboxes right now (the ``/metrics`` gauge)."""
        with self._lock:
            return sum(entry.active for entry in self._sandboxes.values())

    def release(self, entry: ManagedSandbox) -> None:
        self.touch(entry, -1)

    def registered(self, entry: ManagedSandbox) -> bool:
        """Whether ``entry`` is still live (False once killed, reaped or expired)."""
        with self._lock:
            return self._sandboxes.get(entry.sandbox_id) is entry

    def _lease_locked(self, entry: ManagedSandbox) -> ManagedSandbox:
        entry.active += 1
        entry.last_used = time.time()
        return entry

    def owned_by(self, principal: Principal) -> list[ManagedSandbox]:
        with self._lock:
            return [e for e in self._sandboxes.values() if e.tenant == principal.tenant]

    def all(self) -> list[ManagedSandbox]:
        with self._lock:
            return list(self._sandboxes.values())

    def kill(self, entry: ManagedSandbox, reason: str) -> bool:
        """Destroy a sandbox; False if it was already gone.

        Unregistered at once (every later request for it is a 404, and it stops
        counting against its tenant's quotas, as before); its processes are killed and
        reaped by the destroyer threads, so the caller does not wait the tens of
        milliseconds a process takes to be reaped. :meth:`drain` waits for them."""
        with self._lock:
            if not self._unregister_locked(entry, reason):
                return False
        try:
            self._destroyer.submit(self._destroy, entry, reason)
        except RuntimeError:  # drained: the destroyer is shut down
            self._destroy(entry, reason)
        return True

    def _unregister_locked(self, entry: ManagedSandbox, reason: str) -> bool:
        if self._sandboxes.get(entry.sandbox_id) is not entry:
            return False
        del self._sandboxes[entry.sandbox_id]
        for callback in self.on_end:
            callback(reason)
        self._changed_locked()
        return True

    def _destroy(self, entry: ManagedSandbox, reason: str) -> None:
        entry.sandbox.kill()
        try:
            self.store.sandbox_ended(entry.sandbox_id, reason)
        except Exception:  # the sandbox is gone either way; recover() closes the row
            log.exception("could not record the end of sandbox %s", entry.sandbox_id)
        log.info("sandbox %s ended (%s)", entry.sandbox_id, reason)

    def set_timeout(self, entry: ManagedSandbox, timeout: float | None) -> None:
        entry.expires_at = time.time() + self._lifetime(timeout, entry.tenant)

    def touch(self, entry: ManagedSandbox, delta: int) -> None:
        # The registry's lock, not the entry's: the reaper decides under it (see lease).
        with self._lock:
            entry.active += delta
            entry.last_used = time.time()

    # --- cells ----------------------------------------------------------------------------
    def new_cell(self, entry: ManagedSandbox, context: str) -> RunningCell:
        if self.closing:
            raise ApiError(503, "ShuttingDown", "the server is shutting down")
        cell = RunningCell(execution_id=uuid.uuid4().hex, entry=entry, context=context)
        with self._lock:
            self.running[cell.execution_id] = cell
        return cell

    def end_cell(self, cell: RunningCell) -> None:
        with self._lock:
            self.running.pop(cell.execution_id, None)
        cell.done.set()

    def interrupt_cell(self, cell: RunningCell, reason: str) -> None:
        """Interrupt a running cell (client gone, shutdown). Never raises."""
        if cell.done.is_set():
            return
        cell.interrupted_by = reason
        try:
            cell.entry.sandbox.interrupt(cell.context)
        except SandlotError as exc:
            log.warning("could not interrupt cell %s: %s", cell.execution_id, escape(exc, 1024))

    # --- operations audit ----------------------------------------------------------------
    def operation_started(
        self,
        principal: Principal,
        entry: ManagedSandbox,
        kind: str,
        target: str | None,
        **values: Any,
    ) -> str:
        """Record an operation (command, terminal, signal, stdin, file change, download)
        before it runs; raises if the row cannot be written, so nothing runs unrecorded.
        Blocking: call it in a worker thread."""
        return self.store.operation_started(
            principal=principal, sandbox_id=entry.sandbox_id, kind=kind, target=target, **values
        )

    def operation_finished(self, operation_id: str, outcome: str, **values: Any) -> None:
        """Record how an operation ended. Never raises: it has happened either way (a
        row left ``running`` is closed as ``killed`` by the next :meth:`recover`)."""
        try:
            self.store.operation_finished(operation_id, {"outcome": outcome, **values})
        except Exception:
            log.exception("could not record the end of operation %s", operation_id)

    def audited(
        self,
        principal: Principal,
        entry: ManagedSandbox,
        kind: str,
        target: str | None,
        function: Callable[..., Any],
        *args: Any,
        destination: str | None = None,
        size: int | None = None,
        pid: int | None = None,
    ) -> Any:
        """``function(*args)``, recorded as an operation: the row before the call, its
        outcome (``ok``, or ``error`` and the exception's name) after. Blocking."""
        operation_id = self.operation_started(
            principal, entry, kind, target, destination=destination, size=size, pid=pid
        )
        try:
            result = function(*args)
        except BaseException as exc:
            self.operation_finished(operation_id, "error", error_name=type(exc).__name__)
            raise
        self.operation_finished(operation_id, "ok")
        return result

    def start_audited(
        self,
        principal: Principal,
        entry: ManagedSandbox,
        kind: str,
        line: str | None,
        start: Callable[[], Any],
    ) -> tuple[str, Any]:
        """Start a background command or terminal (``start()`` returns its handle),
        recorded first; the row ends ``started`` with its pid. Returns the operation's
        id and the handle. Blocking."""
        operation_id = self.operation_started(principal, entry, kind, line)
        try:
            handle = start()
        except BaseException as exc:
            self.operation_finished(operation_id, "error", error_name=type(exc).__name__)
            raise
        self.operation_finished(operation_id, "started", pid=handle.pid)
        return operation_id, handle

    # --- lifecycle ----------------------------------------------------------------------
    def warm_pool(self) -> None:
        """Keep the configured templates' default shape warm (called at start-up and by
        the reaper, so those keys never go idle in the pool)."""
        if self.pool is None or self.closing:
            return
        for template in self.settings.pool_templates:
            self.pool.warm(
                template,
                resources=self.settings.ceilings,
                unsafe_best_effort_limits=self.settings.unsafe_best_effort_limits,
            )

    def reap(self) -> list[str]:
        """Kill sandboxes past their timeout, or idle longer than the idle TTL.

        A sandbox with a background command or terminal still running is not idle,
        whether or not a client streams it: its idle TTL counts from the last time the
        reaper saw one running. Its ``timeout`` applies all the same."""
        now = time.time()
        ttl = self.settings.idle_ttl
        with self._lock:
            candidates = [
                entry
                for entry in self._sandboxes.values()
                if now < entry.expires_at and entry.active == 0 and now - entry.last_used >= ttl
            ]
        # Asked outside the lock (a call into each idle sandbox), and only of sandboxes
        # idle by the clock, so a busy server asks nothing. A process started after
        # the answer came in with a lease, which the decision below sees. Asked in
        # parallel and waited for at most PROBE_SECONDS: a sandbox that does not answer
        # (its runner stopped) counts as idle, and cannot stall the reaper for others.
        busy: set[int] = set()
        if candidates:
            try:
                probes = {self._prober.submit(_has_processes, e): e for e in candidates}
            except RuntimeError:  # drained
                probes = {}
            done, _ = concurrent.futures.wait(probes, timeout=PROBE_SECONDS)
            busy = {id(probes[f]) for f in done if f.result()}
        doomed: list[tuple[ManagedSandbox, str]] = []
        to_pause: list[ManagedSandbox] = []
        with self._lock:
            # Decided and unregistered in one step: a request that leased a sandbox
            # keeps it, one that comes later sees 404 (never a sandbox dying under it).
            for entry in list(self._sandboxes.values()):
                if entry.pausing:
                    continue
                if id(entry) in busy:
                    entry.last_used = max(entry.last_used, now)
                    continue
                if now >= entry.expires_at and entry.auto_pause and entry.active == 0:
                    entry.pausing = True
                    to_pause.append(entry)
                    continue
                if now >= entry.expires_at:
                    reason = "expired"
                elif entry.active == 0 and now - entry.last_used >= ttl:
                    reason = "idle"
                else:
                    continue
                if self._unregister_locked(entry, reason):
                    doomed.append((entry, reason))
        for entry, reason in doomed:
            self._destroy(entry, reason)
        for entry in to_pause:
            try:
                self._destroyer.submit(self._pause_at_timeout, entry)
            except RuntimeError:  # drained
                entry.pausing = False
        return [entry.sandbox_id for entry, _ in doomed]

    def _pause_at_timeout(self, entry: ManagedSandbox) -> None:
        """A sandbox created with auto-pause reached its timeout: paused, or killed if
        it cannot be (the timeout holds either way)."""
        try:
            self.pause(entry)
        except Exception as exc:
            log.warning(
                "could not pause sandbox %s at its timeout (%s): killed", entry.sandbox_id, exc
            )
            self.kill(entry, "expired")
        finally:
            entry.pausing = False

    def drain(self, grace: float) -> dict[str, list[str]]:
        """Graceful shutdown: refuse new work, let running cells finish for ``grace``
        seconds, interrupt the rest, kill every sandbox. Returns which cells did what."""
        self.closing = True
        if self.pool is not None:
            self.pool.close()  # its ready sandboxes belong to no one: killed at once
        with self._lock:
            cells = list(self.running.values())
        deadline = time.monotonic() + grace
        finished, interrupted = [], []
        for cell in cells:
            if cell.done.wait(max(0.0, deadline - time.monotonic())):
                finished.append(cell.execution_id)
            else:
                self.interrupt_cell(cell, "shutdown")
                interrupted.append(cell.execution_id)
        for cell in cells:
            cell.done.wait(5.0)
        for entry in self.all():
            self.kill(entry, "server-shutdown")
        self._destroyer.shutdown(wait=True)  # every sandbox killed so far is gone
        self._prober.shutdown(wait=False)
        report = {"finished": finished, "interrupted": interrupted}
        log.warning(
            "shutdown: %d running cell(s) finished, %d interrupted %s",
            len(finished),
            len(interrupted),
            report,
        )
        return report

    def _changed_locked(self) -> None:
        live = len(self._sandboxes)
        for callback in self.on_change:
            callback(live)


def _has_processes(entry: ManagedSandbox) -> bool:
    """Whether a background command or terminal runs in the sandbox (False when it
    cannot say: a sandbox whose runner does not answer is not kept alive by it)."""
    try:
        return bool(entry.sandbox.commands.list())
    except SandlotError:
        return False
    except Exception:
        log.exception("could not list the processes of sandbox %s", entry.sandbox_id)
        return False


def _recovery(sandbox: Sandbox) -> tuple[str | None, RecoveryToken | None]:
    """The sandbox's backend (registry name) and its handle's recovery token, for
    :meth:`SandboxManager.recover` after a crash; (name, None) if it has none."""
    backend = sandbox.backend
    handle = sandbox.handle
    if not isinstance(backend, Backend) or not isinstance(handle, SandboxHandle):
        return None, None
    return backend.name, handle.recovery_token()


def effective_quotas(store: Store, default: Quotas, tenant: str) -> Quotas:
    """The tenant's own quotas where it has them, else the server's (shared by the
    single-machine manager and the cluster's front door)."""
    own = store.tenant_quotas(tenant)
    return Quotas(
        max_sandboxes=own.max_sandboxes or default.max_sandboxes,
        creates_per_minute=own.creates_per_minute or default.creates_per_minute,
        max_memory_mb=own.max_memory_mb or default.max_memory_mb,
        max_checkpoint_mb=default.max_checkpoint_mb,
    )
