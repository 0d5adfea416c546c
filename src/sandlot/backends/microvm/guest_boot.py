"""Runs INSIDE the microVM, as pid 1, just before the runner (stdlib only).

The guest init execs this with the channel port on fds 0 and 1. A virtio-serial port
exists in the guest before the host side is known to be connected; until then the
guest kernel answers reads with end-of-file and drops what the host sends. So: wait
(bounded) until the port stops reporting a hang-up, tell the host with one line, then
exec the runner in this same process (it stays pid 1).

With ``--template`` (a snapshot template, backends/microvm/_snapshot.py) this process
is still root, and instead:

1. reads ``{"type": "template", "preload": [...]}``, imports those modules and the
   runner with uid 1000 as its effective uid (no effective capabilities), says
   ``{"type": "template-ready"}`` and waits on the channel. The host saves the VM here.
2. In each VM restored from that state, reads ``{"type": "restore", "entropy": HEX}``:
   adds the host's entropy to the kernel's pool and reseeds the kernel's random
   generator from it (``RNDADDENTROPY``, ``RNDRESEEDCRNG``; both need the root this
   process still holds), so no two restored VMs share the saved generator's state;
   then drops to uid 1000 for good (what ``setpriv`` does on a cold boot, verified in
   ``/proc/self/status``) and becomes the supervisor, which forks the default kernel
   from this process: Python's ``random``, numpy's generator and OpenSSL's reseed in
   the fork from the reseeded kernel. Anything that fails exits: the VM powers off
   and the host refuses it.
"""

import fcntl
import json
import os
import random
import select
import struct
import sys
import time
from typing import IO, Any

GUEST_UP = b"sandlot-guest-up\n"
UID = GID = 1000
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
MIN_ENTROPY = 32
MADV_POPULATE_WRITE = 23
SHRINK_MARGIN = 64 << 20
"""Bytes of free memory :func:`shrink_memory` leaves alone (the kernel's own needs)."""


def wait_for_host() -> None:
    poller = select.poll()
    poller.register(0, select.POLLIN | select.POLLOUT)
    deadline = time.monotonic() + 30.0
    while True:
        events = poller.poll(100)
        if events and not events[0][1] & (select.POLLHUP | select.POLLERR):
            break
        if time.monotonic() > deadline:
            sys.stderr.write("sandlot guest: the host never connected the channel port\n")
            sys.exit(70)
        time.sleep(0.005)  # a hung-up port polls ready at once: do not spin
    write_all(GUEST_UP)


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]


def read_message(reader: "IO[bytes]", kind: str) -> "dict[str, Any]":
    line = reader.readline()
    try:
        message = json.loads(line)
    except ValueError:
        message = None
    if not isinstance(message, dict) or message.get("type") != kind:
        sys.stderr.write(f"sandlot guest: expected a {kind} message, got {line[:80]!r}\n")
        sys.exit(70)
    return message


def reseed_kernel(seed: bytes) -> None:
    """Mix ``seed`` into the kernel's input pool, credited, then reseed its random
    generator from that pool now (not at its next scheduled reseed)."""
    if len(seed) < MIN_ENTROPY:
        raise ValueError(f"{len(seed)} bytes of entropy from the host, fewer than {MIN_ENTROPY}")
    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def shrink_memory() -> None:
    """Make the saved state small, so that each restore reads less: drop the page cache
    the imports filled (files mapped by this process stay), then have the kernel hand
    this process nearly all free memory, zero-filled, and take it back, so that free
    pages are zero pages (QEMU saves those as a flag, not 4 KiB each). Best effort: a
    failure leaves a larger snapshot, not a different one."""
    import mmap

    os.seteuid(0)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3")
    except OSError as exc:
        sys.stderr.write(f"sandlot guest: could not drop the page cache: {exc}\n")
    finally:
        os.seteuid(UID)
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
    free = int(fields["MemFree"].split()[0]) * 1024 - SHRINK_MARGIN
    if free <= 0:
        return
    try:
        area = mmap.mmap(-1, free, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return
    try:
        area.madvise(MADV_POPULATE_WRITE)
    except OSError:
        pass
    finally:
        area.close()


def drop_privileges() -> None:
    """uid and gid 1000, no groups, every capability gone, no_new_privs: verified."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), "cannot " + what)

    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last = int(handle.read())
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    os.setgroups([])
    os.setresgid(GID, GID, GID)
    os.setresuid(UID, UID, UID)  # clears the permitted and effective sets
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    with open("/proc/self/status") as handle:
        fields = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        if int(fields[key].strip(), 16) != 0:
            raise OSError(f"{key} is not empty after dropping privileges")
    for key in ("Uid", "Gid"):
        if set(fields[key].split()) != {str(UID)}:
            raise OSError(f"{key} is {fields[key].strip()} after dropping privileges")
    if fields["Groups"].strip() or fields["NoNewPrivs"].strip() != "1":
        raise OSError("groups or no_new_privs are not as set")


def template(lib: str, bootstrap: str) -> None:
    reader = os.fdopen(0, "rb", closefd=False)
    request = read_message(reader, "template")
    preload = [str(name) for name in request.get("preload") or []]
    # Imported with no effective capabilities (the saved uid stays root for step 2).
    os.setegid(GID)
    os.seteuid(UID)
    sys.path.insert(0, lib)
    from sandlot.runner import _zygote

    _zygote._preload(preload)
    shrink_memory()
    write_all(b'{"type": "template-ready"}\n')
    # --- the VM is saved here; everything below runs in each restored copy ----------
    restore = read_message(reader, "restore")
    try:
        os.seteuid(0)  # back to root (effective capabilities) for the reseed and the drop
        reseed_kernel(bytes.fromhex(str(restore.get("entropy", ""))))
        random.seed()  # this process's own; forks reseed themselves (at-fork hooks)
        drop_privileges()
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"sandlot guest: cannot give this VM a fresh identity: {exc}\n")
        sys.exit(70)
    from sandlot.runner import _processes, _supervisor

    # What a cold VM's pid 1 shows (the supervisor's command line), not this script's.
    python = sys.executable
    _processes.set_cmdline([python, "-I", "-B", "-c", bootstrap, lib, "supervisor", "--stdio"])
    config = _supervisor.read_configuration(reader)
    if config is None:
        sys.exit(70)
    sys.exit(_supervisor.run(_supervisor.StdioChannel(0, 1), reader, config, fork_kernel=True))


def main() -> None:
    lib, bootstrap = sys.argv[1], sys.argv[2]
    wait_for_host()
    if sys.argv[3:] == ["--template"]:
        template(lib, bootstrap)
        return
    python = sys.executable
    os.execv(python, [python, "-I", "-B", "-c", bootstrap, lib, "supervisor", "--stdio"])


main()
