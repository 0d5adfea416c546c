"""Resource exhaustion: fork and thread bombs, memory bombs across processes, disk fill,
output floods and CPU spins. Each must end as a typed outcome on the Execution (never an
exception from ``run_code``, never a hung host), and the sandbox must stay usable after
it or be cleanly replaced. Whole-sandbox limits are in ``tests/integration/test_limits.py``
(eight 400 MB processes under 512 MB) and teardown at scale in its own test.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from escape_helpers import (
    ContainerView,
    alive,
    container_view,
    descendants,
    host_processes,
    is_container,
    is_gvisor,
    is_vm,
    sandbox_pid,
    the_daemon,
    wait_until,
    with_marker,
    with_marker_inside,
    xfail_under_gvisor,
)

import sandlot
from sandlot import Sandbox
from sandlot.policy import MiB

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]

LIMIT_NAMES = {"TimeoutError", "OutOfMemoryError", "KernelDiedError"}
TESTS = Path(__file__).resolve().parents[1]


def _usable(sbx: Sandbox) -> None:
    """The sandbox (the same one, or its clean replacement) still runs code and commands."""
    assert sbx.run_code("6 * 7", timeout=60).text == "42"
    # The kernel may still be reaping a bomb's last processes, which count against pids
    # for a moment: allow the process table some seconds to drain, not forever.
    for _ in range(30):
        command = sbx.commands.run("echo alive", timeout=60)
        if "Resource temporarily unavailable" not in command.stderr:
            break
        time.sleep(1)
    assert command.stdout == "alive\n", command


FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_fork_bomb_ends_as_a_timeout_and_is_cleaned_up(
    make_sandbox: Callable[..., Sandbox], request: pytest.FixtureRequest
) -> None:
    # Proves the pids limit (cgroup + RLIMIT_NPROC) and the stop-then-kill sweep, or,
    # when the bomb starves the runner itself, the host's backstop that destroys the
    # sandbox and starts a new one. Either way: a typed TimeoutError, no process of the
    # bomb left on the host, and a sandbox that works. Would fail without a pids limit
    # (the host's process table fills) or without the backstop (run_code hangs).
    # Under gVisor the limit is RLIMIT_NPROC in gVisor's own kernel (see _compile.py).
    sbx = make_sandbox(resources={"pids": 64})
    xfail_under_gvisor(
        sbx,
        request,
        "gVisor's ptrace platform runs ~30 host tasks per spinning sandbox "
        "process: at the sandbox's own limit (RLIMIT_NPROC) the runsc Sentry can meet "
        "the host cgroup's bound (128 + 10 x pids) before the cell's timeout, exit "
        "(status 2) and come back as SandboxLostError, not TimeoutError; the host "
        "stays protected either way",
        strict=False,  # which comes first depends on the host's load
    )
    sbx.files.write("before.txt", "kept")
    count, gone = _sandbox_processes(sbx)
    execution = sbx.run_code(FORK_BOMB, timeout=5)
    assert execution.error is not None and execution.error.name == "TimeoutError", execution
    assert execution.status == "timeout"
    _usable(sbx)
    if sbx._core.restarts == 0:  # the runner stopped the bomb itself: files are kept
        wait_until(lambda: count() <= 3, 30, "the bomb is gone")
        assert sbx.files.read("before.txt") == "kept"
    else:  # the sandbox was replaced: the old one is entirely gone
        wait_until(gone, 30, "the old sandbox ends")
        assert "destroyed" in execution.error.value


def _sandbox_processes(sbx: Sandbox) -> tuple[Callable[[], int], Callable[[], bool]]:
    """For the sandbox ``sbx`` runs now: (how many processes it has besides its outermost
    one, whether it is entirely gone). bwrap: the host's descendants of bwrap. A
    container: its cgroup's processes (runc: the supervisor is the outermost), or under
    gVisor, whose processes the host cannot see, the process list inside; and gone once
    the engine no longer has the container."""
    if not is_container(sbx):
        bwrap = sandbox_pid(sbx)
        first = (bwrap, _start_time(bwrap))
        return lambda: len(descendants(bwrap)), lambda: not alive({first})
    view = container_view(sbx)
    if is_gvisor(sbx):

        def inside() -> int:
            # Processes other than pid 1 (the supervisor), the listing kernel included.
            code = "import os\nsum(n.isdigit() and n != '1' for n in os.listdir('/proc'))"
            return int(sbx.run_code(code, timeout=30).text or "-1")

        return inside, view.gone
    return lambda: len(view.processes()) - 1, view.gone


def _start_time(pid: int) -> bytes:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return b"gone"
    return stat[stat.rfind(b")") + 2 :].split()[19]


THREAD_BOMB = """
import threading, time
threads = []
try:
    while True:
        thread = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
        thread.start()
        threads.append(thread)
