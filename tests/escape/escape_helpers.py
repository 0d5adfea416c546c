"""Helpers shared by the escape suite: run attack code, and look at the host for its traces.

Each escape test plants something on the host (a listening socket, a secret file, an
environment variable, a process) or leaves something in the sandbox, attacks it from
inside with every route the SDK offers (cell code, ``commands.run``, ``files.*``), and
checks the result on the host side too, not only what the sandbox reports. Where a check
could pass for the wrong reason (a checker that sees nothing), a positive control runs
first. The benign controls in ``test_controls.py`` make sure a sandbox that refuses
everything cannot pass the suite.

The suite runs once per backend (``all_backends``). How the host sees a sandbox's
processes differs, and :func:`host_view_of` says how for each: under bwrap they are
descendants of the bwrap process; a container's belong to the engine (containerd-shim,
conmon), not to the test, and are found through the container's cgroup; under gVisor the
host sees only the runsc sandbox, because the sandbox's processes exist in gVisor's own
kernel, so markers in their argv are looked for from inside instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandlot import Sandbox

PROJECT = Path(__file__).resolve().parents[2]
HostProcess = tuple[int, bytes]
"""(pid, start time in clock ticks): a host process, robust against pid reuse."""


def cell_json(sbx: Sandbox, code: str, timeout: float = 30) -> Any:
    """Run ``code``, which must print one JSON document, and return it parsed."""
    execution = sbx.run_code(code, timeout=timeout)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


def host_processes() -> dict[int, tuple[int, bytes, bytes]]:
    """pid -> (ppid, start time, cmdline) for every live (not zombie) host process."""
    table: dict[int, tuple[int, bytes, bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            continue  # dead, only waiting for its parent to collect the exit status
        table[int(name)] = (int(fields[1]), fields[19], cmdline)
    return table


def with_marker(marker: str) -> set[HostProcess]:
    needle = marker.encode()
    return {(pid, start) for pid, (_, start, cmd) in host_processes().items() if needle in cmd}


def the_daemon(marker: str) -> set[HostProcess]:
    """Wait until exactly one process carries ``marker`` (the daemon: the two short-lived
    processes that started it carry it too) and return it."""
    wait_until(lambda: len(with_marker(marker)) == 1, 5, f"one process has {marker}")
    return with_marker(marker)


def parent_and_state(pid: int) -> tuple[int, str]:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]), fields[0].decode()


def descendants(root: int) -> set[HostProcess]:
    """Every host process below ``root`` (not root itself)."""
    table = host_processes()
    found: set[HostProcess] = set()
    frontier = {root}
    while frontier:
        children = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier}
        found |= {(pid, table[pid][1]) for pid in children}
        frontier = children
    return found


def alive(processes: set[HostProcess]) -> set[HostProcess]:
    table = host_processes()
    return {(pid, start) for pid, start in processes if pid in table and table[pid][1] == start}


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {seconds:g} s waiting until {what}"
        time.sleep(0.05)


def host_ipv4_addresses() -> list[str]:
    """The host's IPv4 addresses, one per interface (SIOCGIFADDR)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(reply[20:24]))
    return found


def nothing_accepted(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        return True
    connection.close()
    return False


def sandbox_pid(sbx: Sandbox) -> int:
    """The host pid of the sandbox's outermost process (bwrap for the bwrap backend)."""
    return sbx._core._handle._process.pid  # type: ignore[union-attr, attr-defined, no-any-return]


def is_container(sbx: Sandbox) -> bool:
    """Whether ``sbx`` runs in a container (Docker or Podman, any runtime)."""
    return getattr(sbx._core._handle, "container", None) is not None


def is_gvisor(sbx: Sandbox) -> bool:
    """Whether ``sbx`` runs under gVisor (runsc): its processes are not host processes."""
    return getattr(getattr(sbx._core, "backend", None), "runtime", None) == "runsc"


def is_vm(sbx: Sandbox) -> bool:
    """Whether ``sbx`` runs in a virtual machine (microvm): its processes are the guest
    kernel's, not host processes; on the host the sandbox is one QEMU process."""
    return getattr(getattr(sbx._core, "backend", None), "name", None) == "microvm"


def xfail_under_gvisor(
    sbx: Sandbox, request: pytest.FixtureRequest, reason: str, strict: bool = True
) -> None:
    """Mark the running test an expected failure when ``sbx`` runs under gVisor, for
    ``reason`` (a documented gVisor difference); elsewhere the test must pass."""
    if is_gvisor(sbx):
        request.applymarker(pytest.mark.xfail(strict=strict, reason=reason))


@dataclass(frozen=True)
class ContainerView:
    """A container sandbox as the host sees it, read through its engine and cgroup."""

    engine: Any
    cid: str
    cgroup_procs: Path | None
    """The ``cgroup.procs`` of the container's cgroup (every host process in it)."""

    def processes(self) -> set[HostProcess]:
        """The host processes in the container now (none once it is gone)."""
        table = host_processes()
        try:
            pids = {int(pid) for pid in self.cgroup_procs.read_text().split()}  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return set()
        return {(pid, table[pid][1]) for pid in pids if pid in table}

    def init_pid(self) -> int:
        """The host pid of the container's first process (runc: the supervisor)."""
        state = (self.engine.inspect(self.cid) or {}).get("State") or {}
        pid = state.get("Pid")
        assert isinstance(pid, int) and pid > 0, state
        return pid

    def gone(self) -> bool:
        """The engine no longer has the container (it was removed)."""
        return self.engine.inspect(self.cid) is None


def container_view(sbx: Sandbox) -> ContainerView:
    """The host's view of a container sandbox (see :func:`is_container`)."""
    process = sbx._core._handle.container  # type: ignore[union-attr]
    cgroup = process._cgroup
    procs: Path | None = None
    if cgroup is not None:
        _version, directories = cgroup
        directory = directories.get("pids") or directories.get("")
        procs = None if directory is None else directory / "cgroup.procs"
    return ContainerView(process.engine, process.cid, procs)


def with_marker_inside(sbx: Sandbox, marker: str) -> bool:
    """Whether a process in ``sbx`` carries ``marker`` in its argv, looked for from inside
    (for gVisor, whose processes the host cannot see). The listing runs as a cell, so no
    argv of its own carries the marker."""
    code = (
        "def _sandlot_scan(marker):\n"
        "    import os\n"
        "    found = False\n"
        "    for name in os.listdir('/proc'):\n"
        "        try:\n"
        "            found |= marker in open('/proc/%s/cmdline' % name, 'rb').read()\n"
        "        except OSError:\n"
        "            pass\n"
        "    return found\n"
        f"_sandlot_scan({marker.encode()!r})"
    )
    execution = sbx.run_code(code, timeout=30)
    assert execution.error is None, execution.error
    return execution.text == "True"
