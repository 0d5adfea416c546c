"""The microvm backend's pure parts: where its artifacts are, the QEMU command line for
a sandbox, and the runner's part of the initramfs.

No side effects but reading and writing the backend's own cache files; everything the
VM is allowed to do is decided by :func:`qemu_argv` from the spec, so a test can read
the decision without booting anything.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import sandlot.protocol
import sandlot.runner
from sandlot._exceptions import BackendUnavailable
from sandlot.policy import SandboxSpec
from sandlot.runner import BOOTSTRAP
from sandlot.templates import cache_dir

SETUP_FIX = "run scripts/setup-vm.sh (as root) from a sandlot checkout"
DIR_ENV = "SANDLOT_MICROVM_DIR"
"""Overrides where the kernel, initramfs and root filesystem images are found."""
QEMU_ENV = "SANDLOT_QEMU"
"""Overrides the QEMU binary (default ``qemu-system-x86_64`` on ``$PATH``)."""
MEMORY_HEADROOM_MB = 256
"""Guest memory beyond ``Resources.memory_mb``: the guest kernel, its page cache for the
read-only root, and the runner (the per-process limit inside stays ``memory_mb``)."""
DEFAULT_MEMORY_MB = 2048
"""Guest memory when ``Resources.memory_mb`` is None (a VM needs a size)."""
CHANNEL_PORT = "sandlot"
"""The virtio-serial port's name; the guest init finds its device by it."""
EGRESS_PORT_NAME = "sandlot-egress"
"""The second virtio-serial port: the door to the egress proxy (egress_mux.py). Every VM
has it, so that one snapshot serves sandboxes with and without a network policy;
without one its host side is QEMU's ``null`` backend (it leads nowhere) and the guest
never opens it (its device node is root's, and pid 1 opens it only when told to)."""
EGRESS_NULL = "null,id=egress"


@dataclass(frozen=True, slots=True)
class Artifacts:
    """What scripts/setup-vm.sh built: the guest kernel, the base initramfs (busybox,
    virtio modules, the guest init) and a read-only root filesystem per template."""

    directory: Path
    kernel: Path
    initrd: Path
    images: dict[str, Path]
    kernel_package: str

    def image(self, template: str) -> Path:
        path = self.images.get(template)
        if path is None or not path.is_file():
            raise BackendUnavailable(
                f"no microvm root filesystem for template {template!r} in {self.directory} "
                f"(templates built: {', '.join(sorted(self.images)) or 'none'}). "
                f"Fix: {SETUP_FIX}"
            )
        return path


def artifacts_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or cache_dir() / "microvm")


