"""Sandboxes from the warm pool, for real: as isolated as cold ones, and indistinguishable.

A pooled sandbox was started earlier, in the background, and imported numpy, pandas
and pyplot before anyone asked for it. None of that may show: each test below takes
its sandboxes from a pool (asserting they were hits) and runs a representative escape
check against them (host files, network, privilege syscalls, process visibility,
teardown), compares one with a sandbox started on demand, and checks that two
pooled sandboxes cannot see each other's files or processes. The full escape suite
runs against on-demand sandboxes in ``tests/escape``; the start path is the same
``Backend.start``, so these checks target what a pool could change: state left by
the preload and sandboxes handed out twice.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import Pool, Sandbox

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

TIMEOUT = 600


@pytest.fixture(scope="module", params=["bwrap", "zygote"])
def pool(request: pytest.FixtureRequest) -> Iterator[Pool]:
    """A pool refilled with cold bwrap starts, or with forks of the zygote."""
    with Pool(size=2, backend=request.param) as pool:
        pool.warm()
        yield pool


def _hit(pool: Pool) -> Sandbox:
    """A sandbox that really came out of the pool (waits for a ready one)."""
    deadline = time.monotonic() + 120
    while pool.stats().size < 1:
        assert time.monotonic() < deadline, f"the pool did not fill: {pool.stats()}"
        time.sleep(0.05)
    hits = pool.stats().hits
    sbx = Sandbox(backend=pool._backend, pool=pool, timeout=TIMEOUT)
    assert pool.stats().hits == hits + 1
    return sbx


@pytest.fixture
def pooled(pool: Pool) -> Iterator[Sandbox]:
    sbx = _hit(pool)
    try:
        yield sbx
    finally:
        sbx.kill()


def _json(sbx: Sandbox, code: str) -> Any:
    execution = sbx.run_code(code, timeout=60)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


STATE = """
import json, os, resource, sys
def listing(top):
    return sorted(os.path.relpath(os.path.join(d, n), top)
                  for d, dirs, files in os.walk(top) for n in dirs + files)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(json.dumps({
    "names": sorted(n for n in globals() if n not in ("json", "os", "resource", "sys", "listing",
                                                       "status")),
    "home": listing("/home/user"), "tmp": listing("/tmp"), "cwd": os.getcwd(),
    "env": dict(os.environ), "uid": os.getuid(), "gid": os.getgid(),
    "caps": status["CapEff"].strip(), "seccomp": status["Seccomp"].strip(),
    "nnp": status["NoNewPrivs"].strip(),
    "rlimits": [resource.getrlimit(getattr(resource, r))
                for r in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE")],
    "pandas": "pandas" in sys.modules, "backend": sys.modules["matplotlib"].get_backend()
                                                 if "matplotlib" in sys.modules else None,
}))
"""


def test_a_pooled_sandbox_looks_like_a_fresh_one(pooled: Sandbox) -> None:
    fresh = Sandbox(backend="bwrap", timeout=TIMEOUT)
    try:
        first = pooled.run_code("1 + 1")
        assert first.execution_count == 1  # the preload is not a cell
        assert fresh.run_code("1 + 1").execution_count == 1
        cold = _json(fresh, STATE)
        warm = _json(pooled, STATE)
    finally:
        fresh.kill()
    assert warm["pandas"] and warm["backend"].lower() == "agg"  # the preload happened
    assert not cold["pandas"]
    for key in ("names", "home", "tmp", "cwd", "env", "uid", "gid", "caps", "seccomp", "nnp"):
        assert warm[key] == cold[key], key
    assert warm["rlimits"] == cold["rlimits"]
    assert not {"numpy", "pandas", "matplotlib", "np", "pd", "plt", "gc"} & set(warm["names"])
    assert warm["caps"] == "0000000000000000" and warm["seccomp"] == "2"
    assert warm["uid"] != 0 and warm["nnp"] == "1"
    # The sandbox's cgroup is in place (usage is read from it on the host).
    handle = pooled._core._handle
    assert handle is not None and handle.usage() is not None


def test_pooled_sandbox_cannot_read_host_files(pooled: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / f"secret-{uuid.uuid4().hex}"
    secret.write_text("sandlot-pool-secret")
    secret.chmod(0o644)
    seen = _json(
        pooled,
        f"""
import json, os
out = {{}}
for path in ({str(secret)!r}, "/etc/shadow", "/root", {str(Path.cwd())!r}, "/var/cache/sandlot"):
    try:
        out[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as exc:
        out[path] = exc.errno
print(json.dumps(out))
""",
    )
    assert all(isinstance(v, int) for v in seen.values()), seen
    assert "sandlot-pool-secret" not in json.dumps(seen)


def test_pooled_sandbox_has_no_network(pooled: Sandbox) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        seen = _json(
            pooled,
            f"""
import json, socket
lines = open("/proc/net/dev").read().splitlines()[2:]
out = {{"interfaces": [line.split(":")[0].strip() for line in lines]}}
for host in ("127.0.0.1", "10.0.2.2", "169.254.169.254", "1.1.1.1"):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((host, {port})); out[host] = "connected"
    except OSError as exc:
        out[host] = exc.errno
    finally:
        s.close()
print(json.dumps(out))
""",
        )
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert seen.pop("interfaces") == ["lo"]
    assert "connected" not in seen.values(), seen


def test_pooled_sandbox_cannot_use_privileged_syscalls(pooled: Sandbox) -> None:
    outcome = _json(
        pooled,
        """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
out = {}
out["unshare user"] = libc.unshare(0x10000000) or ctypes.get_errno()
out["mount"] = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) or ctypes.get_errno()
out["chroot"] = libc.chroot(b"/tmp") or ctypes.get_errno()
out["ptrace pid 1"] = libc.ptrace(16, 1, None, None) or ctypes.get_errno()  # PTRACE_ATTACH
out["setuid 0"] = libc.setuid(0) or ctypes.get_errno()
print(json.dumps(out))
""",
    )
    assert 0 not in outcome.values(), outcome


def test_two_pooled_sandboxes_cannot_see_each_other(pool: Pool) -> None:
    a, b = _hit(pool), _hit(pool)
    try:
        marker = f"sandlot-pool-{uuid.uuid4().hex}"
        a.files.write(f"{marker}.txt", "from a")
        a.run_code(f"open('/tmp/{marker}', 'w').write('a')")
        a.commands.run(f"sleep 300 {marker} >/dev/null 2>&1 &")
        seen = _json(
            b,
            f"""
import glob, json, os
procs = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        procs.append(open(f"/proc/{{pid}}/cmdline", "rb").read().decode(errors="replace"))
    except OSError:
        pass
print(json.dumps({{"files": glob.glob("/home/user/*{marker}*") + glob.glob("/tmp/*{marker}*"),
                  "procs": procs}}))
""",
        )
        assert a.commands.run(f"pgrep -f {marker}").exit_code == 0  # positive control
        assert a.files.exists(f"{marker}.txt")
    finally:
        a.kill()
        b.kill()
    assert seen["files"] == []
    assert seen["procs"] and not [p for p in seen["procs"] if marker in p]


def _tree(root: int) -> set[int]:
    children: dict[int, set[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), set()).add(int(name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def test_killing_a_pooled_sandbox_leaves_nothing(pool: Pool) -> None:
    sbx = _hit(pool)
    sbx.commands.run("sleep 300 >/dev/null 2>&1 &")
    handle = sbx._core._handle
    process = getattr(handle, "_process", None)
    assert process is not None
    processes = _tree(process.pid)
    assert len(processes) >= 3  # (bwrap,) the supervisor, a kernel, the sleeper...
    sbx.kill()
    deadline = time.monotonic() + 10
    while _alive(processes):
        assert time.monotonic() < deadline, f"still running: {_alive(processes)}"
        time.sleep(0.05)


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.add(pid)
    return alive


def test_closing_the_pool_kills_its_ready_sandboxes() -> None:
    with Pool(size=1, backend="bwrap") as pool:
        pool.warm()
        deadline = time.monotonic() + 120
        while pool.stats().size < 1:
            assert time.monotonic() < deadline, pool.stats()
            time.sleep(0.05)
        handle = next(item for b in pool._buckets.values() for item in b.ready)[0]
    assert not handle.alive
