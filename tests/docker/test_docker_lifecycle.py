"""Container lifecycle against real engines: nothing is left behind, whatever happens.

* a client killed with SIGKILL in the middle of a cell leaves no container;
* ``cleanup_orphans()`` removes containers whose owner is gone and keeps live ones;
* ``sandlot.Pool`` hands out warmed containers and removes the rest on ``close()``;
* ``sandlot doctor`` names the engine, runtime and cgroup driver.

Waits are bounded polls of the engine's state, never wall-clock assertions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandlot import Pool, Sandbox
from sandlot.backends.docker import (
    DockerBackend,
    PodmanBackend,
    _engine_for,
    cleanup_orphans,
    owner_tag,
)
from sandlot.backends.docker._compile import LABEL, LABEL_OWNER
from sandlot.backends.docker._engine import DOCKER, PODMAN, EngineKind
from sandlot.backends.docker._image import image_name

ENGINES = [
    pytest.param("docker", marks=pytest.mark.requires_docker, id="docker"),
    pytest.param("docker-runsc", marks=pytest.mark.requires_runsc, id="docker-runsc"),
    pytest.param("podman", marks=pytest.mark.requires_podman, id="podman"),
]
GONE_WITHIN = 90.0
"""Upper bound of the polls below (a loaded two-core host can be slow to tear down)."""

CLIENT = textwrap.dedent(
    """
    import json, sys
    from sandlot import Sandbox
    from sandlot.backends.docker import DockerBackend, PodmanBackend
    name = sys.argv[1]
    backend = {
        "docker": DockerBackend(),
        "docker-runsc": DockerBackend(runtime="runsc"),
        "podman": PodmanBackend(),
    }[name]
    sbx = Sandbox(backend=backend, timeout=600)
    cid = sbx._core._handle.container.cid
    def announce(message):
        if "cell-running" in message.line:
            print(json.dumps({"cid": cid}), flush=True)
    sbx.run_code("print('cell-running', flush=True)\\nimport time\\ntime.sleep(600)",
                 on_stdout=announce, timeout=600)
    """
)


def _kind(name: str) -> EngineKind:
    return PODMAN if name == "podman" else DOCKER


def _wait_until(check: Callable[[], bool], timeout: float = GONE_WITHIN) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.25)
    return check()


@pytest.mark.parametrize("backend", ENGINES)
def test_sigkill_of_the_client_mid_cell_leaves_no_container(backend: str) -> None:
    engine = _engine_for(_kind(backend))
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()  # blocks until the cell runs (or the client dies)
        assert line, (
            f"the client died before its cell ran: {client.stderr and client.stderr.read()}"
        )
        cid = json.loads(line)["cid"]
        assert engine.inspect(cid) is not None  # the container runs the cell now
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        for stream in (client.stdout, client.stderr):
            if stream is not None:
                stream.close()
    assert _wait_until(lambda: engine.inspect(cid) is None), "the container outlived its client"
    owner = f"{LABEL_OWNER}={owner_tag(client.pid)}"
    assert engine.containers([owner]) == []


def _sleeper(engine: Any, owner: str, *, start: bool = True) -> str:
    """A container labelled like a sandbox (but just sleeping), owned by ``owner``;
    created but not started when ``start`` is false (a sandbox mid-start)."""
    labels = {LABEL: "orphan-test", LABEL_OWNER: owner}
    body = {
        "Image": image_name("python-data"),
        "Entrypoint": ["sleep", "600"],
        "Labels": labels,
        "HostConfig": {
            "NetworkMode": "none",
            "AutoRemove": True,
            # Podman cannot raise rlimits here (no CAP_SYS_RESOURCE): set them explicitly.
            "Ulimits": [
                {"Name": "nofile", "Soft": 1024, "Hard": 1024},
                {"Name": "nproc", "Soft": 4096, "Hard": 4096},
            ],
        },
    }
    cid = str(engine.create(body, name=f"sandlot-orphan-test-{os.urandom(4).hex()}"))
    if start:
        engine.start(cid)
    return cid


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(DOCKER, marks=pytest.mark.requires_docker, id="docker"),
        pytest.param(PODMAN, marks=pytest.mark.requires_podman, id="podman"),
    ],
)
def test_cleanup_orphans_removes_containers_of_dead_owners_only(kind: EngineKind) -> None:
    engine = _engine_for(kind)
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = _sleeper(engine, owner_tag(dead.pid))
    ours = _sleeper(engine, owner_tag())
    # A live owner's sandbox between create and start: another process's start-up
    # cleanup used to remove it because it was not running yet.
    starting = _sleeper(engine, owner_tag(), start=False)
    try:
        assert cleanup_orphans((kind,)) >= 1
        assert _wait_until(lambda: engine.inspect(orphan) is None)
        state = (engine.inspect(ours) or {}).get("State") or {}
        assert state.get("Running") is True  # a live owner's container is left alone
        assert engine.inspect(starting) is not None  # and so is one still starting
    finally:
        engine.kill_and_remove(orphan)
        engine.kill_and_remove(ours)
        engine.kill_and_remove(starting)


@pytest.mark.requires_server
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(DOCKER, marks=pytest.mark.requires_docker, id="docker"),
        pytest.param(PODMAN, marks=pytest.mark.requires_podman, id="podman"),
    ],
)
def test_server_start_removes_containers_a_killed_process_left(
    kind: EngineKind, tmp_path: Path
) -> None:
    # A process that created a sandbox container dies by SIGKILL and its container
    # survives (this one sleeps instead of watching its stdin, as one whose attach stream
    # broke would). Starting `sandlot serve` removes it. Would fail without the
    # cleanup_orphans() call in the server's start-up (checked by hand).
    from _server_harness import ServerProcess

    engine = _engine_for(kind)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    orphan = _sleeper(engine, owner_tag(owner.pid))
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    server = None
    try:
        state = (engine.inspect(orphan) or {}).get("State") or {}
        assert state.get("Running") is True  # control: it outlived its owner
        server = ServerProcess(tmp_path / "server").start()
        assert _wait_until(lambda: engine.inspect(orphan) is None), "the orphan survived"
        assert f"'{kind.name}': " in server.log()  # in the report's orphans_removed
    finally:
        if server is not None:
            server.stop()
        engine.kill_and_remove(orphan)


@pytest.mark.requires_docker
def test_pool_hands_out_warm_containers_and_removes_the_rest() -> None:
    # sandlot.Pool with containers: started ahead, runner up, the data stack imported in
    # the default kernel; taken once, never returned; the ready ones removed on close().
    # Would fail if the preload did not reach the container's runner (pandas not in
    # sys.modules) or if a pooled container were not the one handed out.
    engine = _engine_for(DOCKER)
    pool = Pool(size=2, backend=DockerBackend())
    try:
        pool.warm()
        assert _wait_until(lambda: pool.stats().size == 2, 300), pool.stats()
        ready = {c["Id"] for c in engine.containers([f"{LABEL_OWNER}={owner_tag()}"])}
        assert len(ready) >= 2  # control: the ready sandboxes are running containers
        with Sandbox(backend=DockerBackend(), pool=pool, timeout=120) as sbx:
            assert pool.stats().hits == 1
            cid = sbx._core._handle.container.cid  # type: ignore[union-attr]
            assert cid in ready  # the container started ahead, not a new one
            first = sbx.run_code(
                "import sys\n"
                "'pandas' in sys.modules, sorted(k for k in dir() if not k.startswith('_'))"
            )
            assert first.error is None, first.error
            # Imported ahead of time, yet the user's namespace is clean and this is cell 1.
            assert first.text == "(True, ['get_ipython', 'sys'])"  # as in every kernel
            assert first.execution_count == 1
        assert _wait_until(lambda: engine.inspect(cid) is None)
        # Other settings make another key: started on demand, not taken from the pool.
        with Sandbox(backend=DockerBackend(), pool=pool, timeout=120, envs={"X": "1"}) as other:
            assert pool.stats().misses == 1
            assert other.run_code("import os; os.environ['X']").text == "'1'"
    finally:
        pool.close()
    # Every container this process started (pooled or not) is gone (removal is async).
    assert _wait_until(lambda: engine.containers([f"{LABEL_OWNER}={owner_tag()}"]) == [])


def test_pool_keys_keep_runtimes_and_engines_apart() -> None:
    # A runc container must never be handed to a caller who asked for gVisor (or the
    # other way round), nor a Docker one to a Podman caller. No engine needed.
    keys = {
        DockerBackend().pool_key(),
        DockerBackend(runtime="runsc").pool_key(),
        DockerBackend(cpus=2.0).pool_key(),
        PodmanBackend().pool_key(),
    }
    assert len(keys) == 4
    assert DockerBackend().pool_key() == DockerBackend().pool_key()


@pytest.mark.requires_docker
@pytest.mark.requires_podman
def test_doctor_reports_engines_runtimes_and_cgroup_driver() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sandlot", "doctor", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    checks = {c["name"].strip(): c for c in json.loads(result.stdout)["checks"]}
    assert checks["backend docker"]["status"] == "ok"
    assert checks["docker: engine"]["detail"].startswith("docker ")
    assert "runsc" in checks["docker: runtimes"]["detail"]
    assert "cgroup v" in checks["docker: cgroup driver"]["detail"]
    assert checks["podman: engine"]["detail"].startswith("podman ")


def test_doctor_says_why_a_container_backend_is_unavailable() -> None:
    env = {
        **os.environ,
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",
        "SANDLOT_PODMAN_HOST": "unix:///nonexistent/podman.sock",
    }
    result = subprocess.run(
        [sys.executable, "-m", "sandlot", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    checks = {c["name"].strip(): c for c in json.loads(result.stdout)["checks"]}
    for name in ("docker", "podman"):
        check = checks[f"backend {name}"]
        assert check["status"] == "missing", check
        assert "does not answer" in check["detail"] and "/nonexistent/" in check["detail"]
        assert "start" in check["fix"]


def test_an_unreachable_engine_is_unavailable_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setenv("SANDLOT_PODMAN_HOST", "unix:///nonexistent/podman.sock")
    for backend in (DockerBackend(), PodmanBackend()):
        probe = backend.probe_instance()
        assert not probe.available
        assert "does not answer" in probe.reason
        assert "start" in probe.fix


@pytest.mark.requires_docker
def test_an_unregistered_runtime_is_unavailable_with_the_fix() -> None:
    probe = DockerBackend(runtime="no-such-runtime").probe_instance()
    assert not probe.available
    assert "not registered" in probe.reason and "daemon.json" in probe.fix