except RuntimeError as exc:
    print("stopped at", len(threads), "threads:", exc)
    raise
"""


def test_thread_bomb_is_stopped_by_the_pids_limit(make_sandbox: Callable[..., Sandbox]) -> None:
    # Proves the pids limit counts threads. Would fail with pids=None: nothing else stops
    # the loop before the host's threads-max or the timeout (not tried on a shared host).
    sbx = make_sandbox(resources={"pids": 64})
    execution = sbx.run_code(THREAD_BOMB, timeout=30)
    assert execution.error is not None, "the thread bomb was not stopped"
    assert execution.error.name in {"RuntimeError", *LIMIT_NAMES}, execution.error
    started = int("".join(execution.logs.stdout).split()[2])
    assert started < 64
    # The threads live in the kernel: a restart gives the context back in full.
    sbx.restart_code_context()
    _usable(sbx)


MEMORY_BOMB = """
import multiprocessing, time

def grow():
    chunks = []
    while True:
        chunks.append(bytearray(16 * 1024 * 1024))

if __name__ == "__main__" or True:
    workers = [multiprocessing.Process(target=grow) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print("exit codes", [worker.exitcode for worker in workers])
"""


def test_memory_bomb_across_processes_is_out_of_memory(
    make_sandbox: Callable[..., Sandbox], request: pytest.FixtureRequest
) -> None:
    # Four processes that each grow without bound: the per-process RLIMIT_AS stops each
    # at 256 MiB, the whole-sandbox memory cgroup stops them together; the cell ends as
    # a typed limit and the sandbox goes on. Would fail with memory_mb=None: the workers
    # grow until the host's own OOM killer picks victims (not tried on a shared host).
    sbx = make_sandbox(resources={"memory_mb": 256})
    xfail_under_gvisor(
        sbx,
        request,
        "under gVisor the memory cgroup holds the whole runsc Sentry: the "
        "host's OOM killer ends the sandbox as a whole (SandboxLostError saying it "
        "ran out of memory, a fresh sandbox next call), not one process in it",
    )
    sbx.run_code("kept = 'before the bomb'")
    execution = sbx.run_code(MEMORY_BOMB, timeout=60)
    stdout = "".join(execution.logs.stdout)
    if execution.error is None:
        # The children died (MemoryError or SIGKILL) and the parent reported it.
        assert "exit codes" in stdout and "0" not in stdout.split("[")[1], stdout
    else:
        assert execution.error.name in LIMIT_NAMES, execution.error
    _usable(sbx)


def test_disk_fill_is_a_clear_error_and_bounded(make_sandbox: Callable[..., Sandbox]) -> None:
    # Proves the size-capped tmpfs mounts: writing without end fails with ENOSPC (or
    # EFBIG from RLIMIT_FSIZE) at the cap instead of filling host memory or disk.
    # Checked by hand: without --size on the tmpfs mounts, /home/user grew until
    # RLIMIT_FSIZE (1 GiB) stopped the write, far past disk_mb.
    sbx = make_sandbox(resources={"disk_mb": 32, "tmp_mb": 16})
    outcome = {}
    for directory in ("/home/user", "/tmp", "/dev/shm"):
        execution = sbx.run_code(
            textwrap.dedent(
                f"""
                written = 0
                with open("{directory}/fill.bin", "wb") as handle:
                    while True:
                        handle.write(b"\\0" * (1 << 20))
                        handle.flush()
                        written += 1
                """
            ),
            timeout=60,
        )
        assert execution.error is not None, directory
        outcome[directory] = execution.error
    for directory, error in outcome.items():
        assert error.name == "OSError" and "No space left" in error.value, (directory, error)
    sizes = sbx.commands.run("du -sm /home/user/fill.bin /tmp/fill.bin /dev/shm/fill.bin").stdout
    megabytes = {line.split()[1]: int(line.split()[0]) for line in sizes.splitlines()}
    assert megabytes["/home/user/fill.bin"] <= 32 and megabytes["/tmp/fill.bin"] <= 16
    # Usable again once the files are gone; a write while full is a clear error.
    with pytest.raises(sandlot.FileOperationError):
        sbx.files.write("while-full.txt", b"x" * (2 * MiB))
    sbx.files.remove("fill.bin")
    sbx.files.remove("/tmp/fill.bin")
    sbx.run_code("import os; os.remove('/dev/shm/fill.bin')")
    sbx.files.write("after.txt", "fine")
    _usable(sbx)


FLOODS = {
    "print": "while True:\n    print('x' * 1000)",
    "fd write": "import os\nwhile True:\n    os.write(1, b'y' * 65536)",
    "stderr": "import sys\nwhile True:\n    sys.stderr.write('z' * 4096)",
    "child process": "import subprocess\nsubprocess.run(['yes', 'flood'])",
    "one huge line": "print('w' * (64 * 1024 * 1024))",
}


@pytest.mark.parametrize("route", sorted(FLOODS))
def test_output_flood_is_cut_at_the_cap(sandbox: Sandbox, route: str) -> None:
    # Proves the per-cell output cap in the runner and again on the host: the cell's
    # logs stay within output_bytes (plus the marker), whatever the route.
    cap = sandbox.resources.output_bytes
    assert cap is not None
    # The endless floods meet the timeout; the one huge line must finish on its own.
    # (a generous limit for it: a loaded CI host must not turn it into a timeout)
    execution = sandbox.run_code(FLOODS[route], timeout=180 if route == "one huge line" else 5)
    text = "".join(execution.logs.stdout) + "".join(execution.logs.stderr)
    assert execution.truncated
    assert "[sandlot: output truncated" in text
    assert len(text.encode()) <= cap + 8192, len(text)
    assert execution.error is None or execution.error.name in {"TimeoutError", "MemoryError"}
    assert sandbox.run_code("'after the flood'").text == "'after the flood'"


def test_result_flood_is_capped_with_a_marker(make_sandbox: Callable[..., Sandbox]) -> None:
    # Proves max_results and result_bytes: extra and oversized results are dropped with a
    # marker, including after the text output was already cut.
    sbx = make_sandbox(resources={"max_results": 5, "result_bytes": 100_000, "output_bytes": 1000})
    execution = sbx.run_code(
        textwrap.dedent(
            """
            from IPython.display import display, HTML
            print("x" * 5000)  # fill the text budget first
            display(HTML("<b>%s</b>" % ("y" * 1_000_000)))  # one oversized result
            for i in range(1000):
                display(i)
            """
        ),
        timeout=60,
    )
    assert execution.error is None, execution.error
    assert execution.truncated
    assert len(execution.results) == 5
    stderr = "".join(execution.logs.stderr)
    assert "a result larger than 100000 bytes was dropped" in stderr
    assert "more than 5 results in one cell" in stderr
    assert sum(len(r.html or "") for r in execution.results) < 100_000


def test_cpu_spin_is_a_timeout_and_state_survives(fresh_sandbox: Sandbox) -> None:
    # Proves the wall-clock timeout and the interrupt-then-kill escalation: a spinning
    # cell and a spinning child that ignores SIGINT both stop.
    fresh_sandbox.run_code("kept = 41")
    spin = fresh_sandbox.run_code("while True:\n    pass", timeout=2)
    assert spin.error is not None and spin.error.name == "TimeoutError"
    assert spin.status == "timeout"
    assert fresh_sandbox.run_code("kept + 1").text == "42"  # interrupted, not restarted
    stubborn = fresh_sandbox.run_code(
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
        timeout=2,
    )
    assert stubborn.error is not None and stubborn.error.name == "TimeoutError"
    _usable(fresh_sandbox)


def test_cpu_time_limit_ends_a_spin_that_outlives_its_cell(
    make_sandbox: Callable[..., Sandbox], request: pytest.FixtureRequest
) -> None:
    # Proves RLIMIT_CPU on processes user code leaves behind: a background spinner
    # started by a cell that returned is killed by SIGXCPU/SIGKILL, not left running.
    sbx = make_sandbox(resources={"cpu_seconds": 2})
    xfail_under_gvisor(
        sbx,
        request,
        "gVisor (runsc 20221219) does not enforce an inherited RLIMIT_CPU: a "
        "child started with subprocess spins past it (one that calls setrlimit itself "
        "is stopped); the cgroup CPU quota still bounds the sandbox. See docs/docker.md",
    )
    marker = f"sandlot-spin-{uuid.uuid4().hex}"
    execution = sbx.run_code(
        f"import subprocess, sys\nspinner = subprocess.Popen([sys.executable, '-c', "
        f"'while True: pass', {marker!r}])"
    )
    assert execution.error is None
    # On the host, or under gVisor or in a VM (whose processes the host cannot see) inside.
    inside = is_gvisor(sbx) or is_vm(sbx)
    running = (lambda: with_marker_inside(sbx, marker)) if inside else (
        lambda: bool(with_marker(marker))
    )  # fmt: skip
    wait_until(running, 30, "the spinner runs")  # control (slow on a loaded host)
    wait_until(lambda: not running(), 60, "the CPU limit ends the spinner")
    code = sbx.run_code("spinner.wait()").text
    assert code in (str(-signal.SIGXCPU), str(-signal.SIGKILL)), code
    _usable(sbx)


# --- process lifetime -----------------------------------------------------------------------


GONE_WITHIN = {"bwrap": 5.0, "container": 60.0}
"""Seconds for a killed sandbox's processes to go. A container's are ended by its engine
(and, after a SIGKILL of the owner, only once the supervisor reads EOF on its stdin)."""


def test_kill_leaves_no_process_on_the_host(
    make_sandbox: Callable[..., Sandbox], daemon_cell: Callable[[str], str]
) -> None:
    marker = f"sandlot-escape-daemon-{uuid.uuid4().hex}"
    sbx = make_sandbox()
    assert sbx.run_code(daemon_cell(marker)).error is None
    if is_vm(sbx):
        # The daemon lives in the guest's kernel: seen from inside, never on the host,
        # where the sandbox is one QEMU process.
        assert with_marker_inside(sbx, marker)  # control
        assert not with_marker(marker)
        root = sandbox_pid(sbx)
        sandbox_processes = {(root, host_processes()[root][1])}
    elif is_container(sbx):
        view = container_view(sbx)
        sandbox_processes = view.processes()
        if is_gvisor(sbx):
            # The daemon lives in gVisor's kernel: seen from inside, never on the host,
            # where the sandbox is the runsc Sentry and its helpers.
            assert with_marker_inside(sbx, marker)  # control
            assert not with_marker(marker)
            assert sandbox_processes  # control: the host-side search finds the Sentry
        else:
            daemon = the_daemon(marker)  # control: the host-side search does see it
            assert daemon <= sandbox_processes
            assert len(sandbox_processes) >= 3  # supervisor (pid 1), kernel, daemon
    else:
        daemon = the_daemon(marker)  # control: the host-side search does see it
        # The sandbox's outermost host process and everything under it: bwrap, supervisor
        # (pid 1), kernel, daemon; or, forked from a zygote, the supervisor and below.
        root = sandbox_pid(sbx)
        sandbox_processes = descendants(root) | {(root, host_processes()[root][1])}
        assert daemon <= sandbox_processes
        assert len(sandbox_processes) >= 3
    # Teardown does not depend on anything inside: killing bwrap ends the supervisor
    # (--die-with-parent), and with pid 1 gone the kernel kills the whole namespace; a
    # container is killed and removed through its engine.

    sbx.kill()
    within = GONE_WITHIN["container" if is_container(sbx) else "bwrap"]
    wait_until(lambda: not alive(sandbox_processes), within, "every sandbox process is gone")
    if is_container(sbx):
        wait_until(view.gone, within, "the engine removed the container")
    assert not with_marker(marker)


OWNER = """
import json, pathlib, sys, time
import sandlot
from sandlot import Sandbox
from sandlot.backends.docker import DockerBackend, PodmanBackend
def restored(name):
    sys.path.insert(0, sys.argv[2])  # tests/: the test-only backends of tests/_restored.py
    from _restored import BACKENDS
    return BACKENDS[name]()
backend = {
    "bwrap": lambda: "bwrap",
    "zygote": lambda: "zygote",
    "docker": DockerBackend,
    "docker-runsc": lambda: DockerBackend(runtime="runsc"),
    "podman": PodmanBackend,
    "restored": lambda: restored("restored"),
    "forked": lambda: restored("forked"),
}[sys.argv[1]]()
sandbox = Sandbox(backend=backend, timeout=120)
# The cell comes from a file: in argv, the marker would be in this process's cmdline.
execution = sandbox.run_code(pathlib.Path("cell.py").read_text())
assert execution.error is None, execution.error
container = getattr(sandbox._core._handle, "container", None)
report = {"cid": None if container is None else container.cid}
if container is not None and container._cgroup is not None:
    directories = container._cgroup[1]
    report["procs"] = str((directories.get("pids") or directories[""]) / "cgroup.procs")
print("ready " + json.dumps(report), flush=True)
time.sleep(120)
"""


def test_sigkill_of_the_owner_leaves_no_process_on_the_host(
    sandlot_backend: Any, daemon_cell: Callable[[str], str], tmp_path: Path
) -> None:
    name = _backend_name(sandlot_backend)
    marker = f"sandlot-escape-orphan-{uuid.uuid4().hex}"
    log = tmp_path / "owner.log"
    (tmp_path / "cell.py").write_text(daemon_cell(marker))
    view: ContainerView | None = None
    with (
        log.open("wb") as output,
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(OWNER), name, str(TESTS)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        ) as owner,
    ):
        try:
            wait_until(
                lambda: b"ready" in log.read_bytes() or owner.poll() is not None,
                60 if name == "bwrap" else 300,
                "the owner started its sandbox",
            )
            assert owner.poll() is None, log.read_text()
            report = json.loads(log.read_text().split("ready ", 1)[1].splitlines()[0])
            if report["cid"] is None:
                daemon = the_daemon(marker)  # control: the host-side search does see it
                sandbox_processes = descendants(owner.pid)
                assert daemon <= sandbox_processes
                assert len(sandbox_processes) >= 4  # bwrap, supervisor (pid 1), kernel, daemon
            else:
                # A container's processes are the engine's, not the owner's descendants.
                view = ContainerView(_engine(name), report["cid"], Path(report["procs"]))
                sandbox_processes = view.processes()
                assert sandbox_processes  # control
                if name != "docker-runsc":  # gVisor's processes are not host processes
                    assert the_daemon(marker) <= sandbox_processes  # control
        finally:
            owner.send_signal(signal.SIGKILL)
            owner.wait()
        assert owner.returncode == -signal.SIGKILL
        within = GONE_WITHIN["bwrap" if view is None else "container"]
        wait_until(lambda: not alive(sandbox_processes), within, "every sandbox process is gone")
        if view is not None:
            wait_until(view.gone, within, "the engine removed the container")
        assert not with_marker(marker)


def _backend_name(backend: Any) -> str:
    """The fixture's backend as the owner script names it (a pool's: the backend it
    refills from)."""
    backend = getattr(backend, "_backend", backend)
    if isinstance(backend, str):
        return backend
    return "docker-runsc" if getattr(backend, "runtime", None) == "runsc" else str(backend.name)


def _engine(name: str) -> Any:
    from sandlot.backends.docker import _engine_for
    from sandlot.backends.docker._engine import DOCKER, PODMAN

    return _engine_for(PODMAN if name == "podman" else DOCKER)
