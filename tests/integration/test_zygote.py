"""Sandboxes forked from the zygote, for real: as isolated from each other as cold ones.

A zygote-made sandbox shares more with its siblings than two cold sandboxes share
(the zygote's user namespace and, copy-on-write, its memory), so each test here
attacks exactly that: another sandbox's processes, files, shared memory, loopback
ports, abstract sockets and SysV IPC; the zygote itself; the random state every
fork inherits; and the limits, which must be the sandbox's own. Each isolation check
has a positive control in the sandbox that owns the resource. The behaviour suite
runs against this backend too (``zygote`` in ``BACKEND_MARKS``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import Resources, Sandbox
from sandlot.backends import _reaper

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

TIMEOUT = 600


@pytest.fixture
def make() -> Iterator[Callable[..., Sandbox]]:
    started: list[Sandbox] = []

    def start(backend: str = "zygote", **kwargs: Any) -> Sandbox:
        sbx = Sandbox(backend=backend, timeout=TIMEOUT, **kwargs)
        started.append(sbx)
        return sbx

    try:
        yield start
    finally:
        for sbx in started:
            sbx.kill()


def _json(sbx: Sandbox, code: str) -> Any:
    execution = sbx.run_code(textwrap.dedent(code), timeout=60)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


VIEW = """
import json, os, socket, sys
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
top = {}
for line in open("/proc/self/mountinfo").read().splitlines():
    fields = line.split()
    sep = fields.index("-")
    # The last mount at a path is the one visible there.
    top[fields[4]] = (fields[sep + 1], sorted(set(fields[5].split(",")) - {"relatime"}))
print(json.dumps({
    "status": {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                                              "NoNewPrivs", "Seccomp", "Uid", "Gid", "Groups")},
    "mounts": top,
    "cgroup": open("/proc/self/cgroup").read().splitlines(),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "hostname": socket.gethostname(),
    "interfaces": [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]],
    "env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[:2],
    "home": sorted(os.listdir("/home/user")), "tmp": os.listdir("/tmp"),
}))
"""


def test_a_zygote_sandbox_looks_like_a_cold_one(make: Callable[..., Sandbox]) -> None:
    cold = _json(make("bwrap"), VIEW)
    warm = _json(make(), VIEW)
    assert warm["status"]["CapEff"] == "0000000000000000"
    assert warm["status"]["Seccomp"] == "2" and warm["status"]["NoNewPrivs"] == "1"
    # The zygote covers /proc/sys, irq and bus read-only; bubblewrap does not here (a
    # sandbox's user namespace cannot write them either way). Nothing else differs.
    extra = {path: warm["mounts"].pop(path) for path in set(warm["mounts"]) - set(cold["mounts"])}
    assert set(extra) <= {"/proc/sys", "/proc/irq", "/proc/bus", "/proc/sysrq-trigger"}
    assert all(fs == "proc" and "ro" in options for fs, options in extra.values())
    for key in ("status", "mounts", "cgroup", "hostname", "interfaces", "env", "cwd", "home"):
        assert warm[key] == cold[key], key
    # Only the sandbox's own processes: its supervisor (pid 1) and kernel, like cold.
    assert len(warm["pids"]) == len(cold["pids"]) and warm["pids"][0] == 1


def test_sibling_sandboxes_cannot_reach_each_other(make: Callable[..., Sandbox]) -> None:
    a, b = make(), make()
    marker = f"sandlot-zygote-{uuid.uuid4().hex[:12]}"
    planted = _json(
        a,
        f"""
import ctypes, json, socket, subprocess
open("/home/user/{marker}", "w").write("a")
open("/tmp/{marker}", "w").write("a")
open("/dev/shm/{marker}", "w").write("a")
tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen()
abstract = socket.socket(socket.AF_UNIX); abstract.bind("\\0{marker}"); abstract.listen()
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x5a17, 4096, 0o1666)  # IPC_CREAT | 0666
import sys
SLEEPER = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}"])
globals()["_keep"] = (tcp, abstract)
print(json.dumps({{"port": tcp.getsockname()[1], "shm": shm}}))
""",
    )
    assert planted["shm"] >= 0  # the SysV segment exists in a
    seen = _json(
        b,
        f"""
