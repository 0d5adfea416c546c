"""A warm pool of ready sandboxes, so ``Sandbox()`` does not wait for a cold start.

::

    from sandlot import Pool, Sandbox

    with Pool(size=4, ttl=300) as pool:          # numpy, pandas, pyplot pre-imported
        pool.warm()                              # fill the default key now (optional)
        with Sandbox(pool=pool) as sbx:          # a ready sandbox, or a cold start
            sbx.run_code("import pandas as pd")  # already imported: instant
        print(pool.stats())                      # PoolStats(hits=1, misses=0, size=..)

``Sandbox(pool=True)`` uses one process-wide pool (:func:`default_pool`). Without
``pool`` nothing changes: every ``Sandbox()`` starts its own sandbox.

What a pool keeps. One queue of started sandboxes per key: the backend's
:meth:`~sandlot.backends.Backend.pool_key` (its name, and for containers the engine,
OCI runtime and CPUs), template, resources, envs, network policy,
``unsafe_best_effort_limits`` and the preload list, so a sandbox is only handed to a
caller who would have started exactly the same one. Every backend works: for bubblewrap
a pooled sandbox is a started process tree, for Docker and Podman a running container;
either way taking one costs a queue hand-off, not a start plus the imports. Each has the
pool's ``preload`` modules imported in its default kernel before it counts as ready
(matplotlib with the Agg backend, then ``gc.freeze()``), and has run one silent
``None`` cell (so the caller's first cell does not pay for the kernel's first page
copies); imports land in ``sys.modules`` only, so user code sees the same empty
namespace, ``execution_count``,
files, limits, cgroup, seccomp filter and uid as in a sandbox started on demand.
A sandbox leaves the pool once, to one caller, and is never returned to it: a used
sandbox is killed as usual.

Refill. Background threads start sandboxes, up to ``starts`` at a time (by default
one per CPU, at most four: a start mostly waits on the kernel and the sandbox, so a
single thread would cap a pool at one start's latency), until each key that was used
(or warmed) within ``ttl`` seconds has ``size`` ready ones. A ready sandbox idle
for ``ttl`` seconds is killed and, if its key is idle too, not replaced, so a pool
for keys nobody asks for shrinks to nothing. A miss (no ready sandbox) starts one on
the caller's thread with the same spec, so it behaves exactly like a hit, only later.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sandlot._exceptions import InvalidArgumentError, SandboxClosed, SandboxStartError
from sandlot.backends import Backend, SandboxHandle, get_backend
from sandlot.policy import DATA_STACK, Resources, SandboxSpec
from sandlot.safetext import escape

log = logging.getLogger("sandlot.pool")

DEFAULT_SIZE = 2
DEFAULT_TTL = 300.0
MAX_DEFAULT_STARTS = 4
RETRY_MAX = 30.0
"""Longest pause, seconds, between background starts that keep failing."""
REFILL_DELAY = 0.05
"""Seconds the refill behind a hit waits before it starts: a start is a fork and a
warm-up cell, tens of milliseconds of CPU, and started at once it competes with the
caller's own first cells on a small host (on 2 cores, E2B's client from create to
first result through ``sandlot serve``: 29 -> 19 ms p50). A miss refills at once."""

_PoolKey = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool's counters (all keys together)."""

    hits: int = 0
    """Sandboxes handed out ready."""
    misses: int = 0
    """Sandboxes the caller had to wait for (nothing ready for its key)."""
    size: int = 0
    """Ready sandboxes now."""
    starting: int = 0
    """Sandboxes the refill threads are starting now."""
    expired: int = 0
    """Ready sandboxes killed after ``ttl`` idle seconds, or found dead."""
    failed: int = 0
    """Background starts that failed (the caller's own start reports its error)."""
    keys: int = 0
    """Distinct (backend, template, resources, envs, ...) combinations seen."""

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class _Bucket:
    backend: Backend
    spec: SandboxSpec
    last_used: float
    ready: collections.deque[tuple[SandboxHandle, float]] = dataclasses.field(
        default_factory=collections.deque
    )
    starting: int = 0
    retry_at: float = 0.0
    """No start for this key before then (a failure's backoff, or a hit's refill delay)."""
    backoff: float = 0.0