def find_artifacts() -> Artifacts:
    """The artifacts of the last complete scripts/setup-vm.sh run; fails closed
    (:class:`BackendUnavailable` naming the fix) when any is missing."""
    directory = artifacts_dir()
    manifest = directory / "microvm.json"
    try:
        data = json.loads(manifest.read_text())
        kernel = directory / str(data["kernel"])
        initrd = directory / str(data["initrd"])
        images = {str(k): directory / str(v) for k, v in dict(data["images"]).items()}
        package = str(data.get("kernel_package", "?"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackendUnavailable(
            f"the microvm guest kernel and images are not set up ({manifest}: {exc}). "
            f"Fix: {SETUP_FIX}"
        ) from None
    for what, path in (("guest kernel", kernel), ("initramfs", initrd)):
        if not path.is_file():
            raise BackendUnavailable(f"the microvm {what} {path} is missing. Fix: {SETUP_FIX}")
    return Artifacts(directory, kernel, initrd, images, package)


# --- the runner's initramfs part ------------------------------------------------------
def _cpio_entry(out: io.BytesIO, name: str, mode: int, data: bytes = b"") -> None:
    """One ``newc`` cpio entry (the format the kernel unpacks into its initramfs)."""
    encoded = name.encode() + b"\0"
    fields = [0, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
    out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
    out.write(b"\0" * (-(110 + len(encoded)) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))


def runner_cpio() -> bytes:
    """``/sandlot-lib``: sandlot.runner and sandlot.protocol as this host has them, the
    bootstrap that starts the runner, and :mod:`.guest_boot`, which runs first."""
    out = io.BytesIO()
    _cpio_entry(out, "sandlot-lib", stat.S_IFDIR | 0o755)
    _cpio_entry(out, "sandlot-lib/bootstrap.py", stat.S_IFREG | 0o644, BOOTSTRAP.encode())
    boot = Path(__file__).with_name("guest_boot.py").read_bytes()
    _cpio_entry(out, "sandlot-lib/guest_boot.py", stat.S_IFREG | 0o644, boot)
    mux = Path(__file__).with_name("egress_mux.py").read_bytes()
    _cpio_entry(out, "sandlot-lib/egress_mux.py", stat.S_IFREG | 0o644, mux)
    _cpio_entry(out, "sandlot-lib/sandlot", stat.S_IFDIR | 0o755)
    for package in (sandlot.protocol, sandlot.runner):
        root = Path(str(package.__file__)).parent
        base = f"sandlot-lib/sandlot/{root.name}"
        _cpio_entry(out, base, stat.S_IFDIR | 0o755)
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts:
                continue
            name = f"{base}/{path.relative_to(root).as_posix()}"
            if path.is_dir():
                _cpio_entry(out, name, stat.S_IFDIR | 0o755)
            elif path.is_file():
                _cpio_entry(out, name, stat.S_IFREG | 0o644, path.read_bytes())
    _cpio_entry(out, "TRAILER!!!", 0)
    return out.getvalue()


def _runner_files() -> list[Path]:
    files = [Path(__file__).with_name(n) for n in ("guest_boot.py", "egress_mux.py")]
    for package in (sandlot.protocol, sandlot.runner):
        root = Path(str(package.__file__)).parent
        files += [p for p in root.rglob("*") if "__pycache__" not in p.parts]
    return sorted(files)


_BUILT: dict[tuple[object, ...], Path] = {}
"""Initramfs files this process built or found, by the stat of their inputs: a start
then costs a few stats, not reading and hashing the runner and the base (10 to 50 ms)."""


def sandbox_initrd(artifacts: Artifacts) -> Path:
    """The base initramfs with the runner appended (the kernel unpacks concatenated
    archives in order), cached by content next to the base."""
    stamp = tuple(
        (str(p), info.st_size, info.st_mtime_ns)
        for p in [artifacts.initrd, *_runner_files()]
        for info in [p.stat()]
    )
    known = _BUILT.get(stamp)
    if known is not None and known.is_file():
        return known
    _BUILT[stamp] = path = _build_initrd(artifacts)
    return path


def _build_initrd(artifacts: Artifacts) -> Path:
    runner = runner_cpio()
    base = artifacts.initrd.read_bytes()
    key = hashlib.sha256(base + runner).hexdigest()[:16]
    path = artifacts.directory / f"initrd-sandbox-{key}.cpio"
    if not path.is_file():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(base + b"\0" * (-len(base) % 4) + runner)
        tmp.replace(path)
    return path


def default_machine(accel: str, snapshot: bool = False) -> str:
    """``microvm`` under KVM and for VMs restored from a snapshot, ``q35`` for VMs
    booted cold under TCG. Measured here under TCG, two runs (bench/results/microvm-*.md):
    q35 reached the runner's ready in 4.6 and 4.3 s, microvm in 8.5 and 6.4 s; the
    microvm machine offers the guest no timer to calibrate its clock against (no HPET,
    no ACPI PM timer). A restore does not boot: there the microvm machine (fewer
    devices, no firmware, no PCI) loads the same state in about 170 ms instead of 300
    (bench/results/microvm-20261127.md); its slower boot is paid once, by the template.
    Under KVM (kvmclock) it skips the firmware and PCI enumeration, which is what makes
    it boot fast."""
    return "microvm" if accel == "kvm" or snapshot else "q35"


# --- the command line --------------------------------------------------------------------
def guest_memory_mb(spec: SandboxSpec) -> int:
    memory = spec.resources.memory_mb
    return (DEFAULT_MEMORY_MB if memory is None else memory) + MEMORY_HEADROOM_MB


def guest_cpus(spec: SandboxSpec) -> int:
    cpus = spec.resources.cpus
    wanted = 1 if cpus is None else max(1, math.ceil(cpus))
    return min(wanted, os.cpu_count() or 1)


def host_tsc_khz() -> int | None:
    """The host's CPU clock in kHz (``cpu MHz`` of /proc/cpuinfo), or None."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("cpu MHz"):
                    return round(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        return None
    return None


def kernel_cmdline(
    spec: SandboxSpec, accel: str = "tcg", machine: str = "microvm", *, template: bool = False
) -> str:
    """``template``: the guest boots as a snapshot template (:mod:`._snapshot`): its
    pid 1 keeps root until a restored copy has reseeded the kernel's random generator."""
    r = spec.resources
    clock = ""
    khz = host_tsc_khz() if accel == "tcg" and machine == "microvm" else None
    if khz:
        # Under TCG the guest's TSC ticks at the host's rate, and the microvm machine has
        # no HPET or ACPI PM timer to measure it against: the kernel would hang trying.
        clock = f"tsc_early_khz={khz} "
    if accel == "tcg":
        # The kernel's check that the IO-APIC timer ticks measures it against emulated
        # time; on a loaded host it fails and the guest panics at boot ("IO-APIC +
        # timer doesn't work!", seen on q35 here). The timer works; skip the check.
        clock += "no_timer_check "
        # QEMU 7.2's TCG (bookworm's) computes the flags of a %gs-relative CMPXCHG16B
        # wrongly now and then; the 6.12 kernel's SLUB branches on them in its lockless
        # fast path and the guest panics on a corrupt freelist (about one VM in ten).
        # Without CX16 in its own feature bits the kernel takes the locked path; user
        # space still sees it (nothing there uses a %gs-relative one). No effect on KVM.
        clock += "clearcpuid=cx16 "
    disk = 1024 if r.disk_mb is None else r.disk_mb
    tmp = 256 if r.tmp_mb is None else r.tmp_mb
    return (
        # panic=-1 with -no-reboot: when the runner (pid 1) exits, QEMU exits.
        "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init "
        # No entropy wait, no devices probed that the VM does not have.
        "random.trust_cpu=on i8042.noaux i8042.nokbd i8042.nopnp "
        f"{clock}sandlot.disk_mb={disk} sandlot.tmp_mb={tmp}"
        + (" sandlot.template=1" if template else "")
    )


def qemu_argv(
    qemu: str,
    spec: SandboxSpec,
    *,
    kernel: Path,
    initrd: Path,
    image: Path,
    channel_fd: int,
    accel: str,
    machine: str = "microvm",
    template: bool = False,
) -> list[str]:
    """The QEMU command line for ``spec``: a ``microvm`` machine with no network device
    (no ``-nic``/``-netdev`` and ``-nodefaults``), the template's root filesystem on a
    read-only virtio-blk device, the protocol on a virtio-serial port backed by
    ``channel_fd`` (QEMU's end of a socketpair), a second port for the egress door
    backed by nothing (:data:`EGRESS_PORT_NAME`), the console on QEMU's stdout, and no
    monitor. ``accel``: ``kvm`` or ``tcg``. ``machine``: ``microvm`` (virtio-mmio, no
    firmware) or ``q35`` (virtio-pci behind SeaBIOS); see :func:`default_machine`.
    ``template``: boot a snapshot template (:func:`kernel_cmdline`)."""
    if accel not in ("kvm", "tcg"):
        raise ValueError(f"accel must be 'kvm' or 'tcg': {accel!r}")
    if machine not in ("microvm", "q35"):
        raise ValueError(f"machine must be 'microvm' or 'q35': {machine!r}")
    bus = "device" if machine == "microvm" else "pci"
    spec_machine = (
        "microvm,x-option-roms=off,rtc=off,isa-serial=on" if machine == "microvm" else "q35"
    )
    return [
        qemu,
        "-M", spec_machine,
        "-accel", accel,
        "-cpu", "host" if accel == "kvm" else "max",
        "-m", f"{guest_memory_mb(spec)}M",
        "-smp", str(guest_cpus(spec)),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-monitor", "none",
        "-serial", "stdio",
        "-kernel", str(kernel),
        "-initrd", str(initrd),
        "-append", kernel_cmdline(spec, accel, machine, template=template),
        "-drive", f"id=root,file={image},format=raw,if=none,readonly=on",
        "-device", f"virtio-blk-{bus},drive=root",
        "-chardev", f"socket,id=channel,fd={channel_fd}",
        "-device", f"virtio-serial-{bus},max_ports=3",
        "-device", f"virtserialport,chardev=channel,nr=1,name={CHANNEL_PORT}",
        "-chardev", EGRESS_NULL,
        "-device", f"virtserialport,chardev=egress,nr=2,name={EGRESS_PORT_NAME}",
    ]  # fmt: skip
