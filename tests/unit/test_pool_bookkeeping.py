"""The warm pool's bookkeeping against :class:`sandlot.testing.FakeBackend`.

Keys, hits and misses, refill, idle expiry, failure backoff and closing, without a
sandbox. The real thing (isolation of pooled sandboxes) is in
``tests/integration/test_pool.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandlot import (
    AsyncSandbox,
    InvalidArgumentError,
    PolicyError,
    Pool,
    PoolStats,
    Sandbox,
    SandboxClosed,
)
from sandlot.policy import SandboxSpec
from sandlot.pool import DATA_STACK, REFILL_DELAY
from sandlot.testing import FakeBackend, FakeHandle, echo_handler


def _until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(echo_handler)


@pytest.fixture
def pool(backend: FakeBackend) -> Iterator[Pool]:
    with Pool(size=2, backend=backend) as pool:
        yield pool


def _filled(pool: Pool, size: int) -> None:
    _until(lambda: pool.stats().size == size, f"{size} ready sandboxes")


def test_default_sandbox_does_not_use_a_pool(backend: FakeBackend) -> None:
    with Sandbox(backend=backend) as sbx:
        sbx.run_code("1")
    assert backend.handle.spec.preload == ()
    assert len(backend.handles) == 1


def test_first_use_is_a_miss_then_the_pool_fills_and_hits(pool: Pool, backend: FakeBackend) -> None:
    with Sandbox(backend=backend, pool=pool) as sbx:
        assert sbx.run_code("1 + 1").text == "1 + 1"
    assert pool.stats().misses == 1
    _filled(pool, 2)
    starts = len(backend.handles)
    with Sandbox(backend=backend, pool=pool):
        pass
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.keys) == (1, 1, 1)
    _filled(pool, 2)  # refilled behind the hit
    assert len(backend.handles) == starts + 1


def test_pooled_sandboxes_carry_the_preload(pool: Pool, backend: FakeBackend) -> None:
    Sandbox(backend=backend, pool=pool).kill()
    _filled(pool, 2)
    assert {h.spec.preload for h in backend.handles} == {DATA_STACK}


def test_a_sandbox_leaves_the_pool_once_and_is_killed_not_returned(
    pool: Pool, backend: FakeBackend
) -> None:
    pool.warm()
    _filled(pool, 2)
    first, second = Sandbox(backend=backend, pool=pool), Sandbox(backend=backend, pool=pool)
    assert first._core._handle is not second._core._handle
    handle = first._core._handle
    assert isinstance(handle, FakeHandle)
    first.kill()
    second.kill()
    assert not handle.alive
    _filled(pool, 2)
    assert all(h.alive for h, _ in _ready(pool))
    assert handle not in [h for h, _ in _ready(pool)]


def _ready(pool: Pool) -> list[tuple[Any, float]]:
    return [item for bucket in pool._buckets.values() for item in bucket.ready]


@pytest.mark.parametrize(
    "other",
    [
        {"envs": {"A": "1"}},
        {"resources": {"memory_mb": 512}},
        {"template": "other"},
        {"unsafe_best_effort_limits": True},
        {"network": {"allow_out": ["pypi.org"]}},
    ],
)
def test_keys_never_mix(pool: Pool, backend: FakeBackend, other: dict[str, Any]) -> None:
    pool.warm()
    _filled(pool, 2)
    with Sandbox(backend=backend, pool=pool, **other):
        pass
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.keys) == (0, 1, 2)
    spec = backend.handle.spec
    assert spec.envs == other.get("envs", {})
    assert spec.template == other.get("template", "python-data")


class _OtherRuntime(FakeBackend):
    """The same backend name, another configuration (as DockerBackend(runtime="runsc"))."""

    def pool_key(self) -> tuple[object, ...]:
        return (self.name, "another runtime")


def test_backends_with_another_pool_key_never_mix(pool: Pool, backend: FakeBackend) -> None:
    pool.warm()
    _filled(pool, 2)
    other = _OtherRuntime(echo_handler)
    assert other.name == backend.name  # control: only the pool key tells them apart
    with Sandbox(backend=other, pool=pool):
        pass
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.keys) == (0, 1, 2)
    assert len(other.handles) == 1  # started by the caller's own backend


def test_dead_ready_sandboxes_are_skipped(pool: Pool, backend: FakeBackend) -> None:
    pool.warm()
    _filled(pool, 2)
    # Hold the pool's lock from the kills to the acquire: otherwise a refill thread may
    # notice the deaths first, replace both sandboxes, and the acquire becomes a plain hit
    # that never reaches the skip this test is about. (The lock is re-entrant, so the
    # acquire on this thread takes it again.)
    with pool._cond:
        dead = [handle for handle, _ in _ready(pool)]
        for handle in dead:
            handle.kill()
        sbx = Sandbox(backend=backend, pool=pool)
    with sbx:
        assert sbx._core._handle is not None and sbx._core._handle.alive
        assert sbx._core._handle not in dead
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.expired) == (0, 1, 2)


def test_idle_sandboxes_expire_and_idle_keys_are_not_refilled(backend: FakeBackend) -> None:
    with Pool(size=2, ttl=0.3, backend=backend) as pool:
        pool.warm()
        _until(lambda: pool.stats().expired >= 2, "idle expiry")
        _until(lambda: pool.stats().size == 0, "an empty pool")
        starts = len(backend.handles)
        time.sleep(0.5)
        assert len(backend.handles) == starts  # the key is idle: no refill
        assert not any(h.alive for h in backend.handles)


def test_size_zero_keeps_nothing(backend: FakeBackend) -> None:
    with Pool(size=0, backend=backend) as pool:
        Sandbox(backend=backend, pool=pool).kill()
        time.sleep(0.1)
        assert pool.stats() == PoolStats(misses=1, keys=1)
        assert len(backend.handles) == 1


class _Flaky(FakeBackend):
    """Fails every background start; the caller's own start (a miss) still works."""

    def __init__(self) -> None:
        super().__init__(echo_handler)
        self.fail = threading.Event()
        self.fail.set()
        self.attempts = 0

    def start(self, spec: SandboxSpec) -> FakeHandle:
        if threading.current_thread().name.startswith("sandlot-pool"):
            self.attempts += 1
            if self.fail.is_set():
                raise OSError("no room")
        return super().start(spec)