class Pool:
    """Keeps ``size`` ready sandboxes per key, refilled in the background.

    :param size: ready sandboxes to keep per key (0 keeps none: every use is a miss).
    :param ttl: seconds a ready sandbox may wait unused, and a key may go unused
        before the pool stops refilling it; None keeps them forever.
    :param preload: modules each pooled sandbox imports in its default kernel before
        it counts as ready (default :data:`DATA_STACK`; ``()`` for none).
    :param backend: the backend :meth:`warm` starts on (``Sandbox`` passes its own).
    :param starts: background starts that may run at once (default: one per CPU, at
        most four).
    """

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        *,
        ttl: float | None = DEFAULT_TTL,
        preload: Iterable[str] = DATA_STACK,
        backend: str | Backend = "auto",
        starts: int | None = None,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidArgumentError(f"pool size must be an integer >= 0, not {size!r}")
        if ttl is not None and (isinstance(ttl, bool) or not ttl > 0):
            raise InvalidArgumentError(f"pool ttl must be a positive number or None, not {ttl!r}")
        if starts is None:
            starts = max(1, min(MAX_DEFAULT_STARTS, os.cpu_count() or 1))
        if not isinstance(starts, int) or isinstance(starts, bool) or starts < 1:
            raise InvalidArgumentError(f"pool starts must be an integer >= 1, not {starts!r}")
        if isinstance(preload, str):
            raise InvalidArgumentError("preload must be a collection of module names")
        self.size = size
        self.starts = starts
        self.ttl = None if ttl is None else float(ttl)
        # Validated here (PolicyError) rather than on the first start in the background.
        self.preload = SandboxSpec(preload=tuple(preload)).preload
        self._backend = backend
        self._cond = threading.Condition()
        self._buckets: dict[_PoolKey, _Bucket] = {}
        self._hits = self._misses = self._expired = self._failed = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        _OPEN.add(self)

    # --- public -------------------------------------------------------------------------
    def warm(
        self,
        template: str = "python-data",
        *,
        resources: Resources | Mapping[str, Any] | None = None,
        envs: Mapping[str, str] | None = None,
        unsafe_best_effort_limits: bool = False,
    ) -> None:
        """Start filling the key these ``Sandbox()`` arguments make (returns at once)."""
        spec = SandboxSpec(
            template=template,
            resources=Resources.coerce(resources),
            envs=dict(envs or {}),
            unsafe_best_effort_limits=unsafe_best_effort_limits,
            preload=self.preload,
        )
        backend = get_backend(self._backend)
        with self._cond:
            self._check_open()
            self._bucket(spec, backend).last_used = time.monotonic()
            self._wake()

    def acquire(self, spec: SandboxSpec, backend: Backend) -> SandboxHandle:
        """A started sandbox for ``spec``: a ready one if there is one, else a new one.

        Used by ``Sandbox``; ``spec.preload`` must be this pool's ``preload``."""
        if spec.preload != self.preload:
            raise InvalidArgumentError("the spec's preload differs from the pool's")
        dead: list[SandboxHandle] = []
        try:
            with self._cond:
                self._check_open()
                bucket = self._bucket(spec, backend)
                bucket.last_used = time.monotonic()
                while bucket.ready:
                    handle, _ = bucket.ready.popleft()
                    if handle.alive:
                        self._hits += 1
                        bucket.retry_at = max(bucket.retry_at, time.monotonic() + REFILL_DELAY)
                        self._wake()
                        return handle
                    dead.append(handle)
                    self._expired += 1
                self._misses += 1
                self._wake()
        finally:
            for handle in dead:
                handle.kill()
        return backend.start(spec)

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                hits=self._hits,
                misses=self._misses,
                size=sum(len(b.ready) for b in self._buckets.values()),
                starting=sum(b.starting for b in self._buckets.values()),
                expired=self._expired,
                failed=self._failed,
                keys=len(self._buckets),
            )

    def close(self) -> None:
        """Stop refilling and kill every ready sandbox (sandboxes handed out live on)."""
        with self._cond:
            self._closed = True
            handles = [h for b in self._buckets.values() for h, _ in b.ready]
            for bucket in self._buckets.values():
                bucket.ready.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        for handle in handles:
            handle.kill()
        for thread in threads:
            if thread is not threading.current_thread():
                # A start in progress finishes first; its sandbox is then killed.
                thread.join()
        _OPEN.discard(self)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pool(size={self.size}, ttl={self.ttl}, preload={self.preload}, {self.stats()})"

    # --- internals (hold self._cond) -----------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox pool was closed")

    def _bucket(self, spec: SandboxSpec, backend: Backend) -> _Bucket:
        key = _key(spec, backend)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(backend, spec, time.monotonic())
        return bucket

    def _wake(self) -> None:
        # Started on first use: a pool nobody uses keeps no threads.
        while len(self._threads) < self.starts:
            name = f"sandlot-pool-{len(self._threads)}"
            thread = threading.Thread(target=self._refill, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()
        self._cond.notify_all()

    def _wanted(self, bucket: _Bucket, now: float) -> bool:
        if len(bucket.ready) + bucket.starting >= self.size or now < bucket.retry_at:
            return False
        return self.ttl is None or now - bucket.last_used < self.ttl

    def _collect_expired(self, now: float) -> list[SandboxHandle]:
        gone: list[SandboxHandle] = []
        for bucket in self._buckets.values():
            keep = collections.deque(
                (h, born)
                for h, born in bucket.ready
                if h.alive and (self.ttl is None or now - born < self.ttl)
            )
            gone.extend(h for h, _ in bucket.ready if all(h is not k for k, _ in keep))
            bucket.ready = keep
        self._expired += len(gone)
        return gone

    def _next_wakeup(self, now: float) -> float:
        """Seconds until the next expiry or retry (at most a few, to notice deaths)."""
        times = [5.0]
        for bucket in self._buckets.values():
            if bucket.retry_at > now:
                times.append(bucket.retry_at - now)
            if self.ttl is not None:
                times.extend(born + self.ttl - now for _, born in bucket.ready)
        return max(0.01, min(times))

    # --- the refill thread ------------------------------------------------------------------
    def _refill(self) -> None:
        """One of up to ``starts`` refill threads: each takes the next wanted start."""
        while True:
            bucket: _Bucket | None = None
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    gone = self._collect_expired(now)
                    if gone:
                        break
                    bucket = next((b for b in self._buckets.values() if self._wanted(b, now)), None)
                    if bucket is not None:
                        bucket.starting += 1
                        break
                    self._cond.wait(self._next_wakeup(now))
            for handle in gone:
                handle.kill()
            if bucket is not None:
                self._start_one(bucket)

    def _start_one(self, bucket: _Bucket) -> None:
        handle: SandboxHandle | None = None
        try:
            handle = bucket.backend.start(bucket.spec)
            _warm_up(handle)
        except Exception as exc:  # reported to callers by their own (miss) starts
            log.warning("sandbox pool: a background start failed: %s", escape(exc, 1024))
            if handle is not None:
                handle.kill()
                handle = None
        with self._cond:
            bucket.starting -= 1
            if handle is None:
                self._failed += 1
                bucket.backoff = min(RETRY_MAX, max(0.5, bucket.backoff * 2))
                bucket.retry_at = time.monotonic() + bucket.backoff
            else:
                bucket.backoff = 0.0
                if not self._closed:
                    bucket.ready.append((handle, time.monotonic()))
                    self._cond.notify_all()
                    return
        if handle is not None:
            handle.kill()  # the pool closed while it started


WARM_UP_TIMEOUT = 30.0
"""Seconds a ready sandbox's warm-up cell may take before the sandbox is discarded."""


def _warm_up(handle: SandboxHandle) -> None:
    """Run one silent ``None`` cell in the sandbox's default kernel before it counts as
    ready: a forked kernel copies each page it first writes to, and the first cell
    writes many (a millisecond or more of the caller's first cell otherwise). Silent:
    ``execution_count`` stays 0; ``None`` sets no ``_``. Raises if the cell fails."""
    stream = handle.request(
        {
            "type": "execute",
            "id": "pool-warm-up",
            "code": "None",
            "context": "default",
            "envs": {},
            "timeout": WARM_UP_TIMEOUT,
            "silent": True,
        }
    )
    try:
        deadline = time.monotonic() + WARM_UP_TIMEOUT
        while (event := stream.next(max(0.0, deadline - time.monotonic()))) is not None:
            if event["type"] == "exit":
                if event.get("status") != "ok":
                    raise SandboxStartError(f"the warm-up cell ended {event.get('status')!r}")
                return
        raise SandboxStartError("the warm-up cell did not end in time")
    finally:
        stream.close()


def _key(spec: SandboxSpec, backend: Backend) -> _PoolKey:
    return (
        backend.pool_key(),
        spec.template,
        spec.resources,
        tuple(sorted(spec.envs.items())),
        spec.network,
        spec.unsafe_best_effort_limits,
        spec.preload,
    )


_OPEN: weakref.WeakSet[Pool] = weakref.WeakSet()
_DEFAULT: Pool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> Pool:
    """The process-wide pool ``Sandbox(pool=True)`` uses (size 2, ttl 300 s, data stack)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = Pool()
        return _DEFAULT


@atexit.register
def _close_all() -> None:
    # Ready sandboxes would die with this process anyway (--die-with-parent); closing
    # them here also removes their cgroups instead of leaving them to the next sweep.
    for pool in list(_OPEN):
        pool.close()
