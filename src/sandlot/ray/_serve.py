"""``sandlot serve --ray ADDRESS``: sandlot's HTTP API in front of a Ray cluster.

Two parts (docs/ray.md, "The front door"):

* a **node service** on every Ray node: a detached Ray actor pinned to the node
  (``NodeAffinitySchedulingStrategy``, not soft) that runs the ordinary sandlot server
  (``sandlot.server.create_app``) on the node's own address, with a
  :class:`~sandlot.server.ClusterStore` on the shared database. Detached: it belongs
  to no front door, so a front door that exits or dies takes no sandbox with it; it
  ends with its node (or ``ray.kill``).
* the **front door** (:class:`sandlot.server.FrontDoor`): places creates, routes every
  later call to the node that holds the sandbox, and turns a node's loss into
  ``NodeLost`` for that node's sandboxes only. :class:`RayDirectory` tells it which
  nodes exist and starts a node service on each node that joins.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray
from sandlot import InvalidArgumentError, SandboxStartError
from sandlot.ray._cluster import ray_draining
from sandlot.server import ClusterStore, NodeRef, ServerSettings, create_app, create_front_door

log = logging.getLogger("sandlot.ray")

NAMESPACE = "sandlot"
"""Ray namespace of the node services: every front door finds the same ones by name."""
SERVICE_NAME = "sandlot-serve-{node_id}"
START_TIMEOUT = 120.0
"""Seconds a node service may take to come up (worker process, imports, recovery)."""
RETRY_AFTER = 30.0
"""Seconds before a node whose service failed to start is tried again."""


class NodeService:
    """The body of a node service actor: sandlot's server on this node's address.

    :param node_id: the Ray node it must run on (checked).
    :param ip: the node's address; the server listens there on a free port.
    :param settings: the front door's settings; the database must be the shared one.
    :param slots: sandboxes this node holds at once, at most (enforced by placement).
    """

    def __init__(self, node_id: str, ip: str, settings: ServerSettings, slots: int) -> None:
        import uvicorn

        here = ray.get_runtime_context().get_node_id()
        if here != node_id:
            raise SandboxStartError(
                f"the sandlot node service for Ray node {node_id} was scheduled on {here}; "
                "it must be pinned to its node"
            )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by each accepted connection: uvicorn sets TCP_NODELAY only on the
        # sockets it binds itself, and without it every streamed answer's second write
        # waits for the client's delayed ACK (40 ms per cell on Linux).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((ip, 0))
        sock.listen(2048)
        self.node = NodeRef(node_id, ip, f"http://{ip}:{sock.getsockname()[1]}", slots)
        node_settings = settings.replace(state_dir=settings.state_dir / f"node-{node_id[:16]}")
        store = ClusterStore(
            settings.resolved_database_url,
            node=self.node,
            audit_max_age=settings.audit_max_age,
            audit_max_rows=settings.audit_max_rows,
            audit_sync=settings.audit_sync,
        )
        app = create_app(node_settings, store=store)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            # Its clients are front doors, which drop an idle connection after 30 s
            # (NODE_KEEPALIVE): the node must never close one first, or a call could
            # be sent on a connection the node is closing.
            timeout_keep_alive=90,
        )
        self._server = uvicorn.Server(config)
        self._manager = app.state.sandlot.manager
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="sandlot-node-server",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        # Ready once uvicorn has run the app's start-up (recovery, warm pool).
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise SandboxStartError(
                    f"the sandlot server on node {ip} did not start (see the Ray worker's log)"
                )
            time.sleep(0.05)

    def describe(self) -> NodeRef:
        return self.node

    def ping(self) -> str:
        return self.node.node_id

    def shutdown(self) -> None:
        """Stop serving: running cells get the grace, every sandbox is killed."""
        self._manager.drain(self._manager.settings.shutdown_grace)
        self._server.should_exit = True
        self._thread.join(timeout=30)


class RayDirectory:
    """The sandlot nodes of a Ray cluster, for a front door (``sandlot.server.Directory``).

    :param settings: passed to each node service it starts.
    :param slots: sandboxes per node (None: the node's CPU count as Ray reports it).
    """

    def __init__(self, settings: ServerSettings, *, slots: int | None = None) -> None:
        if slots is not None and (isinstance(slots, bool) or slots < 1):
            raise InvalidArgumentError(f"slots must be an integer >= 1, not {slots!r}")
        self._settings = settings
        self._slots = slots
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeRef] = {}
        self._actors: dict[str, Any] = {}
        self._lost: set[str] = set()
        self._failed: dict[str, float] = {}
        self._draining: set[str] = set()

    def nodes(self) -> list[NodeRef]:
        with self._lock:
            return [n for key, n in self._nodes.items() if key not in self._lost]

    def draining(self) -> set[str]:
        with self._lock:
            return set(self._draining)

    def refresh(self) -> set[str]:
        listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        alive = {n["NodeID"]: n for n in listed if n["Alive"]}
        draining = ray_draining()
        now = time.monotonic()
        with self._lock:
            self._draining = draining & set(alive)
            for node_id in self._nodes:
                if node_id not in alive:
                    self._lost.add(node_id)
            new = [
                (node_id, raw)
                for node_id, raw in alive.items()
                if node_id not in self._nodes
                and node_id not in self._lost
                and now - self._failed.get(node_id, -RETRY_AFTER) >= RETRY_AFTER
            ]
        # Started in parallel, waited for outside the lock (nodes() answers meanwhile).
        started = [(node_id, self._service(node_id, raw)) for node_id, raw in new]
        for node_id, actor in started:
            try:
                node: NodeRef = ray.get(actor.describe.remote(), timeout=START_TIMEOUT)
            except (RayActorError, RayTaskError, GetTimeoutError) as exc:
                log.error("no sandlot node service on Ray node %s: %s", node_id, exc)
                with self._lock:
                    self._failed[node_id] = time.monotonic()
                continue
            with self._lock:
                self._nodes[node_id] = node
                self._actors[node_id] = actor
            log.info("sandlot node %s (%s) serves on %s", node.ip, node_id, node.url)
        with self._lock:
            return set(self._lost)

    def _service(self, node_id: str, raw: dict[str, Any]) -> Any:
        ip = str(raw.get("NodeManagerAddress", ""))
        cpus = int(raw.get("Resources", {}).get("CPU", 1) or 1)
        slots = self._slots if self._slots is not None else max(1, cpus)
        actor_class: Any = ray.remote(NodeService)
        return actor_class.options(
            name=SERVICE_NAME.format(node_id=node_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(node_id, ip, self._settings, slots)

    def confirm_lost(self, node_id: str) -> bool:
        """Asked when a node does not answer: gone if Ray says its node is dead or its
        service actor died; not (yet) if both still look alive."""
        with self._lock:
            if node_id in self._lost:
                return True
            actor = self._actors.get(node_id)
        listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        gone = not any(n["NodeID"] == node_id and n["Alive"] for n in listed)
        if not gone and actor is not None:
            try:
                ray.get(actor.ping.remote(), timeout=10)
            except RayActorError:
                gone = True
            except GetTimeoutError:
                pass
        if gone:
            with self._lock:
                self._lost.add(node_id)
        return gone

    def stop(self) -> None:
        """Stop every node service this directory knows (and kill their sandboxes)."""
        with self._lock:
            actors = [a for key, a in self._actors.items() if key not in self._lost]
        for actor in actors:
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(actor.shutdown.remote(), timeout=60)
            ray.kill(actor)


def serve_cluster(
    settings: ServerSettings,
    address: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    slots: int | None = None,
    node_ip: str | None = None,
) -> None:
    """``sandlot serve --ray ADDRESS``: join the Ray cluster at ``address`` and serve
    sandlot's HTTP API in front of it until SIGINT/SIGTERM. The node services stay up
    (other front doors may route to them); they end with their nodes.

    The database must be one every node reaches (PostgreSQL): it holds the keys, the
    audit trail and where each sandbox lives."""
    import uvicorn

    if settings.resolved_database_url.startswith("sqlite"):
        raise InvalidArgumentError(
            "sandlot serve --ray needs a database that every node and front door reaches: "
            "pass --database postgresql+psycopg://USER@HOST/DB (SQLite is one machine's)"
        )
    if not ray.is_initialized():
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            _node_ip_address=node_ip,
        )
    # httpx logs every request's URL at info level; the server's logs name sandboxes
    # and tenants, never what a tenant put in a query string.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    directory = RayDirectory(settings, slots=slots)
    door = create_front_door(settings, directory)
    uvicorn.run(
        door,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        # The front door reads no client address (the nodes audit their callers).
        proxy_headers=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