import ctypes, glob, json, os, socket
out = {{"files": glob.glob("/home/user/*{marker}*") + glob.glob("/tmp/*{marker}*")
                 + glob.glob("/dev/shm/*{marker}*")}}
procs = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        procs.append(open(f"/proc/{{pid}}/cmdline", "rb").read().decode(errors="replace"))
    except OSError:
        pass
out["procs"] = [p for p in procs if "{marker}" in p]
for name, family, address in (("tcp", socket.AF_INET, ("127.0.0.1", {planted["port"]})),
                              ("abstract", socket.AF_UNIX, "\\0{marker}")):
    s = socket.socket(family); s.settimeout(2)
    try:
        s.connect(address); out[name] = "connected"
    except OSError as exc:
        out[name] = exc.errno
libc = ctypes.CDLL(None, use_errno=True)
out["shm"] = libc.shmget(0x5a17, 4096, 0o666)
print(json.dumps(out))
""",
    )
    # Everything b may signal, killed; a must not notice.
    b.commands.run("kill -9 -1; true")
    assert seen["files"] == [] and seen["procs"] == []
    assert seen["tcp"] != "connected" and seen["abstract"] != "connected"
    assert seen["shm"] == -1
    # Positive controls, and a is untouched by b's kill -9 -1.
    control = _json(
        a,
        f"""
import glob, json, socket
s = socket.socket(socket.AF_UNIX); s.connect("\\0{marker}")
print(json.dumps({{"files": len(glob.glob("/*/{marker}") + glob.glob("/*/*/{marker}")),
                  "sleeper": any("{marker}" in open(f"/proc/{{p}}/cmdline").read()
                                 for p in __import__("os").listdir("/proc") if p.isdigit())}}))
""",
    )
    assert control == {"files": 3, "sleeper": True}


def test_the_zygote_is_out_of_reach(make: Callable[..., Sandbox]) -> None:
    sbx = make()
    outcome = _json(
        sbx,
        """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
out["unshare net"] = libc.unshare(0x40000000) or ctypes.get_errno()
out["unshare user"] = libc.unshare(0x10000000) or ctypes.get_errno()
out["mount"] = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) or ctypes.get_errno()
out["umount /proc"] = libc.umount2(b"/proc", 2) or ctypes.get_errno()
out["sethostname"] = libc.sethostname(b"x", 1) or ctypes.get_errno()
try:
    out["setns"] = libc.setns(os.open("/proc/1/ns/net", os.O_RDONLY), 0) or ctypes.get_errno()
except OSError as exc:
    out["setns"] = exc.errno  # pid 1 is not dumpable: its namespaces cannot even be opened
