"""The sandlot node: one Ray actor pinned to each Ray node, holding that node's sandboxes.

The actor is a threaded actor (``max_concurrency``): each call runs on its own thread,
so a long cell on one sandbox never holds up another sandbox's call, and ``info()``
answers while every slot is busy. The class itself knows nothing of Ray's scheduling;
:class:`sandlot.ray.SandlotCluster` pins it (``NodeAffinitySchedulingStrategy``, not
soft) and talks to it.

Everything here goes through sandlot's public API (``Sandbox``, ``Pool``), so a node
isolates code exactly as a single machine does: same backends ("auto" by default),
same limits, same fail-closed refusals. A program in a batch gets a fresh sandbox from
the node's warm pool and the sandbox is killed after it, so nothing one program leaves
behind (files, processes, kernel state) can reach the next.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandlot import (
    EntryInfo,
    Execution,
    Pool,
    Sandbox,
    SandboxClosed,
    SandboxStartError,
    SandlotError,
    WriteInfo,
)
from sandlot.ray._program import DEFAULT_PROGRAM_TIMEOUT, BatchExecution, Program

REFUSALS = frozenset({"NodeFull", "NodeDraining"})
"""``error.name`` of a program a node refused without running it (the batch moves it)."""
START_MARGIN = 60.0
"""Seconds a batch program's sandbox may live beyond its cell timeout (start, files)."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node advertises: who it is and how much it can still take."""

    node_id: str
    """The Ray node ID (hex)."""
    ip: str
    slots: int
    """Sandboxes and batch programs it runs at once, at most."""
    sandboxes: int
    """Sandboxes it holds for callers (``SandlotCluster.create``)."""
    running: int
    """Batch programs running now."""
    draining: bool
    """Drained: it takes nothing new; what it holds runs on until killed."""

    @property
    def free(self) -> int:
        """Slots it can still give out (0 while draining)."""
        return 0 if self.draining else max(0, self.slots - self.sandboxes - self.running)


