"""``run_batch``: many independent programs across the cluster, Executions in order.

The driver loop, in one thread and without a queue on any node:

- submit: each live, undrained node gets programs (in input order) until it has
  ``in_flight`` of them outstanding; nothing else is submitted, so a million-program
  batch holds at most ``nodes x in_flight`` object refs and a node never queues work
  it cannot start (backpressure);
- wait for whichever finishes first (``ray.wait``), store it at its input index,
  report progress, refill that node;
- refresh the membership every ``refresh`` seconds: a node that joined gets work from
  then on, a drained one gets none.

A failure is data on the program's Execution and never ends the batch: the program's
own errors, timeouts and OOM kills come from the sandbox as usual; a program whose node
left the cluster gets ``status="died"``, ``error.name="SandboxLostError"`` (it is not
run again elsewhere: a program may have effects, through its network policy, that must
not happen twice; the caller decides); programs nobody can take (no live node) get
``status="error"``, ``error.name="NoCapacity"``.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ray.exceptions import RayActorError, RayTaskError

import ray
from sandlot import InvalidArgumentError
from sandlot.ray._cluster import SandlotCluster
from sandlot.ray._node import REFUSALS
from sandlot.ray._program import BatchExecution, Program

REFRESH_EVERY = 2.0
"""Seconds between membership refreshes during a batch (new nodes, lost nodes)."""
NO_NODE_GRACE = 30.0
"""Seconds a batch waits for a node to (re)appear when none is live before it gives
the remaining programs up as NoCapacity."""


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """Where a batch stands; passed to ``progress`` once programs have been submitted
    and then whenever some finished (several may finish between two reports)."""

    done: int
    total: int
    in_flight: int
    failed: int
    """Finished with an error of any kind (user code, timeout, OOM, lost, ...)."""
    lost: int
    """Lost with their node (a subset of ``failed``)."""
    nodes: int
    """Nodes taking work now."""
    in_flight_by_node: Mapping[str, int] = field(default_factory=dict)
    """Programs outstanding on each node (Ray node ID), as just submitted."""
    finished: tuple[tuple[int, BatchExecution], ...] = ()
    """``(input index, Execution)`` of the programs that finished since the last report."""


ProgressCallback = Callable[[BatchProgress], object]


class _Bar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._drawn = 0.0

    def __call__(self, p: BatchProgress) -> None:
        now = time.monotonic()
        if p.done < p.total and now - self._drawn < 0.1:
            return
        self._drawn = now
        stream = self._stream or sys.stderr  # looked up now: it may have been replaced
        width = 30
        filled = width * p.done // max(1, p.total)
        stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {p.done}/{p.total}"
            f" failed={p.failed} lost={p.lost} nodes={p.nodes}"
        )
        if p.done == p.total:
            stream.write("\n")
        stream.flush()


def run_batch(
    programs: Sequence[Program | str],
    *,
    cluster: SandlotCluster | None = None,
    in_flight: int | None = None,
    timeout: float | None = None,
    memory_mb: int | None = None,
    progress: bool | ProgressCallback = False,
    refresh: float = REFRESH_EVERY,
) -> list[BatchExecution]:
    """Run independent programs across the Ray cluster; one Execution each, in order.

    Each program runs in a fresh sandbox on one node (from that node's warm pool) that is
    killed afterwards: no state passes between programs. Never raises for a program:
    every failure is on its Execution (see the module's docstring).

    :param programs: :class:`Program` items, or code strings.
    :param cluster: the nodes to use (default: a :class:`SandlotCluster` made for this
        call on the connected Ray cluster, closed at the end).
    :param in_flight: programs outstanding per node at once (default: the node's slots).
    :param timeout: each program's cell timeout, seconds, unless it sets its own
        (default 30).
    :param memory_mb: each program's sandbox memory, MiB, unless it sets its own.
    :param progress: True for a progress bar on stderr, or a callable that gets a
        :class:`BatchProgress` after each finished program.
    :param refresh: seconds between looks for nodes that joined or left.
    """
    items = [Program.coerce(p) for p in programs]
    if in_flight is not None and (
        isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1
    ):
        raise InvalidArgumentError(f"in_flight must be an integer >= 1, not {in_flight!r}")
    # Checked here, once, rather than as a bad Execution per program on the nodes.
    Program("", timeout=timeout, memory_mb=memory_mb)
    report: ProgressCallback | None = _Bar() if progress is True else progress or None
    own = cluster is None
    active = SandlotCluster() if cluster is None else cluster
    try:
        return _Batch(active, items, in_flight, timeout, memory_mb, report, refresh).run()
    finally:
        if own:
            active.close()


class _Batch:
    def __init__(
        self,
        cluster: SandlotCluster,
        programs: list[Program],
        in_flight: int | None,
        timeout: float | None,
        memory_mb: int | None,
        report: ProgressCallback | None,
        refresh: float,
    ) -> None:
        self.cluster = cluster
        self.programs = programs
        self.in_flight = in_flight
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.report = report
        self.refresh_every = refresh
        self.results: list[BatchExecution | None] = [None] * len(programs)
        # ref -> (input index, node id, node ip)
        self.pending: dict[Any, tuple[int, str, str]] = {}
        self.per_node: dict[str, int] = {}
        self.next = 0
        self.done = self.failed = self.lost = 0
        self.nodes = 0
        self.finished: list[tuple[int, BatchExecution]] = []
        # Programs a node refused unrun (full with sandboxes held for callers, or
        # drained by someone else): submitted again, before the next new one.
        self.requeued: collections.deque[int] = collections.deque()
        # Nodes that refused as full: no more until one of theirs finishes.
        self.full: set[str] = set()

    def run(self) -> list[BatchExecution]:
        total = len(self.programs)
        last_refresh = -float("inf")  # look for nodes that joined since the cluster was made
        no_node_since: float | None = None
        while self.done < total:
            now = time.monotonic()
            if now - last_refresh >= self.refresh_every:
                self.cluster.refresh()
                self.full.clear()  # held sandboxes may have been killed since
                last_refresh = now
            if self._submit() or self.finished:
                self._progress()
            if not self.pending:
                # Nothing running and nothing could be submitted: no live node. Wait a
                # bounded while for one to join, then give the rest up as data.
                no_node_since = now if no_node_since is None else no_node_since
                if now - no_node_since >= NO_NODE_GRACE:
                    self._give_up()
                    break
                time.sleep(min(self.refresh_every, 0.5))
                self.cluster.refresh()
                self.full.clear()
                last_refresh = time.monotonic()
                continue
            no_node_since = None
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=self.refresh_every)
            if ready:
                # Collect everything else that is ready too, in one call.
                ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
            for ref in ready:
                self._collect(ref)
        if self.finished:
            self._progress()
        return [r for r in self.results if r is not None]

    def _submit(self) -> bool:
        """Fill every schedulable node up to its limit; whether anything was submitted."""
        submitted = False
        nodes = self.cluster.schedulable()
        self.nodes = len(nodes)
        # Least-loaded first, so a node that just joined is filled before the others
        # get their next program.
        nodes.sort(key=lambda n: self.per_node.get(n[0], 0))
        progressed = True
        while progressed and (self.requeued or self.next < len(self.programs)):
            progressed = False
            for node_id, ip, actor, slots in nodes:
                if not self.requeued and self.next >= len(self.programs):
                    break
                limit = self.in_flight or slots
                if node_id in self.full or self.per_node.get(node_id, 0) >= limit:
                    continue
                if self.requeued:
                    index = self.requeued.popleft()
                else:
                    index = self.next
                    self.next += 1
                ref = actor.run_program.remote(self.programs[index], self.timeout, self.memory_mb)
                self.pending[ref] = (index, node_id, ip)
                self.per_node[node_id] = self.per_node.get(node_id, 0) + 1
                progressed = submitted = True
        return submitted

    def _collect(self, ref: Any) -> None:
        index, node_id, ip = self.pending.pop(ref)
        self.per_node[node_id] -= 1
        try:
            execution: BatchExecution = ray.get(ref)
        except RayActorError as exc:
            # The node's actor is gone, and with it the sandbox the program ran in.
            self.cluster.mark_lost(node_id)
            self.lost += 1
            execution = BatchExecution.failed(
                "died",
                "SandboxLostError",
                f"sandlot node {ip} ({node_id}) left the cluster while it held this "
                f"program: {type(exc).__name__}",
                node_id=node_id,
                node_ip=ip,
            )
        except RayTaskError as exc:
            # A bug in the node actor, not the program: still data, never the batch's end.
            cause = exc.cause if exc.cause is not None else exc
            execution = BatchExecution.failed(
                "error", type(cause).__name__, str(cause), node_id=node_id, node_ip=ip
            )
        self.full.discard(node_id)
        if execution.error is not None and execution.error.name in REFUSALS:
            if execution.error.name == "NodeFull":
                self.full.add(node_id)
            self.requeued.append(index)
            return
        self.results[index] = execution
        self.done += 1
        if execution.error is not None:
            self.failed += 1
        self.finished.append((index, execution))

    def _give_up(self) -> None:
        for index in [*self.requeued, *range(self.next, len(self.programs))]:
            execution = BatchExecution.failed(
                "error", "NoCapacity", "no live, undrained sandlot node in the Ray cluster"
            )
            self.results[index] = execution
            self.done += 1
            self.failed += 1
            self.finished.append((index, execution))
        self.requeued.clear()
        self.next = len(self.programs)
        self._progress()

    def _progress(self) -> None:
        finished, self.finished = tuple(self.finished), []
        if self.report is None:
            return
        self.report(
            BatchProgress(
                done=self.done,
                total=len(self.programs),
                in_flight=len(self.pending),
                failed=self.failed,
                lost=self.lost,
                nodes=self.nodes,
                in_flight_by_node={k: v for k, v in self.per_node.items() if v},
                finished=finished,
            )
        )