out["ptrace 1"] = libc.ptrace(16, 1, None, None) or ctypes.get_errno()
out["pid 1"] = open("/proc/1/cmdline", "rb").read().split(b"\\0")[-4:-1] != [b""]
print(json.dumps(out))
""",
    )
    assert outcome.pop("pid 1") is True
    assert 0 not in outcome.values(), outcome


def test_a_forked_kernel_holds_only_its_own_descriptors(make: Callable[..., Sandbox]) -> None:
    # Forked, a kernel inherits every descriptor of its supervisor (the host channel,
    # the cgroup and sysctl files, other kernels' pipes) and must close all but its
    # stdin, stdout, stderr and its own socket to the supervisor.
    fds = _json(
        make(),
        """
        import json, os
        names = os.listdir("/proc/self/fd")  # its own descriptor is gone by now
        print(json.dumps({n: os.readlink("/proc/self/fd/" + n) for n in names
                          if os.path.exists("/proc/self/fd/" + n)}))
        """,
    )
    others = [target for fd, target in fds.items() if fd not in ("0", "1", "2")]
    assert len(fds) == 4 and len(others) == 1 and others[0].startswith("socket:"), fds
    assert fds["0"] == "/dev/null" and fds["1"].startswith("pipe:"), fds


def test_a_forked_sandbox_gets_the_templates_matplotlib_files(make: Callable[..., Sandbox]) -> None:
    # Read once by the zygote, written by each sandbox's pid 1 into its fresh home.
    files = _json(
        make(),
        """
        import json, os
        share = "/opt/sandlot/template/share/matplotlib"
        pairs = [(share + "/matplotlibrc", "~/.config/matplotlib/matplotlibrc")]
        pairs += [(share + "/cache/" + n, "~/.cache/matplotlib/" + n)
                  for n in os.listdir(share + "/cache") if n.endswith(".json")]
        print(json.dumps([[open(a, "rb").read() == open(os.path.expanduser(b), "rb").read(),
                           os.stat(os.path.expanduser(b)).st_uid == os.getuid()]
                          for a, b in pairs]))
        """,
    )
    assert len(files) >= 2 and all(same and ours for same, ours in files), files


FIRST_CELL = """
import json, linecache, sys
names = sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__"))
shell = get_ipython()
print(json.dumps({
    "names": names,
    "cells": sorted(k for k in linecache.cache if k.startswith("<cell-")),
    "count": shell.execution_count,
    "history": [shell.history_manager.input_hist_raw, shell.history_manager.input_hist_parsed],
}))
"""


def test_the_zygotes_warm_up_cells_leave_nothing_for_the_first_cell(
    make: Callable[..., Sandbox],
) -> None:
    # The zygote runs a few trivial cells through the supervisor's and the kernel's code
    # before it forks (runner/_zygote.py _warm_up) and exercises the shell's bookkeeping
    # (runner/_shell.py _warm_up): a sandbox's
    # first cell must find what a cold sandbox's first cell finds (no `_`, no earlier
    # cells' source, execution count 1, an empty input history).
    cold = make("bwrap").run_code(FIRST_CELL, timeout=60)
    warm = make().run_code(FIRST_CELL, timeout=60)
    assert cold.error is None and warm.error is None, (cold.error, warm.error)
    assert warm.execution_count == cold.execution_count == 1
    seen = json.loads("".join(warm.logs.stdout))
    assert seen == json.loads("".join(cold.logs.stdout))
    assert "_" not in seen["names"] and seen["cells"] == ["<cell-1>"], seen
    assert seen["count"] == 1 and seen["history"] == [[""], [""]], seen
    # And the warm-up did run: the kernel's C library lookup, which a cold kernel makes
    # at its first cell's end, is already there in the forked one.
    probe = "import sys; print(sys.modules['sandlot.runner._kernel']._fflush is not None)"
    first = make().run_code(probe, timeout=60)
    assert first.logs.stdout == ["True\n"], first
    assert make("bwrap").run_code(probe, timeout=60).logs.stdout == ["False\n"]


def test_siblings_do_not_share_random_state(make: Callable[..., Sandbox]) -> None:
    code = (
        "import json, random, numpy, uuid, tempfile\n"
        "print(json.dumps([random.random(), numpy.random.rand(), uuid.uuid4().hex,"
        " next(tempfile._get_candidate_names())]))\n"
    )
    first, second = (_json(make(), code) for _ in range(2))
    for mine, theirs in zip(first, second, strict=True):
        assert mine != theirs


def test_limits_are_the_sandboxs_own(make: Callable[..., Sandbox]) -> None:
    small = make(resources=Resources(memory_mb=512, pids=32))
    assert _forked(small)
    oom = small.run_code("x = bytearray(900 * 1024 * 1024); x[::4096] = b'1' * len(x[::4096])")
    assert oom.error is not None and oom.error.name == "OutOfMemoryError", oom.error
    assert oom.usage is not None and oom.usage.memory_limit_bytes == 512 * 1024 * 1024
    forks = _json(
        small,
        """
