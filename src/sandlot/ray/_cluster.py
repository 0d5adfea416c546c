"""The driver's view of the cluster: one sandlot node actor per live Ray node.

:class:`SandlotCluster` finds Ray nodes in ``ray.nodes()`` and starts a
:class:`~sandlot.ray._node.SandlotNode` actor pinned to each (hard node affinity, no
CPU reserved: the node's sandboxes, not the actor, use the CPUs). ``refresh()`` does it
again, so a node that joined since gets its actor and a node that left is marked lost;
:func:`sandlot.ray.run_batch` refreshes as it goes. The actors are owned by this
driver: they end with it, or at :meth:`SandlotCluster.close`.

A sandbox created here lives on one node, and every call for it goes to that node's
actor (:class:`ClusterSandbox`). When the node dies, the actor dies with it and every
later call raises :class:`sandlot.NodeLost`; other nodes' sandboxes are untouched.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray
from sandlot import (
    BackendError,
    EntryInfo,
    Execution,
    InvalidArgumentError,
    NodeLost,
    SandlotError,
    WriteInfo,
)
from sandlot.ray._node import NodeInfo, SandlotNode

ACTOR_READY_TIMEOUT = 120.0
"""Seconds a new node actor may take to come up (a worker process, sandlot imported)."""
ACTOR_NAME = "sandlot-node-{node_id}"
log = logging.getLogger("sandlot.ray")


_warned = False


def ray_draining() -> set[str]:
    """The Ray nodes Ray is draining: its autoscaler scaling down, a preemption notice
    (KubeRay, a cloud's spot notice) or ``ray drain-node``. Ray has no public call for
    it yet; its own state accessor is used, and on a Ray version without it no node is
    seen draining (one warning), leaving sandlot's own drains."""
    global _warned
    try:
        from ray._private.state import state

        return {str(node_id) for node_id in state.get_draining_nodes()}
    except Exception as exc:  # not a layer the policy needs: a signal, said once
        if not _warned:
            _warned = True
            log.warning("cannot ask Ray which nodes it drains (%s): sandlot's drain only", exc)
        return set()


class NoCapacity(BackendError):
    """No live, undrained sandlot node has a free slot (or there is no node at all)."""


@dataclass
class _Node:
    node_id: str
    ip: str
    actor: Any
    slots: int
    draining: bool = False
    lost: bool = False


class SandlotCluster:
    """The sandlot nodes of the Ray cluster this process is connected to.

    :param address: passed to ``ray.init`` when Ray is not initialised yet (None: Ray's
        own default, ``$RAY_ADDRESS`` or a new local cluster).
    :param slots_per_node: sandboxes plus batch programs each node runs at once (None:
        the node's CPU count as Ray reports it, at least 1).
    :param backend: each node's isolation backend, as for ``Sandbox(backend=...)``.
    :param template: the template every sandbox runs.
    :param pool_size: warm sandboxes each node keeps ready for batch programs.
    :param preload: modules each pooled sandbox imports first (default none: a batch of
        small programs should not pay for pandas; pass ``sandlot.policy.DATA_STACK``
        for programs that use it).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        slots_per_node: int | None = None,
        backend: str = "auto",
        template: str = "python-data",
        pool_size: int = 2,
        preload: tuple[str, ...] = (),
    ) -> None:
        if slots_per_node is not None and (
            isinstance(slots_per_node, bool)
            or not isinstance(slots_per_node, int)
            or slots_per_node < 1
        ):
            raise InvalidArgumentError(
                f"slots_per_node must be an integer >= 1, not {slots_per_node!r}"
            )
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self._slots = slots_per_node
        self._options = {
            "backend": backend,
            "template": template,
            "pool_size": pool_size,
            "preload": tuple(preload),
        }
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self.refresh()

    # --- membership -------------------------------------------------------------------

    def refresh(self) -> list[NodeInfo]:
        """Give every live Ray node a sandlot node and mark the ones that left as lost;
        the live, undrained nodes' advertised capacity."""
        listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        alive = {n["NodeID"]: n for n in listed if n["Alive"]}
        drained_by_ray = ray_draining()
        started: list[tuple[_Node, Any]] = []
        to_drain: list[_Node] = []
        with self._lock:
            for node_id, node in self._nodes.items():
                if node_id not in alive:
                    node.lost = True
                elif node_id in drained_by_ray and not node.draining:
                    # Ray drains it (scale-down, preemption): nothing new goes there.
                    node.draining = True
                    to_drain.append(node)
            for node_id, raw in alive.items():
                if node_id in self._nodes:
                    continue
                node = self._start_actor(node_id, raw)
                self._nodes[node_id] = node
                started.append((node, node.actor.info.remote()))
        for node in to_drain:  # its actor too (it refuses what a stale caller sends)
            with contextlib.suppress(RayActorError, RayTaskError, GetTimeoutError):
                ray.get(node.actor.drain.remote(), timeout=ACTOR_READY_TIMEOUT)
        # Wait for new actors outside the lock: a slow start must not block callers.
        for node, ready in started:
            try:
                ray.get(ready, timeout=ACTOR_READY_TIMEOUT)
            except (RayActorError, RayTaskError, GetTimeoutError):
                # The node left while its actor started, or the actor cannot run there:
                # either way no work may go to it.
                node.lost = True
        return self.nodes()

    def _start_actor(self, node_id: str, raw: Mapping[str, Any]) -> _Node:
        ip = str(raw.get("NodeManagerAddress", ""))
        cpus = int(raw.get("Resources", {}).get("CPU", 1) or 1)
        slots = self._slots if self._slots is not None else max(1, cpus)
        actor_class: Any = ray.remote(SandlotNode)
        actor = actor_class.options(
            name=ACTOR_NAME.format(node_id=node_id),
            get_if_exists=True,
            num_cpus=0,
            # Threads: a long cell must not hold up other sandboxes' calls or info().
            max_concurrency=2 * slots + 8,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(node_id, ip, slots=slots, **self._options)
        return _Node(node_id=node_id, ip=ip, actor=actor, slots=slots)

    def nodes(self, *, include_drained: bool = False) -> list[NodeInfo]:
        """The advertised capacity of each live node (asked now, in parallel)."""
        with self._lock:
            asked = [
                (node, node.actor.info.remote())
                for node in self._nodes.values()
                if not node.lost and (include_drained or not node.draining)
            ]
        infos: list[NodeInfo] = []
        for node, ref in asked:
            try:
                infos.append(ray.get(ref, timeout=ACTOR_READY_TIMEOUT))
            except (RayActorError, GetTimeoutError):
                self.mark_lost(node.node_id)
        return infos

    def schedulable(self) -> list[tuple[str, str, Any, int]]:
        """``(node_id, ip, actor, slots)`` of each live, undrained node (no round trip)."""
        with self._lock:
            return [
                (n.node_id, n.ip, n.actor, n.slots)
                for n in self._nodes.values()
                if not n.lost and not n.draining
            ]

    def mark_lost(self, node_id: str) -> None:
        with self._lock:
            node = self._nodes.get(node_id)
            if node is not None:
                node.lost = True

    def is_lost(self, node_id: str) -> bool:
        with self._lock:
            node = self._nodes.get(node_id)
            return node is None or node.lost

    def drain(self, node_id: str) -> NodeInfo:
        """Send nothing new to ``node_id``: batches and ``create`` skip it from now on;
        what runs there finishes, sandboxes held there live until killed."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise InvalidArgumentError(f"no sandlot node for Ray node {node_id!r}")
            node.draining = True
        return self._call(node, node.actor.drain)  # type: ignore[no-any-return]

    # --- sandboxes ----------------------------------------------------------------------

    def create(
        self,
        *,
        node_id: str | None = None,
        resources: Mapping[str, Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = 300.0,
    ) -> ClusterSandbox:
        """Start a sandbox on the node with the most free slots (or on ``node_id``).

        Raises :class:`NoCapacity` when no live, undrained node has a free slot."""
        if node_id is not None:
            with self._lock:
                node = self._nodes.get(node_id)
            if node is None or node.lost or node.draining:
                raise NoCapacity(f"Ray node {node_id!r} has no live, undrained sandlot node")
            candidates = [node]
        else:
            free = {info.node_id: info.free for info in self.nodes()}
            with self._lock:
                candidates = sorted(
                    (n for n in self._nodes.values() if free.get(n.node_id, 0) > 0),
                    key=lambda n: -free[n.node_id],
                )
            if not candidates:
                raise NoCapacity("no sandlot node in the Ray cluster has a free slot")
        node = candidates[0]
        key: str = self._call(node, node.actor.create, resources, envs, timeout)
        return ClusterSandbox(self, node, key)

    def _call(self, node: _Node, method: Any, *args: Any) -> Any:
        """Call a node actor's method and wait, with the node's loss as NodeLost and a
        sandlot error raised inside the actor as itself."""
        if node.lost:
            raise NodeLost(f"sandlot node {node.ip} ({node.node_id}) left the cluster")
        try:
            return ray.get(method.remote(*args))
        except RayActorError as exc:
            self.mark_lost(node.node_id)
            raise NodeLost(
                f"sandlot node {node.ip} ({node.node_id}) left the cluster: {type(exc).__name__}"
            ) from None
        except RayTaskError as exc:
            if isinstance(exc.cause, SandlotError):
                raise exc.cause from None
            raise

    def close(self) -> None:
        """Kill every sandlot node actor this driver started (and their sandboxes)."""
        with self._lock:
            nodes = list(self._nodes.values())
            self._nodes.clear()
        for node in nodes:
            if node.lost:
                continue
            # Already gone with its node, or hung: ray.kill ends it either way.
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(node.actor.shutdown.remote(), timeout=ACTOR_READY_TIMEOUT)
            ray.kill(node.actor)

    def __enter__(self) -> SandlotCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClusterSandbox:
    """A sandbox held by one sandlot node; every call goes to that node.

    After the node leaves the cluster every call raises :class:`sandlot.NodeLost`."""

    def __init__(self, cluster: SandlotCluster, node: _Node, key: str) -> None:
        self._cluster = cluster
        self._node = node
        self.sandbox_id = key
        self.files = ClusterFiles(self)

    @property
    def node_id(self) -> str:
        return self._node.node_id

    @property
    def node_ip(self) -> str:
        return self._node.ip

    def _call(self, name: str, *args: Any) -> Any:
        return self._cluster._call(
            self._node, getattr(self._node.actor, name), self.sandbox_id, *args
        )

    def run_code(
        self, code: str, language: str | None = None, timeout: float | None = None
    ) -> Execution:
        """Run a cell in this sandbox (state carries over between calls, as locally)."""
        return self._call("run_code", code, language, timeout)  # type: ignore[no-any-return]

    def is_running(self) -> bool:
        try:
            return bool(self._call("is_running"))
        except NodeLost:
            return False

    def kill(self) -> None:
        """Kill the sandbox. Idempotent; a sandbox whose node is gone is already dead."""
        with contextlib.suppress(NodeLost):
            self._call("kill")

    def __enter__(self) -> ClusterSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"ClusterSandbox({self.sandbox_id!r}, node={self._node.ip})"


class ClusterFiles:
    """``files`` of a :class:`ClusterSandbox`: the workspace calls of ``Sandbox.files``."""

    def __init__(self, sandbox: ClusterSandbox) -> None:
        self._sandbox = sandbox

    def write(self, path: str, data: str | bytes) -> WriteInfo:
        return self._sandbox._call("write", path, data)  # type: ignore[no-any-return]

    def read(self, path: str, format: str = "text") -> str | bytes:
        if format not in ("text", "bytes"):
            raise InvalidArgumentError("format must be 'text' or 'bytes'")
        return self._sandbox._call("read", path, format == "bytes")  # type: ignore[no-any-return]

    def list(self, path: str = ".", depth: int = 1) -> list[EntryInfo]:
        return self._sandbox._call("list", path, depth)  # type: ignore[no-any-return]

    def exists(self, path: str) -> bool:
        return bool(self._sandbox._call("exists", path))

    def remove(self, path: str) -> None:
        self._sandbox._call("remove", path)
