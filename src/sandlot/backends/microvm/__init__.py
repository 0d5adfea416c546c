"""The microvm backend: each sandbox in its own QEMU virtual machine.

A guest kernel of its own stands between user code and the host's: a kernel bug the
code exploits is the guest's, not the host's. What the sandbox sees is the same runner
and protocol as under bwrap and Docker, so every SDK behaviour is the same.

* QEMU's ``microvm`` machine under KVM and for restored VMs, ``q35`` for cold boots
  under TCG (faster there, measured),
  ``-nodefaults``: no network device at all, no monitor; the template's root
  filesystem on a read-only virtio-blk device (QEMU opens it read-only, so not even
  root in the guest can write it), tmpfs for ``/home/user`` and ``/tmp`` sized by
  ``Resources``; memory and vCPUs from ``Resources``. Built by scripts/setup-vm.sh
  (:mod:`._qemu` finds it).
* The guest's first process is sandlot's init (busybox, in the initramfs), which execs
  the runner as pid 1 with uid 1000; the protocol travels over a virtio-serial port
  backed by a socketpair with this process (no network, no shared file system).
* Acceleration: KVM when ``/dev/kvm`` boots a stock guest (a short boot test, once per
  process), else TCG, software emulation (slower, and QEMU's device emulation is then
  the boundary, run as an unprivileged host uid under QEMU's own seccomp filter).
  ``$SANDLOT_MICROVM_ACCEL=kvm|tcg`` forces either (``kvm`` fails closed if it does
  not work).
* The host enforces time: killing the QEMU process destroys the whole sandbox.
* By default each VM is restored from a snapshot of a template VM that booted and
  imported the data stack (:mod:`._snapshot`, made on first use), and gets its own
  identity before it is ready: the host's entropy reseeds its kernel's generator, then
  its pid 1 drops to uid 1000 and forks the default kernel (guest_boot.py). A warm
  ``Pool`` on this backend keeps restored VMs ready.
* A network policy: the VM still has no network device. The sandbox's egress proxy
  lease is reached through a second virtio-serial port that multiplexes connections
  (:mod:`.egress_mux`): pid 1 in the guest listens on the sandbox's loopback at the
  proxy port, the host connects each stream to the lease's socket. Restored VMs only
  (a cold-booted VM's pid 1 is uid 1000 before it could open the port).
* Not yet: ``usage()`` counters.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import grp
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from sandlot._exceptions import (
    BackendUnavailable,
    IsolationUnavailable,
    SandboxStartError,
)
from sandlot._models import NetworkEvent
from sandlot.backends import _hostids
from sandlot.backends._base import Backend, Finding, Probe, SandboxHandle, owner_alive
from sandlot.backends._channel import ChannelHandle
from sandlot.backends._runner_config import EGRESS_PORT, egress_env, runner_config
from sandlot.backends.microvm import _snapshot, egress_mux
from sandlot.backends.microvm._qemu import (
    EGRESS_NULL,
    QEMU_ENV,
    SETUP_FIX,
    Artifacts,
    default_machine,
    find_artifacts,
    qemu_argv,
    sandbox_initrd,
)
from sandlot.egress import EgressLease, EgressProxy, default_proxy
from sandlot.policy import SandboxSpec
from sandlot.protocol import encode

__all__ = ["MicroVMBackend", "MicroVMHandle", "accelerator"]

START_TIMEOUT = 120.0
"""Seconds for a VM to boot to its runner's ``ready`` (a cold TCG boot on a busy
two-core host takes 10 to 30 s)."""
ACCEL_ENV = "SANDLOT_MICROVM_ACCEL"
KVM_TEST_TIMEOUT = 30.0
NAME_PREFIX = "sandlot-microvm"
"""QEMU's ``-name``: ``sandlot-microvm.<owner pid>.<sandbox id>``, how cleanup finds
VMs whose owner died."""
QEMU_SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
"""QEMU's own syscall filter: no exec, no setuid, no scheduler or affinity changes."""