import json, os, time
pids, error = [], None
for _ in range(64):
    try:
        pid = os.fork()
    except OSError as exc:
        error = exc.errno
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.kill(pid, 9)
print(json.dumps({"forked": len(pids), "error": error}))
""",
    )
    assert forks["error"] == 11 and forks["forked"] < 32  # EAGAIN from pids.max
    # A sibling with the default limits is unaffected.
    assert make().run_code("x = bytearray(900 * 1024 * 1024); len(x)").text == "943718400"


def _forked(sbx: Sandbox) -> bool:
    """Whether ``sbx`` came from the zygote (not a cold start)."""
    return type(sbx._core._handle._process).__name__ == "_ForkedSandbox"  # type: ignore[union-attr]


def test_a_memory_limit_below_the_zygotes_size_starts_cold(make: Callable[..., Sandbox]) -> None:
    # A fork starts with the zygote's address space (the data stack); under a smaller
    # per-process limit it could not allocate anything, so such a sandbox starts cold.
    small = make(resources=Resources(memory_mb=128))
    assert not _forked(small)
    assert small.run_code("sum(range(10))").text == "45"
    assert _forked(make(resources=Resources(memory_mb=1024)))


def _sandbox_processes(marker: str) -> list[int]:
    """Processes whose last argument is ``marker`` (the sleepers, not their owner)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{name}/cmdline").read_bytes().endswith(marker.encode() + b"\0"):
                found.append(int(name))
        except OSError:
            continue
    return found


def test_killing_the_owner_leaves_no_zygote_and_no_sandbox(tmp_path: Path) -> None:
    marker = f"sandlot-zygote-owner-{uuid.uuid4().hex[:12]}"
    program = textwrap.dedent(
        f"""
        import sys, time
        from sandlot import Sandbox
        boxes = [Sandbox(backend="zygote") for _ in range(3)]
        for box in boxes:
            box.run_code(
                "import subprocess, sys; p = subprocess.Popen("
                "[sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])"
            )
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
        assert len(_sandbox_processes(marker)) == 3
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    deadline = time.monotonic() + 20
    while _sandbox_processes(marker):
        assert time.monotonic() < deadline, _sandbox_processes(marker)
        time.sleep(0.1)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict((key, value.strip()) for key, value in (line.split(":", 1) for line in lines))


def test_a_sandbox_is_one_fork_of_a_zygote_with_its_heap_in_huge_pages(
    make: Callable[..., Sandbox],
) -> None:
    """What start-up speed rests on, checked from the host: the sandbox's pid 1 is a
    direct child of the zygote (no intermediate process to fork and tear down), and the
    zygote's anonymous memory is partly in transparent huge pages (fewer page-table
    entries for each fork to copy and each exit to free)."""
    sbx = make()
    assert _forked(sbx)
    pid1 = sbx._core._handle._process.pid  # type: ignore[union-attr]
    zygote = int(_status(pid1)["PPid"])
    outer = int(_status(zygote)["PPid"])
    for pid in (zygote, outer):
        assert b"zygote" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"), pid
    # The zygote proper is pid 1 of a pid namespace of its own; the sandbox's pid
    # namespace is a child of it (/proc/<pid>/status lists a pid per nesting level).
    assert _status(zygote)["NSpid"].split()[-1] == "1"
    assert len(_status(pid1)["NSpid"].split()) == len(_status(zygote)["NSpid"].split()) + 1
    release = tuple(int(part) for part in os.uname().release.split(".")[:2])
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if release < (6, 1) or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("MADV_COLLAPSE needs Linux 6.1+ with transparent huge pages not 'never'")
    try:
        rollup = Path(f"/proc/{zygote}/smaps_rollup").read_text()
    except PermissionError:
        # The zygote is not dumpable, so only root (CAP_SYS_PTRACE) may read its map:
        # the unprivileged test run cannot look (the root run does).
        pytest.skip("only root can read a non-dumpable zygote's memory map")
    huge_kib = int(rollup.split("AnonHugePages:")[1].split()[0])
    assert huge_kib >= 2048, rollup


def _two_share_backend(monkeypatch: pytest.MonkeyPatch, preload: tuple[str, ...]) -> Any:
    """A zygote backend whose zygotes fork two live sandboxes each (not 15), for a
    ``preload`` no other test uses, so that its zygotes are the test's own."""
    import dataclasses

    from sandlot.backends.bwrap import _zygote

    real = _zygote.shares
    monkeypatch.setattr(
        _zygote, "shares", lambda raise_limits: dataclasses.replace(real(raise_limits), sandboxes=2)
    )
    return _zygote.ZygoteBackend(preload=preload)


