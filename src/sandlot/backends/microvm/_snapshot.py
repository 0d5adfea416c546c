"""Snapshots of a booted VM with the data stack imported, for restores in under a second.

One snapshot per key: everything that fixes the VM a restore gets (QEMU binary and
version, guest kernel, initramfs with this host's runner, root image, machine,
accelerator, memory, vCPUs, tmpfs sizes) and the modules imported. It is QEMU's
migration stream of a *template* VM (``sandlot.template=1``; see guest_boot.py) saved
while its pid 1, still root, waits for the host, after importing the modules and
before any user code exists. A restore starts QEMU with the same command line and
``-incoming fd:N`` (the state file opened read-only by this process: QEMU cannot write
it), and gives the copy its own identity before it counts as started: the host's
entropy for the kernel's random generator, then the sandbox's configuration.

Where: ``<cache>/microvm-snapshots`` (:func:`snapshot_dir`), a directory this user owns
and nobody else can write (a state file is QEMU's input: whoever writes it controls a
VM, and QEMU's loader is not a boundary). Written to a temporary name and renamed, under
a lock, so concurrent starts build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandlot._exceptions import BackendUnavailable, SandboxStartError
from sandlot.policy import DATA_STACK, Resources, SandboxSpec
from sandlot.templates import cache_dir

SAVE_TIMEOUT = 300.0
"""Seconds for QEMU to write a template VM's state (hundreds of MiB)."""
KEEP = 6
"""Snapshot files kept (the most recently used); older keys are removed."""


def snapshot_dir() -> Path:
    """``<cache>/microvm-snapshots``, created 0700; refused (fail closed) if another
    user owns it or others can write it."""
    path = cache_dir() / "microvm-snapshots"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise BackendUnavailable(
            f"{path} must be a directory owned by uid {os.geteuid()} that no one else can "
            f"write (a VM snapshot there is QEMU's input). Fix: remove it or chmod go-w it"
        )
    return path


def template_spec(spec: SandboxSpec) -> SandboxSpec:
    """The spec a snapshot is made with: the sandbox's template and the resources that
    shape the VM (memory, vCPUs, tmpfs sizes); the data stack plus ``spec.preload``
    imported. Everything else (limits, envs) is configured after the restore."""
    r = spec.resources
    return SandboxSpec(
        template=spec.template,
        resources=Resources(memory_mb=r.memory_mb, cpus=r.cpus, disk_mb=r.disk_mb, tmp_mb=r.tmp_mb),
        preload=tuple(dict.fromkeys((*DATA_STACK, *spec.preload))),
    )


@functools.lru_cache(maxsize=4)
def qemu_version(qemu: str) -> str:
    info = os.stat(qemu)
    done = subprocess.run([qemu, "--version"], capture_output=True, timeout=30, check=False)
    return f"{info.st_size}:{info.st_mtime_ns}:{done.stdout.decode(errors='replace')}"


def snapshot_key(qemu: str, argv: list[str], preload: tuple[str, ...]) -> str:
    """A hash of the QEMU binary and the template VM's command line (kernel, initramfs
    and image paths carry their own content keys) and the preloaded modules."""
    # The clock hint (tsc_early_khz, microvm under TCG) is what the host's cpuinfo said
    # at the time, which can move with its frequency; it matters only to the template's
    # boot (a restored kernel keeps the calibration it was saved with).
    stable = [
        " ".join(w for w in a.split(" ") if not w.startswith("tsc_early_khz="))
        for a in argv
        if not a.startswith(("socket,id=channel,", "socket,id=egress,"))
    ]
    files = [a for a in argv if a.startswith("/") and os.path.isfile(a)]
    stamps = [f"{p}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in files]
    text = json.dumps([qemu_version(qemu), stable, stamps, list(preload)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@contextlib.contextmanager
def locked(directory: Path, key: str) -> Iterator[None]:
    with open(directory / f".lock-{key}", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prune(directory: Path, keep: Path) -> None:
    """Remove all but the :data:`KEEP` most recently used snapshots (and never ``keep``)."""
    files = sorted(directory.glob("*.state"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[KEEP:]:
        if old != keep:
            with contextlib.suppress(OSError):
                old.unlink()
                (directory / f".lock-{old.stem.rsplit('-', 1)[-1]}").unlink()


class QMP:
    """A QMP client on this end of a socketpair whose other end is QEMU's monitor."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        sock.settimeout(timeout)
        self.reader = sock.makefile("rb")
        self.events: list[dict[str, Any]] = []
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        line = self.reader.readline()
        if not line:
            raise SandboxStartError("QEMU closed its monitor while a snapshot was saved")
        message: dict[str, Any] = json.loads(line)
        return message

    def execute(self, command: str, fds: tuple[int, ...] = (), **arguments: Any) -> Any:
        data = json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n"
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.sendall(data)
        while True:
            reply = self._read()
            if "event" in reply:
                self.events.append(reply)
                continue
            if "error" in reply:
                raise SandboxStartError(f"QEMU refused {command}: {reply['error']}")
            return reply.get("return")

    def wait_event(self, name: str, done: set[str]) -> dict[str, Any]:
        """The first ``name`` event whose status is in ``done``."""
        while True:
            event = self.events.pop(0) if self.events else self._read()
            data = event.get("data") or {}
            if event.get("event") == name and data.get("status") in done:
                return dict(data)


def save(qmp: QMP, state: Path) -> None:
    """Migrate the (running) VM behind ``qmp`` into the file ``state``; QEMU pauses it
    at the end. Saved running, so that a restore resumes running."""
    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        qmp.execute(
            "migrate-set-capabilities", capabilities=[{"capability": "events", "state": True}]
        )
        qmp.execute("getfd", fds=(fd,), fdname="sandlot-state")
    finally:
        os.close(fd)
    qmp.execute("migrate", uri="fd:sandlot-state")
    deadline = time.monotonic() + SAVE_TIMEOUT
    qmp.sock.settimeout(SAVE_TIMEOUT)
    status = qmp.wait_event("MIGRATION", {"completed", "failed", "cancelled"})
    if status.get("status") != "completed" or time.monotonic() > deadline:
        raise SandboxStartError(f"saving the template VM ended {status.get('status')!r}")
