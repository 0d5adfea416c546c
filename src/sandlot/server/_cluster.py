"""The shared store of a server spread over cluster nodes: where each sandbox lives,
placement reservations, and what a lost node takes with it.

One database (PostgreSQL: every node and every front door reach it) holds, besides the
single-machine tables (tenants, keys, sandboxes, audit), two tables of its own:

* ``sandbox_nodes``: the node each sandbox lives on (written by that node in the
  transaction before its ``sandboxes`` row), so any front door can route a call for it,
  and its memory (written by the front door that placed it) for the tenant's quota;
* ``placement_reservations``: a create a front door has admitted and not finished yet,
  counted against the tenant's quotas and the node's slots until the node answers;
* ``cluster_nodes``: the nodes being drained (by an operator, or because Ray drains
  them), which admission skips.

A sandbox is live while its ``sandboxes`` row has no ``ended_at``: the node closes it
when the sandbox is killed, reaped or expires, and a front door closes every row of a
node that left the cluster (``end_reason`` "node-lost"), so the tenant's quotas are
released whoever notices first. Nothing here imports Ray: the Ray side
(:mod:`sandlot.ray`) tells which nodes exist.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from sandlot.server._manager import ApiError
from sandlot.server._settings import Quotas
from sandlot.server._store import Store, executions, sandbox_recovery, sandboxes

_metadata = sa.MetaData()

sandbox_nodes = sa.Table(
    "sandbox_nodes",
    _metadata,
    sa.Column("sandbox_id", sa.String(64), primary_key=True),
    sa.Column("node_id", sa.String(64), nullable=False, index=True),
    sa.Column("node_ip", sa.String(64), nullable=False),
    sa.Column("url", sa.String(256), nullable=False),
    sa.Column("memory_mb", sa.Integer, nullable=True),
)

placement_reservations = sa.Table(
    "placement_reservations",
    _metadata,
    sa.Column("reservation_id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("node_id", sa.String(64), nullable=False),
    sa.Column("memory_mb", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

cluster_nodes = sa.Table(
    "cluster_nodes",
    _metadata,
    sa.Column("node_id", sa.String(64), primary_key=True),
    sa.Column("draining_since", sa.Float, nullable=False),
    sa.Column("reason", sa.String(256), nullable=False),
)
"""Nodes being drained: no front door places a sandbox there; what they hold runs on."""

RESERVATION_TTL = 300.0
"""Seconds a reservation counts at most: one whose front door died mid-create stops
holding its tenant's quota and its node's slot after this (a create that is still
starting is well within it)."""
NODE_LOST = "node-lost"
"""``end_reason`` of a sandbox whose node left the cluster."""
_PLACEMENT_LOCK = 0x5A4D_1075
"""PostgreSQL advisory lock that serialises admissions (quota and slot checks)."""


@dataclass(frozen=True, slots=True)
class NodeRef:
    """A cluster node's sandbox service, as a front door sees it."""

    node_id: str
    ip: str
    url: str
    """The node's own sandlot server (``http://IP:PORT``)."""
    slots: int
    """Sandboxes it holds at once, at most."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a sandbox lives and whether it is still live."""

    sandbox_id: str
    tenant: str
    node_id: str
    node_ip: str
    url: str
    ended: bool
    lost: bool
    """Its node left the cluster (it is gone for good)."""