def test_a_full_zygote_gets_a_sibling_zygote_instead_of_cold_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A zygote forks only as many live sandboxes as it has shares of its uid's per-user
    # quotas. The sandbox past that starts cold, and another zygote (a uid of its own)
    # starts in the background, so the next sandboxes are forks again. Two shares here,
    # and a preload no other test uses, so these zygotes are this test's own.
    from sandlot.backends.bwrap import _zygote

    preload = ("json", "decimal")
    backend = _two_share_backend(monkeypatch, preload)
    started: list[Sandbox] = []
    try:
        for _ in range(2):
            started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        assert all(_forked(sbx) for sbx in started)
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        assert not _forked(started[-1])  # the first zygote is out of shares: cold
        deadline = time.monotonic() + 120
        while len(_zygote.zygotes_for("python-data", preload)) < 2:
            assert time.monotonic() < deadline, "no second zygote within 120 s"
            time.sleep(0.1)
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        assert _forked(started[-1])  # from the second zygote
        first, second = _zygote.zygotes_for("python-data", preload)
        uids = {_status(z._process.pid)["Uid"].split()[0] for z in (first, second)}  # type: ignore[union-attr]
        # As root each zygote is a host uid of its own; an ordinary user has only its own.
        assert len(uids) == (2 if os.geteuid() == 0 else 1), uids
        for sbx in started:
            assert sbx.run_code("6 * 7").text == "42"
    finally:
        for sbx in started:
            sbx.kill()
        for zygote in _zygote.zygotes_for("python-data", preload):
            zygote.close()


def test_an_idle_extra_zygote_is_stopped_and_a_busy_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Extra zygotes (60 MiB each) are stopped once none of their sandboxes runs and
    # they forked none for RETIRE_AFTER seconds (0 here); the key's first one stays.
    from sandlot.backends.bwrap import _zygote

    preload = ("json", "fractions")
    backend = _two_share_backend(monkeypatch, preload)
    started: list[Sandbox] = []
    try:
        started += [Sandbox(backend=backend, timeout=TIMEOUT) for _ in range(3)]  # 2 + 1 cold
        deadline = time.monotonic() + 120
        while len(_zygote.zygotes_for("python-data", preload)) < 2:
            assert time.monotonic() < deadline, "no second zygote within 120 s"
            time.sleep(0.1)
        first, second = _zygote.zygotes_for("python-data", preload)
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))  # from the second
        monkeypatch.setattr(_zygote, "RETIRE_AFTER", 0.0)
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))  # busy: kept, forks again
        kinds = [_forked(sbx) for sbx in started]
        assert kinds == [True, True, False, True, True], kinds
        assert _zygote.zygotes_for("python-data", preload) == [first, second]
        pid = second._process.pid  # type: ignore[union-attr]
        for sbx in started[-2:]:
            sbx.kill()
        # kill() returns once the sandboxes are signalled; they are reaped meanwhile.
        assert _reaper.drain(10)
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        # (The first is still full, so this start grows the key again: a new zygote
        # may already be in the list.)
        left = _zygote.zygotes_for("python-data", preload)
        assert left[0] is first and second not in left
        assert not Path(f"/proc/{pid}").exists()  # stopped (and reaped), not just dropped
        assert first.alive
        assert started[-1].run_code("6 * 7").text == "42"
    finally:
        for sbx in started:
            sbx.kill()
        for zygote in _zygote.zygotes_for("python-data", preload):
            zygote.close()