class SandlotNode:
    """The body of a node actor. Public methods are the actor's remote methods.

    :param node_id: the Ray node this actor must run on (checked: a node actor that
        landed elsewhere would report the wrong node for every sandbox).
    :param slots: sandboxes plus batch programs at once.
    :param backend: the isolation backend, as for ``Sandbox(backend=...)``.
    :param template: the template of every sandbox.
    :param pool_size: warm sandboxes the node keeps per key for batch programs.
    :param preload: modules each pooled sandbox imports first (see :class:`sandlot.Pool`).
    """

    def __init__(
        self,
        node_id: str,
        ip: str,
        *,
        slots: int,
        backend: str = "auto",
        template: str = "python-data",
        pool_size: int = 2,
        preload: tuple[str, ...] = (),
    ) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        if here != node_id:
            raise SandboxStartError(
                f"the sandlot node for Ray node {node_id} was scheduled on {here}; "
                "node actors must be pinned to their node"
            )
        self._node_id = node_id
        self._ip = ip
        self._slots = slots
        self._backend = backend
        self._template = template
        self._lock = threading.Lock()
        self._sandboxes: dict[str, Sandbox] = {}
        self._running = 0
        self._draining = False
        self._ids = itertools.count(1)
        self._pool = Pool(size=pool_size, preload=preload, backend=backend)

    # --- capacity ---------------------------------------------------------------------

    def info(self) -> NodeInfo:
        with self._lock:
            return self._info()

    def _info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self._node_id,
            ip=self._ip,
            slots=self._slots,
            sandboxes=len(self._sandboxes),
            running=self._running,
            draining=self._draining,
        )

    def drain(self) -> NodeInfo:
        """Take nothing new from now on; what the node holds runs on until killed. The
        warm pool is closed (its ready sandboxes killed): nothing will take them."""
        with self._lock:
            self._draining = True
        self._pool.close()
        return self.info()

    def _refusal(self) -> tuple[str, str] | None:
        """Why the node cannot take one more sandbox or program now, as ``(name,
        message)``, or None. A full or drained node says so at once, never queues."""
        where = f"sandlot node {self._ip} ({self._node_id})"
        if self._draining:
            return "NodeDraining", f"{where} is draining"
        if len(self._sandboxes) + self._running >= self._slots:
            return "NodeFull", f"{where} is full ({self._slots} slots)"
        return None

    # --- sandboxes held for callers -----------------------------------------------------

    def create(
        self,
        resources: Mapping[str, Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = 300.0,
    ) -> str:
        """Start a sandbox on this node and hold it; returns its id on this node."""
        with self._lock:
            refused = self._refusal()
            if refused is not None:
                raise SandboxStartError(refused[1])
            key = f"{self._node_id[:12]}-{next(self._ids)}"
            self._running += 1  # the slot is taken while it starts
        try:
            sandbox = Sandbox(
                self._template,
                backend=self._backend,
                resources=resources,
                envs=envs,
                timeout=timeout,
            )
        finally:
            with self._lock:
                self._running -= 1
        with self._lock:
            self._sandboxes[key] = sandbox
        return key

    def _get(self, key: str) -> Sandbox:
        with self._lock:
            sandbox = self._sandboxes.get(key)
        if sandbox is None:
            raise SandboxClosed(f"no sandbox {key!r} on sandlot node {self._ip}")
        return sandbox

    def run_code(
        self, key: str, code: str, language: str | None = None, timeout: float | None = None
    ) -> Execution:
        return self._get(key).run_code(code, language=language, timeout=timeout)

    def write(self, key: str, path: str, data: str | bytes) -> WriteInfo:
        return self._get(key).files.write(path, data)

    def read(self, key: str, path: str, binary: bool = False) -> str | bytes:
        files = self._get(key).files
        return files.read(path, format="bytes") if binary else files.read(path)

    def list(self, key: str, path: str = ".", depth: int = 1) -> list[EntryInfo]:
        return self._get(key).files.list(path, depth=depth)

    def exists(self, key: str, path: str) -> bool:
        return self._get(key).files.exists(path)

    def remove(self, key: str, path: str) -> None:
        self._get(key).files.remove(path)

    def is_running(self, key: str) -> bool:
        with self._lock:
            sandbox = self._sandboxes.get(key)
        return sandbox is not None and sandbox.is_running()

    def kill(self, key: str) -> bool:
        """Kill a held sandbox; False if this node holds none by that id."""
        with self._lock:
            sandbox = self._sandboxes.pop(key, None)
        if sandbox is None:
            return False
        sandbox.kill()
        return True

    # --- batch programs -----------------------------------------------------------------

    def run_program(
        self,
        program: Program,
        timeout: float | None = None,
        memory_mb: int | None = None,
    ) -> BatchExecution:
        """Run one program in a fresh sandbox from the warm pool, then kill the sandbox.

        Never raises for the program: a sandbox that cannot start or a refused file come
        back as the Execution's error; a full or draining node answers at once with
        ``error.name`` in :data:`REFUSALS` and runs nothing."""
        cell_timeout = program.timeout or timeout or DEFAULT_PROGRAM_TIMEOUT
        memory = program.memory_mb or memory_mb
        with self._lock:
            refused = self._refusal()
            if refused is None:
                self._running += 1
        if refused is not None:
            # Not the program's failure: the batch gives it to another node.
            return self._failed(*refused)
        try:
            with Sandbox(
                self._template,
                backend=self._backend,
                pool=self._pool,
                resources=None if memory is None else {"memory_mb": memory},
                envs=program.envs,
                timeout=cell_timeout + START_MARGIN,
                precheck="off",
            ) as sandbox:
                for path, data in program.files.items():
                    sandbox.files.write(path, data)
                execution = sandbox.run_code(
                    program.code, language=program.language, timeout=cell_timeout
                )
        except SandlotError as exc:
            return self._failed(type(exc).__name__, str(exc))
        finally:
            with self._lock:
                self._running -= 1
        return BatchExecution.of(execution, node_id=self._node_id, node_ip=self._ip)

    def _failed(self, name: str, message: str) -> BatchExecution:
        return BatchExecution.failed(
            "error", name, message, node_id=self._node_id, node_ip=self._ip
        )

    # --- end ------------------------------------------------------------------------------

    def shutdown(self) -> int:
        """Kill every sandbox the node holds and its pool; how many were held."""
        with self._lock:
            self._draining = True
            held = list(self._sandboxes.values())
            self._sandboxes.clear()
        for sandbox in held:
            sandbox.kill()
        self._pool.close()
        return len(held)