class ClusterStore(Store):
    """:class:`Store` plus placement. ``node``: the node this store belongs to (a node's
    server), whose sandboxes' rows it writes and whose leftovers only it recovers;
    None for a front door."""

    def __init__(self, url: str, *, node: NodeRef | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        self.node = node
        _metadata.create_all(self.engine)

    # --- a node's server -------------------------------------------------------------
    def sandbox_started(
        self,
        sandbox_id: str,
        tenant: str,
        template: str,
        *,
        backend: str | None = None,
        recovery: Mapping[str, Any] | None = None,
    ) -> None:
        if self.node is not None:
            # First: a sandboxes row with no placement could not be routed; a placement
            # with no sandboxes row is not live (and the manager kills the sandbox).
            with self.engine.begin() as conn:
                conn.execute(
                    sandbox_nodes.insert().values(
                        sandbox_id=sandbox_id,
                        node_id=self.node.node_id,
                        node_ip=self.node.ip,
                        url=self.node.url,
                    )
                )
        super().sandbox_started(sandbox_id, tenant, template, backend=backend, recovery=recovery)

    def unfinished_recovery_tokens(self) -> list[tuple[str, dict[str, Any]]]:
        """Only this node's: another node's sandboxes are alive on their own node."""
        if self.node is None:
            return super().unfinished_recovery_tokens()
        return self._recovery_tokens(
            self._open_recovery_rows()
            .join(sandbox_nodes, sandbox_nodes.c.sandbox_id == sandbox_recovery.c.sandbox_id)
            .where(sandbox_nodes.c.node_id == self.node.node_id)
        )

    def close_orphans(self) -> tuple[int, int]:
        """Only this node's leftovers: every other node's sandboxes live on."""
        if self.node is None:
            return super().close_orphans()
        return self._end_node(self.node.node_id, "server-crashed")

    # --- a front door -------------------------------------------------------------------
    def locate(self, sandbox_id: str) -> Placement | None:
        """Where ``sandbox_id`` lives, or None for an id no node ever held."""
        query = (
            sa.select(
                sandboxes.c.tenant,
                sandbox_nodes.c.node_id,
                sandbox_nodes.c.node_ip,
                sandbox_nodes.c.url,
                sandboxes.c.ended_at,
                sandboxes.c.end_reason,
            )
            .join(sandboxes, sandboxes.c.sandbox_id == sandbox_nodes.c.sandbox_id)
            .where(sandbox_nodes.c.sandbox_id == sandbox_id)
        )
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        if row is None:
            return None
        return Placement(
            sandbox_id=sandbox_id,
            tenant=row[0],
            node_id=row[1],
            node_ip=row[2],
            url=row[3],
            ended=row[4] is not None,
            lost=row[5] == NODE_LOST,
        )

    def reserve(
        self, tenant: str, quotas: Quotas, memory_mb: int, nodes: Sequence[NodeRef]
    ) -> tuple[str, NodeRef]:
        """Admit one create of ``tenant``: check its quotas over the whole cluster and
        pick the node with the most free slots, in one serialised transaction (every
        front door takes the same lock), and hold both until :meth:`placed` or
        :meth:`unreserve`. Raises ApiError 429 (quota) or 503 ``NoCapacity``."""
        now = time.time()
        live = sandboxes.c.ended_at.is_(None)
        fresh = placement_reservations.c.created_at > now - RESERVATION_TTL
        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PLACEMENT_LOCK)))
            conn.execute(placement_reservations.delete().where(sa.not_(fresh)))
            # Two round trips for what admission reads (the lock is held meanwhile, so
            # every query less is more creates a second across the cluster): the
            # tenant's use, then each node's.
            placed_live = sandboxes.join(
                sandbox_nodes, sandbox_nodes.c.sandbox_id == sandboxes.c.sandbox_id
            )
            mine = sandboxes.c.tenant == tenant
            held_mine = placement_reservations.c.tenant == tenant
            count, memory, held, held_memory, recent = conn.execute(
                sa.select(
                    sa.select(sa.func.count())
                    .select_from(placed_live)
                    .where(mine, live)
                    .scalar_subquery(),
                    sa.select(sa.func.coalesce(sa.func.sum(sandbox_nodes.c.memory_mb), 0))
                    .select_from(placed_live)
                    .where(mine, live)
                    .scalar_subquery(),
                    sa.select(sa.func.count())
                    .select_from(placement_reservations)
                    .where(held_mine)
                    .scalar_subquery(),
                    sa.select(sa.func.coalesce(sa.func.sum(placement_reservations.c.memory_mb), 0))
                    .where(held_mine)
                    .scalar_subquery(),
                    sa.select(sa.func.count())
                    .select_from(sandboxes)
                    .where(mine, sandboxes.c.created_at > now - 60)
                    .scalar_subquery(),
                )
            ).one()
            count, memory = int(count) + int(held), int(memory) + int(held_memory)
            if count >= quotas.max_sandboxes:
                raise ApiError(
                    429,
                    "QuotaExceeded",
                    f"tenant {tenant!r} already has {count} sandboxes in the cluster "
                    f"(quota: {quotas.max_sandboxes}); kill one first",
                )
            if int(recent) + int(held) >= quotas.creates_per_minute:
                raise ApiError(
                    429,
                    "QuotaExceeded",
                    f"tenant {tenant!r} created {int(recent) + int(held)} sandboxes in the "
                    f"last minute (quota: {quotas.creates_per_minute} per minute); retry later",
                )
            if memory + memory_mb > quotas.max_memory_mb:
                raise ApiError(
                    429,
                    "QuotaExceeded",
                    f"tenant {tenant!r} would use {memory + memory_mb} MiB of sandbox memory "
                    f"in the cluster (quota: {quotas.max_memory_mb} MiB); kill a sandbox or "
                    "ask for less",
                )
            per_node = sa.union_all(
                sa.select(sandbox_nodes.c.node_id, sa.literal(1).label("kind"), sa.func.count())
                .select_from(placed_live)
                .where(live)
                .group_by(sandbox_nodes.c.node_id),
                sa.select(
                    placement_reservations.c.node_id, sa.literal(1).label("kind"), sa.func.count()
                ).group_by(placement_reservations.c.node_id),
                sa.select(cluster_nodes.c.node_id, sa.literal(0).label("kind"), sa.literal(0)),
            )
            used: dict[str, int] = {}
            drained: set[str] = set()
            for node_id, kind, n in conn.execute(per_node):
                if kind:
                    used[node_id] = used.get(node_id, 0) + int(n)
                else:
                    drained.add(node_id)
            open_nodes = [node for node in nodes if node.node_id not in drained]
            free = sorted(
                ((node.slots - used.get(node.node_id, 0), node) for node in open_nodes),
                key=lambda pair: (-pair[0], pair[1].node_id),
            )
            if not free or free[0][0] <= 0:
                draining = len(nodes) - len(open_nodes)
                raise ApiError(
                    503,
                    "NoCapacity",
                    "no sandlot node in the cluster has a free slot "
                    f"({len(nodes)} live node(s), {draining} of them draining); "
                    "retry later or add nodes",
                )
            node = free[0][1]
            reservation = uuid.uuid4().hex
            conn.execute(
                placement_reservations.insert().values(
                    reservation_id=reservation,
                    tenant=tenant,
                    node_id=node.node_id,
                    memory_mb=memory_mb,
                    created_at=now,
                )
            )
        return reservation, node

    # --- draining ----------------------------------------------------------------------
    def drain(self, node_id: str, reason: str = "drained by an operator") -> bool:
        """Place nothing new on ``node_id`` from now on, through any front door; what
        it holds runs on until killed, reaped or lost. False if it was draining
        already (its first reason is kept)."""
        if not node_id or len(node_id) > 64:
            raise ApiError(400, "InvalidArgumentError", f"not a node id: {node_id!r}")
        with self.engine.begin() as conn:
            known = conn.execute(
                sa.select(cluster_nodes.c.node_id).where(cluster_nodes.c.node_id == node_id)
            ).first()
            if known is not None:
                return False
            conn.execute(
                cluster_nodes.insert().values(
                    node_id=node_id, draining_since=time.time(), reason=reason[:256]
                )
            )
        return True

    def undrain(self, node_id: str) -> bool:
        """Let ``node_id`` take new sandboxes again; False if it was not draining."""
        with self.engine.begin() as conn:
            gone = conn.execute(
                cluster_nodes.delete().where(cluster_nodes.c.node_id == node_id)
            ).rowcount
        return bool(gone)

    def draining(self) -> dict[str, str]:
        """``{node_id: reason}`` of the nodes being drained."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(cluster_nodes.c.node_id, cluster_nodes.c.reason))
            return {str(node_id): str(reason) for node_id, reason in rows}

    def live_per_node(self) -> dict[str, int]:
        """``{node_id: live sandboxes}`` (a drained node is empty at 0)."""
        query = (
            sa.select(sandbox_nodes.c.node_id, sa.func.count())
            .select_from(
                sandboxes.join(sandbox_nodes, sandbox_nodes.c.sandbox_id == sandboxes.c.sandbox_id)
            )
            .where(sandboxes.c.ended_at.is_(None))
            .group_by(sandbox_nodes.c.node_id)
        )
        with self.engine.connect() as conn:
            return {str(node_id): int(n) for node_id, n in conn.execute(query)}

    def placed(self, reservation: str, sandbox_id: str, memory_mb: int) -> None:
        """The node started the sandbox: its memory counts from its row now."""
        with self.engine.begin() as conn:
            conn.execute(
                sandbox_nodes.update()
                .where(sandbox_nodes.c.sandbox_id == sandbox_id)
                .values(memory_mb=memory_mb)
            )
            conn.execute(
                placement_reservations.delete().where(
                    placement_reservations.c.reservation_id == reservation
                )
            )

    def unreserve(self, reservation: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                placement_reservations.delete().where(
                    placement_reservations.c.reservation_id == reservation
                )
            )

    def node_lost(self, node_id: str) -> tuple[int, int]:
        """Record that ``node_id`` left the cluster: each of its live sandboxes ends
        (``node-lost``, releasing its tenant's quotas) and each cell running there is
        ``killed`` with status ``died``. Idempotent (every front door may call it)."""
        return self._end_node(node_id, NODE_LOST)

    def _end_node(self, node_id: str, reason: str) -> tuple[int, int]:
        now = time.time()
        on_node = sa.select(sandbox_nodes.c.sandbox_id).where(sandbox_nodes.c.node_id == node_id)
        with self.engine.begin() as conn:
            boxes = conn.execute(
                sandboxes.update()
                .where(sandboxes.c.sandbox_id.in_(on_node), sandboxes.c.ended_at.is_(None))
                .values(ended_at=now, end_reason=reason)
            ).rowcount
            conn.execute(
                sandbox_recovery.delete().where(sandbox_recovery.c.sandbox_id.in_(on_node))
            )
            cells = conn.execute(
                executions.update()
                .where(executions.c.sandbox_id.in_(on_node), executions.c.outcome == "running")
                .values(
                    outcome="killed", status="died", error_name="SandboxLostError", finished_at=now
                )
            ).rowcount
        return int(boxes or 0), int(cells or 0)