def test_a_zygote_killed_from_outside_is_replaced_by_the_next_sandbox() -> None:
    # Whether a zygote runs is read from a pidfd, not by reaping it (only stopping it
    # reaps it, so its pid stays its own while a cgroup move names it): one that died
    # must still be noticed, reaped, and started again for the next sandbox.
    from sandlot.backends.bwrap import _zygote

    preload = ("json", "html")  # a zygote of this test's own
    backend = _zygote.ZygoteBackend(preload=preload)
    started: list[Sandbox] = []
    try:
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        zygote = _zygote.zygote_for("python-data", preload)
        old = zygote._process
        assert old is not None and zygote.alive
        os.kill(old.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while zygote.alive:
            assert time.monotonic() < deadline, "the killed zygote still looks alive"
            time.sleep(0.01)
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        assert _forked(started[-1])
        assert started[-1].run_code("6 * 7").text == "42"
        assert zygote._process is not old and zygote.alive
        assert old.returncode is not None  # reaped when it was replaced
    finally:
        for sbx in started:
            sbx.kill()
        _zygote.zygote_for("python-data", preload).close()


def test_each_start_primes_the_cgroup_move_and_the_primer_keeps_no_zygote(
    make: Callable[..., Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    # On cgroup v2 a start asks the primer thread for one no-op move of the zygote
    # (overlapping the fork); the thread then lets go of the zygote, so a stopped one can
    # be collected. On v1 the sandbox moves itself as a thread (no global lock to prime).
    from sandlot.backends import _cgroups
    from sandlot.backends.bwrap import _zygote

    if _cgroups.host().version == 1:
        pytest.skip("cgroup v1: forked sandboxes move themselves, nothing is primed")

    primes: list[_zygote.Zygote] = []
    real = _zygote.Zygote._prime_cgroup_move

    def counted(self: _zygote.Zygote) -> None:
        primes.append(self)
        real(self)

    monkeypatch.setattr(_zygote.Zygote, "_prime_cgroup_move", counted)
    make().run_code("1")  # the zygote is up
    for _ in range(3):
        assert _forked(make())
    assert primes, "no start primed the cgroup move"
    deadline = time.monotonic() + 30
    while _zygote._PRIMER._zygote is not None:
        assert time.monotonic() < deadline, "the primer still holds the zygote"
        time.sleep(0.01)


def test_a_cgroup_that_cannot_be_made_fails_the_start_and_leaves_no_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sandbox's cgroup is made while the zygote forks: when it cannot be, the start
    # fails closed, the forked process exits (its channel is closed before it is
    # configured), and its share of the zygote's quotas comes back.
    import sandlot
    from sandlot.backends.bwrap import _zygote

    preload = ("json", "textwrap")  # a zygote of this test's own
    backend = _zygote.ZygoteBackend(preload=preload)
    started: list[Sandbox] = []
    try:
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        zygote = _zygote.zygote_for("python-data", preload)
        before = zygote._cgroup_pids()

        def refuse(spec: Any) -> Any:
            raise sandlot.IsolationUnavailable("no cgroup for this test")

        monkeypatch.setattr(_zygote, "cgroup_for", refuse)
        with pytest.raises(sandlot.IsolationUnavailable):
            Sandbox(backend=backend, timeout=TIMEOUT)
        assert zygote._pending == 0
        deadline = time.monotonic() + 30
        while zygote._cgroup_pids() - before:  # the fork, until it has exited
            assert time.monotonic() < deadline, zygote._cgroup_pids() - before
            time.sleep(0.01)
        monkeypatch.undo()
        started.append(Sandbox(backend=backend, timeout=TIMEOUT))
        assert _forked(started[-1]) and started[-1].run_code("2 * 3").text == "6"
    finally:
        for sbx in started:
            sbx.kill()
        _zygote.zygote_for("python-data", preload).close()


def _cgroup_v1_only() -> None:
    from sandlot.backends import _cgroups

    if _cgroups.host().version != 1:
        pytest.skip("cgroup v2: the host moves each forked sandbox itself")


def test_every_thread_of_a_forked_sandbox_is_in_its_cgroup_in_every_hierarchy(
    make: Callable[..., Sandbox],
) -> None:
    # On cgroup v1 a forked sandbox's pid 1 moves itself in, as a thread (the host hands
    # it the cgroup's tasks files): every thread of every process must have followed,
    # in every hierarchy, or the sandbox would be outside some of its limits.
    _cgroup_v1_only()
    sbx = make()
    assert _forked(sbx)
    assert sbx.run_code("import threading; threading.Thread(target=lambda: 0).start(); 1").text
    group = sbx._core._handle._cgroup  # type: ignore[union-attr]
    pid1 = sbx._core._handle._process.pid  # type: ignore[union-attr]
    tids = set(os.listdir(f"/proc/{pid1}/task"))
    for child in Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split():
        tids |= set(os.listdir(f"/proc/{child}/task"))
    assert len(tids) >= 3  # the supervisor's threads and its kernel at least
    for path in group.paths.values():
        assert tids <= set((path / "tasks").read_text().split()), path


def _start_refused(backend: Any, zygote: Any) -> str:
    """Start a sandbox that must be refused; its forked process must be gone after."""
    import sandlot

    before = list(zygote._forks)
    with pytest.raises(sandlot.SandboxStartError) as refused:
        Sandbox(backend=backend, timeout=TIMEOUT)
    assert zygote._pending == 0
    refused_forks = [fork for fork in zygote._forks if fork not in before]
    assert refused_forks  # it was forked, then refused
    deadline = time.monotonic() + 30
    while any(fork.running() for fork in refused_forks):
        assert time.monotonic() < deadline, "the refused sandbox still runs"
        time.sleep(0.01)
    return str(refused.value)


def test_a_forked_sandbox_in_another_cgroup_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The host checks the move it did not make: a sandbox's pid 1 that put itself into
    # some other cgroup (here: given another cgroup's tasks files) is killed, not used.
    _cgroup_v1_only()
    from sandlot.backends import _cgroups
    from sandlot.backends.bwrap import _zygote

    preload = ("json", "textwrap")  # a zygote of this test's own
    backend = _zygote.ZygoteBackend(preload=preload)
    decoy = _cgroups.SandboxCgroup.create(Resources())
    try:
        assert Sandbox(backend=backend, timeout=TIMEOUT).run_code("1").text == "1"
        zygote = _zygote.zygote_for("python-data", preload)
        decoys = _cgroups.SandboxCgroup.open_thread_attach
        monkeypatch.setattr(
            _cgroups.SandboxCgroup, "open_thread_attach", lambda self: decoys(decoy)
        )
        assert "not in its own cgroup" in _start_refused(backend, zygote)
    finally:
        _zygote.zygote_for("python-data", preload).close()
        assert decoy.destroy()


def test_a_forked_sandbox_that_cannot_move_into_its_cgroup_does_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sandbox's side fails closed: tasks files it cannot write (opened read-only
    # here) end it before it reads its configuration, so the start fails.
    _cgroup_v1_only()
    from sandlot.backends import _cgroups
    from sandlot.backends.bwrap import _zygote

    preload = ("json", "textwrap")  # a zygote of this test's own
    backend = _zygote.ZygoteBackend(preload=preload)

    def read_only(self: _cgroups.SandboxCgroup) -> list[int]:
        return [os.open(path / "tasks", os.O_RDONLY | os.O_CLOEXEC) for path in self.paths.values()]

    try:
        assert Sandbox(backend=backend, timeout=TIMEOUT).run_code("1").text == "1"
        zygote = _zygote.zygote_for("python-data", preload)
        monkeypatch.setattr(_cgroups.SandboxCgroup, "open_thread_attach", read_only)
        _start_refused(backend, zygote)
        deadline = time.monotonic() + 30  # its last words reach us through a pipe
        while "move into the sandbox's cgroup" not in zygote._stderr():
            assert time.monotonic() < deadline, zygote._stderr()
            time.sleep(0.01)
        monkeypatch.undo()
        again = Sandbox(backend=backend, timeout=TIMEOUT)
        assert _forked(again) and again.run_code("2 * 3").text == "6"
        again.kill()
    finally:
        _zygote.zygote_for("python-data", preload).close()