def qemu_path() -> str | None:
    return os.environ.get(QEMU_ENV) or shutil.which("qemu-system-x86_64")


@functools.lru_cache(maxsize=4)
def _kvm_boots(qemu: str, kernel: str, initrd: str) -> tuple[bool, str]:
    """Whether a stock guest boots under KVM here: the guest kernel with its initramfs
    and ``/bin/echo`` as init. ``/dev/kvm`` alone proves nothing: on some hosts (nested,
    paravirtual variants) it exists and the guest fails at its first MSR write."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is absent or not accessible"
    marker = "sandlot-kvm-boots"
    argv = [
        qemu, "-M", "microvm,x-option-roms=off,isa-serial=on", "-accel", "kvm",
        "-cpu", "host", "-m", "128M", "-nodefaults", "-no-user-config", "-nographic",
        "-no-reboot", "-monitor", "none", "-serial", "stdio", "-kernel", kernel,
        "-initrd", initrd, "-append", f"console=ttyS0 quiet panic=-1 rdinit=/bin/echo -- {marker}",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=KVM_TEST_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return False, f"a test guest did not boot under KVM within {KVM_TEST_TIMEOUT:g} s"
    except OSError as exc:
        return False, f"QEMU could not run: {exc}"
    if marker.encode() in done.stdout:
        return True, "a test guest boots under KVM"
    last = (done.stderr or done.stdout).decode("utf-8", "replace").strip().splitlines()
    return False, "a test guest does not boot under KVM: " + (last[-1] if last else "no output")


def accelerator(qemu: str, artifacts: Artifacts) -> tuple[str, str]:
    """``(accel, why)``: ``kvm`` when it boots a stock guest here, else ``tcg``.
    ``$SANDLOT_MICROVM_ACCEL`` forces one; a forced ``kvm`` that does not work raises
    :class:`BackendUnavailable` rather than fall back silently."""
    forced = os.environ.get(ACCEL_ENV, "").strip().lower()
    if forced == "tcg":
        return "tcg", f"forced by ${ACCEL_ENV}"
    works, why = _kvm_boots(qemu, str(artifacts.kernel), str(artifacts.initrd))
    if forced == "kvm" and not works:
        raise BackendUnavailable(
            f"${ACCEL_ENV}=kvm but {why}. Fix: unset it to use TCG, or fix KVM on this host"
        )
    if forced not in ("", "auto", "kvm"):
        raise BackendUnavailable(f"${ACCEL_ENV} must be kvm, tcg or auto, not {forced!r}")
    return ("kvm", why) if works else ("tcg", why)


def _probe() -> tuple[Probe, str | None, Artifacts | None]:
    details: dict[str, str] = {}
    qemu = qemu_path()
    if qemu is None:
        return (
            Probe("microvm", False, "QEMU (qemu-system-x86_64) is not installed", SETUP_FIX, 1),
            None,
            None,
        )
    details["qemu"] = qemu
    try:
        artifacts = find_artifacts()
        artifacts.image("python-data")
        accel, why = accelerator(qemu, artifacts)
    except BackendUnavailable as exc:
        return Probe("microvm", False, str(exc), SETUP_FIX, 1, details), qemu, None
    details["guest kernel"] = artifacts.kernel_package
    details["accelerator"] = (
        f"KVM (hardware virtualization): {why}"
        if accel == "kvm"
        else f"TCG (software emulation; QEMU's device emulation is the boundary): {why}"
    )
    # Strength 1, and by name only (MicroVMBackend.by_name_only): "auto" never picks it,
    # even on a host with nothing else; a VM is seconds to start under TCG, and a user
    # who wants a VM per sandbox asks for it by name.
    return Probe("microvm", True, "", "", 1, details), qemu, artifacts


class MicroVMBackend(Backend):
    """Runs each sandbox as a QEMU microVM with its own guest kernel."""

    name = "microvm"
    by_name_only = True

    def __init__(
        self, *, egress: EgressProxy | None = None, machine: str = "auto", snapshot: bool = True
    ) -> None:
        """``egress``: the proxy for sandboxes with a network policy (default: the
        process-wide :func:`sandlot.egress.default_proxy`).
        ``machine``: QEMU's ``microvm`` or ``q35``; ``auto`` (default) picks the faster
        for the accelerator and for a restore or a cold boot
        (:func:`._qemu.default_machine`). ``snapshot`` (default): restore each VM from
        a snapshot of one that booted and imported the data stack (made on first use,
        :mod:`._snapshot`), each with fresh entropy and its own configuration; False
        boots each VM cold."""
        self._egress = egress
        self.machine = machine
        self.snapshot = snapshot

    @property
    def egress(self) -> EgressProxy:
        return self._egress or default_proxy()

    @classmethod
    def probe(cls) -> Probe:
        return _probe()[0]

    @classmethod
    def checks(cls) -> list[Finding]:
        probe, _, artifacts = _probe()
        if artifacts is None:
            return []
        accel = probe.details.get("accelerator", "")
        return [
            Finding(
                "microvm accelerator",
                "ok" if accel.startswith("KVM") else "info",
                accel,
                "" if accel.startswith("KVM") else "KVM needs /dev/kvm that boots a stock guest",
            )
        ]

    @classmethod
    def cleanup_orphans(cls) -> list[str]:
        removed = []
        for pid, owner, vm in _sandlot_vms():
            if not owner_alive(owner):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    removed.append(f"microvm {vm} (pid {pid})")
        return removed

    @classmethod
    def reap(cls, token: Mapping[str, Any]) -> bool:
        pid, start, vm = token.get("pid"), token.get("start"), token.get("vm")
        if not (isinstance(pid, int) and isinstance(start, str) and isinstance(vm, str)):
            return False
        if _start_time(pid) != start:
            return False
        if not any(p == pid and v == vm for p, _, v in _sandlot_vms()):
            return False
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            return True
        return False

    def start(self, spec: SandboxSpec) -> SandboxHandle:
        if spec.network.enabled and not self.snapshot:
            raise IsolationUnavailable(
                "a microVM booted cold (snapshot=False) has no door to the egress proxy (its "
                "pid 1 runs as uid 1000 before it could open the port), so it refuses a "
                "network policy; use MicroVMBackend() (restored VMs, the default)"
            )
        probe, qemu, artifacts = _probe()
        if not probe.available or qemu is None or artifacts is None:
            raise BackendUnavailable(
                f"microvm backend unavailable: {probe.reason}. Fix: {probe.fix}"
            )
        accel, _ = accelerator(qemu, artifacts)
        machine = default_machine(accel, self.snapshot) if self.machine == "auto" else self.machine
        image = artifacts.image(spec.template)
        initrd = sandbox_initrd(artifacts)
        if self.snapshot:
            template = _snapshot.template_spec(spec)
            base = qemu_argv(
                qemu, template, kernel=artifacts.kernel, initrd=initrd, image=image,
                channel_fd=-1, accel=accel, machine=machine, template=True,
            )  # fmt: skip
            return self._restore(spec, self._snapshot_file(qemu, base, template, accel), base)
        base = qemu_argv(
            qemu, spec, kernel=artifacts.kernel, initrd=initrd, image=image,
            channel_fd=-1, accel=accel, machine=machine,
        )  # fmt: skip
        host_sock, guest_sock = socket.socketpair()
        vm = _launch(_with_channel(base, guest_sock), (guest_sock,), accel)
        try:
            _await_guest(host_sock, START_TIMEOUT)
        except SandboxStartError as exc:
            host_sock.close()
            vm.stop()
            raise SandboxStartError(f"{exc}{vm.console()}") from None
        config = runner_config(spec, channel_fd=0, cgroup_limits=False, envs=dict(spec.envs))
        with contextlib.suppress(OSError):  # reported by wait_ready with the console
            host_sock.sendall(encode({"type": "configure", "id": "configure", "config": config}))
        return vm.handle(host_sock, spec)

    def _restore(self, spec: SandboxSpec, state: Path, base: list[str]) -> SandboxHandle:
        """A VM restored from ``state``, with an identity of its own before it is
        ready: fresh entropy for its kernel's random generator, then its configuration
        (guest_boot.py does the guest's part). With a network policy, its egress port
        leads to a lease of its own on the proxy (:mod:`.egress_mux`)."""
        accel = base[base.index("-accel") + 1]
        with contextlib.ExitStack() as failed:
            lease: EgressLease | None = None
            keep: list[socket.socket | int] = []
            argv = base
            if spec.network.enabled:
                lease = self.egress.open(spec.sandbox_id or "sandbox", spec.network)
                failed.callback(lease.close)
                door, door_guest = socket.socketpair()
                failed.callback(door.close)
                failed.callback(door_guest.close)  # passed to QEMU (and closed) by _launch
                keep.append(door_guest)
                argv = [
                    f"socket,id=egress,fd={door_guest.fileno()}" if a == EGRESS_NULL else a
                    for a in argv
                ]
            fd = os.open(state, os.O_RDONLY | os.O_CLOEXEC)  # QEMU reads it, cannot write it
            with contextlib.suppress(OSError):
                os.utime(fd)  # recently used (snapshot pruning keeps those)
            host_sock, guest_sock = socket.socketpair()
            failed.callback(host_sock.close)
            try:
                vm = _launch(
                    [*_with_channel(argv, guest_sock), "-incoming", f"fd:{fd}"],
                    (guest_sock, fd, *keep),
                    accel,
                )
            finally:
                os.close(fd)
            if lease is not None:
                _start_door(door, lease)
            failed.pop_all()
        identity = {
            "type": "restore",
            "entropy": secrets.token_hex(RESTORE_ENTROPY),
            "egress": EGRESS_PORT if lease is not None else None,
        }
        config = runner_config(
            spec, channel_fd=0, cgroup_limits=False, envs={**egress_env(spec), **spec.envs}
        )
        config.pop("egress", None)  # pid 1 listens itself, on the door (guest_boot.py)
        with contextlib.suppress(OSError):  # reported by wait_ready with the console
            host_sock.sendall(
                json.dumps(identity).encode() + b"\n"
                + encode({"type": "configure", "id": "configure", "config": config})
            )  # fmt: skip
        return vm.handle(host_sock, spec, lease)

    def _snapshot_file(self, qemu: str, base: list[str], template: SandboxSpec, accel: str) -> Path:
        """The snapshot for the template VM ``base`` describes; made (once, under a lock)
        if there is none yet: a cold boot, the imports, the save."""
        directory = _snapshot.snapshot_dir()
        key = _snapshot.snapshot_key(qemu, base, template.preload)
        state = directory / f"{template.template}-{key}.state"
        if state.is_file():
            return state
        with _snapshot.locked(directory, key):
            if state.is_file():
                return state
            partial = state.with_name(f"{state.name}.{os.getpid()}.tmp")
            try:
                _make_snapshot(base, template, accel, partial)
                partial.replace(state)
            finally:
                with contextlib.suppress(OSError):
                    partial.unlink()
            _snapshot.prune(directory, state)
        return state

    def pool_key(self) -> tuple[object, ...]:
        return (self.name, self.machine, self.snapshot, os.environ.get(ACCEL_ENV, ""))


RESTORE_ENTROPY = 64
"""Bytes of the host's entropy a restored VM's kernel reseeds its generator from."""


def _start_door(door: socket.socket, lease: EgressLease) -> None:
    """The host end of a VM's egress door: each stream the guest opens becomes a
    connection to ``lease``'s socket, relayed until the VM (QEMU) or the lease is gone."""

    def connect() -> socket.socket | None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(lease.socket_path)
        except OSError:
            upstream.close()
            return None
        return upstream

    def serve() -> None:
        try:
            egress_mux.Mux(door.fileno(), connect=connect).serve_forever()
        finally:
            door.close()

    threading.Thread(target=serve, name="sandlot-microvm-egress", daemon=True).start()


def _with_channel(base: list[str], guest_sock: socket.socket) -> list[str]:
    """``base`` with QEMU's end of the channel socketpair in place of the placeholder."""
    return [
        f"socket,id=channel,fd={guest_sock.fileno()}"
        if a.startswith("socket,id=channel,fd=")
        else a
        for a in base
    ]


class _VM:
    """A QEMU process just started: its console, its host ids (as root)."""

    def __init__(
        self, process: subprocess.Popen[bytes], vm: str, ids: _hostids.HostIds | None
    ) -> None:
        self.process = process
        self.vm = vm
        self.ids = ids
        assert process.stdout is not None
        self.tail = ConsoleTail(process.stdout)

    def console(self) -> str:
        console = self.tail()
        return f":\n{console}" if console else ""

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        if self.ids is not None:
            self.ids.release()

    def handle(
        self, host_sock: socket.socket, spec: SandboxSpec, egress: EgressLease | None = None
    ) -> MicroVMHandle:
        handle = MicroVMHandle(
            host_sock, self.process, vm=self.vm, ids=self.ids, stderr_tail=self.tail,
            exit_reason=_exit_reason, resources=spec.resources, egress=egress,
        )  # fmt: skip
        handle.wait_ready(START_TIMEOUT)
        return handle


def _launch(argv: list[str], keep: tuple[socket.socket | int, ...], accel: str) -> _VM:
    """Start QEMU with ``argv`` (plus its name and seccomp filter), passing it the
    descriptors in ``keep`` (QEMU's ends of socketpairs are closed here once passed).
    As root, QEMU runs as a host uid of its own (a guest that breaks out of QEMU's
    device emulation lands there), held until the VM is gone."""
    vm = uuid.uuid4().hex[:16]
    argv = [*argv, "-name", f"{NAME_PREFIX}.{os.getpid()}.{vm}", "-sandbox", QEMU_SECCOMP]
    fds = tuple(k if isinstance(k, int) else k.fileno() for k in keep)
    ids = _hostids.acquire() if os.geteuid() == 0 else None
    user: dict[str, Any] = {}
    if ids is not None:
        uid, gid = ids.pair
        groups = [grp.getgrnam("kvm").gr_gid] if accel == "kvm" else []
        user = {"user": uid, "group": gid, "extra_groups": groups}
    try:
        process = subprocess.Popen(
            argv,
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=fds,
            close_fds=True,
            start_new_session=True,
            **user,
        )
    except (OSError, subprocess.SubprocessError, KeyError) as exc:
        if ids is not None:
            ids.release()
        raise SandboxStartError(f"could not start QEMU: {exc}") from exc
    finally:
        for k in keep:
            if isinstance(k, socket.socket):
                k.close()
    return _VM(process, vm, ids)


def _make_snapshot(base: list[str], template: SandboxSpec, accel: str, out: Path) -> None:
    """Boot the template VM ``base`` describes, have it import ``template.preload``,
    and save it into ``out`` (:mod:`._snapshot`)."""
    host_sock, guest_sock = socket.socketpair()
    qmp_host, qmp_guest = socket.socketpair()
    monitor = [
        "-chardev",
        f"socket,id=qmp,fd={qmp_guest.fileno()}",
        "-mon",
        "chardev=qmp,mode=control",
    ]
    vm = _launch([*_with_channel(base, guest_sock), *monitor], (guest_sock, qmp_guest), accel)
    try:
        _await_guest(host_sock, START_TIMEOUT)
        request = {"type": "template", "preload": list(template.preload)}
        host_sock.sendall(json.dumps(request).encode() + b"\n")
        _await_line(host_sock, TEMPLATE_READY, START_TIMEOUT)
        _snapshot.save(_snapshot.QMP(qmp_host, START_TIMEOUT), out)
    except (SandboxStartError, OSError, ValueError) as exc:
        raise SandboxStartError(
            f"could not make the microvm snapshot: {exc}{vm.console()}"
        ) from None
    finally:
        vm.stop()
        host_sock.close()
        qmp_host.close()


TEMPLATE_READY = b'{"type": "template-ready"}\n'


GUEST_UP = b"sandlot-guest-up\n"


def _await_guest(sock: socket.socket, timeout: float) -> None:
    """Wait for the guest init's line saying the channel port is open in the guest
    (what the host sends before that, the guest kernel drops). EOF: QEMU is gone (it
    holds the other end of the socketpair)."""
    _await_line(sock, GUEST_UP, timeout)


def _await_line(sock: socket.socket, line: bytes, timeout: float) -> None:
    """Read exactly ``line`` from ``sock`` (nothing more: what follows is the runner's)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while not got.endswith(b"\n") and len(got) <= len(line):
            chunk = sock.recv(len(line) - len(got) or 1)
            if not chunk:
                raise SandboxStartError("the sandbox's VM exited while booting")
            got += chunk
    except TimeoutError:
        raise SandboxStartError(f"the sandbox's VM did not boot within {timeout:g} s") from None
    finally:
        sock.settimeout(None)
    if got != line:
        raise SandboxStartError(f"the sandbox's VM sent {got[:64]!r} instead of {line!r}")


def _exit_reason(code: int) -> str:
    if code == 0:
        return "the sandbox's VM powered off (its runner, pid 1 in the guest, exited)"
    if code < 0:
        return f"the sandbox's VM (QEMU) was killed by signal {-code}"
    return f"QEMU exited with status {code}"


class MicroVMHandle(ChannelHandle):
    """A VM sandbox: the channel, with QEMU as its process; its host ids go with it."""

    limits_fix = "Lower the limits in Resources."

    def __init__(
        self,
        sock: socket.socket,
        process: subprocess.Popen[bytes],
        *,
        vm: str,
        ids: _hostids.HostIds | None,
        egress: EgressLease | None = None,
        **kwargs: Any,
    ) -> None:
        self.vm = vm
        self._host_ids = ids
        self._egress = egress
        self._start = _start_time(process.pid)
        super().__init__(sock, process, on_exit=self._release, **kwargs)

    def kill(self) -> None:
        super().kill()
        # Nothing reaches the network in the sandbox's name after kill().
        if self._egress is not None:
            self._egress.close()

    def _release(self) -> None:
        if self._egress is not None:
            self._egress.close()
        if self._host_ids is not None:
            self._host_ids.release()

    def network_events(self, settle: float = 0.0) -> list[NetworkEvent] | None:
        return None if self._egress is None else self._egress.events(settle)

    def recovery_token(self) -> dict[str, Any] | None:
        pid = self._process.pid
        return {"pid": pid, "start": self._start, "vm": self.vm}


class ConsoleTail:
    """The last lines of the guest's console (kernel messages, the init's and runner's
    stderr), bounded in lines and line length: the guest writes it."""

    MAX_LINE = 1000

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[bytes]) -> None:
        partial = b""
        try:
            while chunk := stream.read1(65536):  # type: ignore[attr-defined]
                *complete, partial = (partial + chunk).split(b"\n")
                with self._lock:
                    for line in complete:
                        text = line[: self.MAX_LINE].decode("utf-8", "replace").rstrip("\r")
                        self.lines.append(text)
                partial = partial[: self.MAX_LINE]
        finally:
            stream.close()

    def __call__(self) -> str:
        """The last 20 lines before the guest kernel's panic, if it panicked (pid 1, the
        runner or the init, exited: its own last words come before the kernel's)."""
        with self._lock:
            lines = list(self.lines)
        cut = next((i for i, line in enumerate(lines) if "Kernel panic" in line), len(lines))
        return "\n".join(lines[max(0, cut - 20) : cut + 1])


def _sandlot_vms() -> list[tuple[int, int, str]]:
    """``(pid, owner pid, vm id)`` of every QEMU process this backend started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(args[:-1]):
            if arg == b"-name" and args[i + 1].startswith(NAME_PREFIX.encode() + b"."):
                parts = args[i + 1].decode("ascii", "replace").split(".")
                if len(parts) == 3 and parts[1].isdigit():
                    found.append((int(entry.name), int(parts[1]), parts[2]))
                break
    return found


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]