def test_failed_background_starts_back_off_and_recover() -> None:
    flaky = _Flaky()
    with Pool(size=1, backend=flaky) as pool:
        Sandbox(backend=flaky, pool=pool).kill()  # a miss: started on this thread
        _until(lambda: pool.stats().failed >= 2, "two failures")
        attempts = flaky.attempts
        time.sleep(0.3)
        assert flaky.attempts <= attempts + 1  # backing off, not spinning
        flaky.fail.clear()
        _until(lambda: pool.stats().size == 1, "recovery", seconds=30)


def test_close_kills_ready_sandboxes_and_refuses_use(pool: Pool, backend: FakeBackend) -> None:
    pool.warm()
    _filled(pool, 2)
    pool.close()
    assert not any(h.alive for h in backend.handles)
    assert pool.stats().size == 0
    with pytest.raises(SandboxClosed):
        Sandbox(backend=backend, pool=pool)
    pool.close()  # idempotent


def test_stats_as_dict(pool: Pool) -> None:
    assert pool.stats().to_dict() == {
        "hits": 0,
        "misses": 0,
        "size": 0,
        "starting": 0,
        "expired": 0,
        "failed": 0,
        "keys": 0,
    }


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"size": -1}, InvalidArgumentError),
        ({"size": True}, InvalidArgumentError),
        ({"ttl": 0}, InvalidArgumentError),
        ({"preload": "pandas"}, InvalidArgumentError),
        ({"preload": ["pandas; import os"]}, PolicyError),
        ({"preload": [""]}, PolicyError),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        Pool(**kwargs)


def test_pool_argument_must_be_a_pool(backend: FakeBackend) -> None:
    with pytest.raises(InvalidArgumentError):
        Sandbox(backend=backend, pool="yes")  # type: ignore[arg-type]


def test_async_sandbox_takes_from_the_pool(pool: Pool, backend: FakeBackend) -> None:
    async def use() -> str | None:
        sbx = await AsyncSandbox.create(backend=backend, pool=pool)
        try:
            return (await sbx.run_code("6 * 7")).text
        finally:
            await sbx.kill()

    pool.warm()
    _filled(pool, 2)
    assert asyncio.run(use()) == "6 * 7"
    assert pool.stats().hits == 1


def test_pool_true_uses_one_process_wide_pool(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandlot.pool as pool_module

    monkeypatch.setattr(pool_module, "_DEFAULT", None)
    try:
        Sandbox(backend=backend, pool=True).kill()
        shared = pool_module.default_pool()
        assert shared is pool_module.default_pool()
        assert shared.stats().misses == 1
        assert backend.handles[0].spec.preload == DATA_STACK
    finally:
        pool_module.default_pool().close()


class _Gated(FakeBackend):
    """Background starts wait at a gate, so the test can count how many run at once."""

    def __init__(self) -> None:
        super().__init__(echo_handler)
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0

    def start(self, spec: SandboxSpec) -> FakeHandle:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            self.gate.wait(10)
            return super().start(spec)
        finally:
            with self.lock:
                self.running -= 1


def test_background_starts_run_concurrently_up_to_the_limit() -> None:
    # One start's latency must not cap a pool's refill rate: with starts=3 and size=5,
    # three starts are in flight together, never a fourth.
    gated = _Gated()
    with Pool(size=5, starts=3, backend=gated) as pool:
        pool.warm()
        _until(lambda: pool.stats().starting == 3 and gated.running == 3, "three starts")
        time.sleep(0.1)
        assert gated.most == 3 and pool.stats().starting == 3
        gated.gate.set()
        _filled(pool, 5)
        assert gated.most == 3


def test_starts_defaults_to_the_cpus_and_is_checked() -> None:
    with Pool(backend=FakeBackend(echo_handler)) as pool:
        assert 1 <= pool.starts <= 4
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="starts"):
            Pool(starts=bad)  # type: ignore[arg-type]


def test_the_refill_behind_a_hit_waits_for_the_callers_first_cells(
    pool: Pool, backend: FakeBackend
) -> None:
    """A start is tens of milliseconds of CPU: begun at once it would compete with the
    cells the caller runs first. A lower bound only: a loaded host may start it later."""
    with Sandbox(backend=backend, pool=pool):  # a miss: the pool fills at once
        pass
    _filled(pool, 2)
    starts: list[float] = []
    start = backend.start

    def timed(spec: SandboxSpec) -> FakeHandle:
        starts.append(time.monotonic())
        return start(spec)

    backend.start = timed  # type: ignore[method-assign]
    hit = time.monotonic()
    with Sandbox(backend=backend, pool=pool):
        pass
    _filled(pool, 2)
    assert len(starts) == 1 and starts[0] - hit >= REFILL_DELAY, (starts, hit)
