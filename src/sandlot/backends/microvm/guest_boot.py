"""Runs INSIDE the microVM, as pid 1, just before the runner (stdlib only).

The guest init execs this with the channel port on fds 0 and 1. A virtio-serial port
exists in the guest before the host side is known to be connected; until then the
guest kernel answers reads with end-of-file and drops what the host sends. So: wait
(bounded) until the port stops reporting a hang-up, tell the host with one line, then
exec the runner in this same process (it stays pid 1).

With ``--template`` (a snapshot template, backends/microvm/_snapshot.py) this process
is still root, and instead:

1. reads ``{"type": "template", "preload": [...]}``, imports those modules and the
   runner with uid 1000 as its effective uid (no effective capabilities), forks the
   default kernel, which drops to uid 1000 for good and sets itself up (its shell,
   its hooks) and waits for its configuration (:func:`prestart_kernel`), says
   ``{"type": "template-ready"}`` and waits on the channel. The host saves the VM here.
2. In each VM restored from that state, reads ``{"type": "restore", "entropy": HEX,
   "egress": PORT or null}``: adds the host's entropy to the kernel's pool and reseeds
   the kernel's random generator from it (``RNDADDENTROPY``, ``RNDRESEEDCRNG``; both
   need the root this process still holds), so no two restored VMs share the saved
   generator's state; opens the egress port if asked (root's device); then drops to
   uid 1000 for good (what ``setpriv`` does on a cold boot, verified in
   ``/proc/self/status``), starts the egress door (:func:`open_door`) and becomes the
   supervisor, which hands the waiting kernel its configuration: the kernel then
   reseeds Python's ``random``, numpy's generator, ``tempfile``'s names and OpenSSL's
   from the reseeded kernel (:func:`reseed_process`; a restored copy has the
   template's pids, so no at-fork hook does it) before it serves any cell. Anything
   that fails exits: the VM powers off and the host refuses it.
"""

import contextlib
import fcntl
import json
import os
import random
import select
import struct
import sys
import time
from collections.abc import Callable
from typing import IO, Any

GUEST_UP = b"sandlot-guest-up\n"
EGRESS_PORT_NAME = "sandlot-egress"  # backends/microvm/_qemu.py
UID = GID = 1000
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
PR_SET_DUMPABLE = 4
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
    write_fd(1, data)


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
    """Make the saved state small, so that each restore reads less: have the kernel
    hand this process nearly all free memory, zero-filled, and take it back, so that
    free pages are zero pages (QEMU saves those as a flag, not 4 KiB each). Best effort:
    a failure leaves a larger snapshot, not a different one.

    The page cache stays: dropping it did not make the state smaller here (285 MB
    either way: the files the imports read are mostly mapped, and mapped pages stay)
    and cost each restore some 30 reads from the emulated disk before its first result
    (the parts of the interpreter, libraries and modules a restored copy runs first),
    about 80 ms under TCG."""
    import mmap

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


_LIBC: Any = None


def libc() -> Any:
    """The C library through ctypes, loaded once (in a template, before the save)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import ctypes

        raise OSError(ctypes.get_errno(), "cannot " + what)


def _status() -> "dict[str, str]":
    with open("/proc/self/status") as handle:
        return dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)


def drop_bounding_set() -> None:
    """Empty the capability bounding set (what any exec could regain); needs an
    effective CAP_SETPCAP. The permitted set stays: a template's pid 1 still takes its
    effective capabilities back for the restore's reseed."""
    bounding = int(_status()["CapBnd"].strip(), 16)
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last = int(handle.read())
    for cap in range(last + 1):
        if bounding >> cap & 1:
            _check(libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")


def drop_privileges() -> None:
    """uid and gid 1000, no groups, every capability gone, no_new_privs: verified."""
    drop_bounding_set()
    os.setgroups([])
    os.setresgid(GID, GID, GID)
    os.setresuid(UID, UID, UID)  # clears the permitted and effective sets
    _check(libc().prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    _check(libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    fields = _status()
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        if int(fields[key].strip(), 16) != 0:
            raise OSError(f"{key} is not empty after dropping privileges")
    for key in ("Uid", "Gid"):
        if set(fields[key].split()) != {str(UID)}:
            raise OSError(f"{key} is {fields[key].strip()} after dropping privileges")
    if fields["Groups"].strip() or fields["NoNewPrivs"].strip() != "1":
        raise OSError("groups or no_new_privs are not as set")


def reseed_process() -> None:
    """This process's own generators, after the kernel's was reseeded: Python's
    ``random``, numpy's global generator and ``tempfile``'s names (a restored copy has
    the template's pid, so no at-fork hook reseeds them) and OpenSSL's, if loaded.
    numpy's gets a whole MT19937 state from the kernel (``seed()`` would derive one
    through its seed sequence, ten times slower under TCG)."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        import numpy

        key = numpy.frombuffer(os.urandom(624 * 4), dtype=numpy.uint32)
        numpy_random.set_state(("MT19937", key, 624, 0, 0.0))  # 624: twist before use
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # type: ignore[attr-defined]
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        # Reseeds OpenSSL's primary generator; the per-thread ones follow it at their
        # next use. (Also called in the template: a restore then pays only the reseed.)
        ssl.RAND_add(os.urandom(64), 64.0)


def prestart_kernel(lib: str, bootstrap: str) -> "Callable[[str, dict[str, Any]], Any]":
    """Start the default kernel now, in the template, so that a restored copy finds it
    ready: forking it and setting it up (its IPython shell, its hooks) would cost a
    restore about 0.5 s of emulated CPU under TCG. The kernel drops to uid 1000 for
    good at once (the snapshot holds it so), sets itself up as ``kernel_main`` does,
    and waits for its configuration on a pipe (:func:`_kernel_child`). Returns what
    the supervisor calls to hand it over (runner/_contexts.py ``Prestarted``)."""
    import socket

    from sandlot.runner._processes import Forked

    ours, theirs = socket.socketpair()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    go_r, go_w = os.pipe()
    up_r, up_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the kernel; never returns
        for fd in (go_w, up_r, out_r, err_r):
            os.close(fd)
        ours.close()
        _kernel_child(lib, bootstrap, theirs.detach(), out_w, err_w, go_r, up_w)
    theirs.close()
    for fd in (out_w, err_w, go_r, up_w):
        os.close(fd)
    if os.read(up_r, 1) != b"k":
        sys.stderr.write("sandlot guest: the kernel could not be started in the template\n")
        sys.exit(70)
    os.close(up_r)
    os.set_blocking(out_r, False)
    os.set_blocking(err_r, False)

    def start(cwd: str, config: "dict[str, Any]") -> Any:
        """Sent by the restored supervisor (after :func:`reseed_kernel`): the kernel's
        configuration, working directory and environment."""
        go = {"cwd": cwd, "config": config, "env": dict(os.environ)}
        write_fd(go_w, json.dumps(go).encode())
        os.close(go_w)
        return Forked(pid), ours, out_r, err_r

    return start


def _kernel_child(
    lib: str, bootstrap: str, sock_fd: int, out_w: int, err_w: int, go_r: int, up_w: int
) -> None:
    """The prestarted kernel: what ``become_kernel`` and ``kernel_main`` (runner) do for
    a forked kernel, split at the snapshot. Before it: uid 1000 for good, its own
    session, stdio on the supervisor's pipes, the kernel object installed (shell and
    hooks). After it, in each restored copy: its environment, fresh generators (the
    guest kernel's was reseeded before the configuration was sent), working directory,
    command line, limits, configuration; then it serves cells. Never returns."""
    import signal

    code = 70
    try:
        os.seteuid(0)  # for the drop (the bounding set needs CAP_SETPCAP)
        drop_privileges()
        from sandlot.runner import _kernel, _limits, _processes

        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in (0, 1, 2, sock_fd, go_r, up_w):
                with contextlib.suppress(OSError):
                    os.close(int(name))
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        kernel = _kernel.Kernel(_kernel.Channel(sock_fd), {"language": "python"})

        def on_sigint(signum: int, frame: Any) -> None:
            if kernel.in_cell:  # as kernel_main: only a running cell is interrupted
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)
        kernel.install()
        ssl = sys.modules.get("ssl")
        if ssl is not None:
            ssl.RAND_add(os.urandom(64), 64.0)  # OpenSSL's generator set up now, once
        write_fd(up_w, b"k")
        os.close(up_w)
        # --- saved here; below runs in each restored copy ------------------------------
        with os.fdopen(go_r, "rb") as pipe:
            go = json.loads(pipe.read())
        config = dict(go["config"])
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in go["env"].items()})
        reseed_process()
        os.chdir(str(go["cwd"]))
        args = ["kernel", "--fd", str(sock_fd)]
        _processes.set_cmdline([sys.executable, "-I", "-c", bootstrap, lib, *args])
        sys.argv = ["-c", lib, *args, "--config", json.dumps(config)]
        libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        try:  # before any user code, as kernel_main
            _limits.apply(config.get("rlimits") or {})
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"sandlot kernel: cannot apply resource limits: {exc}\n")
            os._exit(70)
        kernel.config = config
        if config.get("preload"):
            _kernel._preload(list(config["preload"]))
            kernel.channel.send({"type": "preloaded"})
        kernel.run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            sys.stderr.write(f"sandlot guest: the prestarted kernel failed: {exc!r}\n")
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def port_device(name: str) -> str:
    """The device node of the virtio-serial port the host named ``name``."""
    for entry in sorted(os.listdir("/sys/class/virtio-ports")):
        try:
            with open(f"/sys/class/virtio-ports/{entry}/name") as handle:
                if handle.read().strip() == name:
                    return f"/dev/{entry}"
        except OSError:
            continue
    raise OSError(f"no virtio-serial port named {name}")


def open_door(door: int, port: int) -> None:
    """The sandbox's door to the egress proxy: a listener on its loopback at ``port``
    (where its proxy variables point), each connection a stream over the ``door`` port
    (egress_mux.py), served by a thread of this process (pid 1, non-dumpable from the
    supervisor's start: user code can neither stop it nor take the port from it).
    Waits (bounded) for the host side of the port, which a restored VM learns of
    shortly after it resumes; the mux would read its absence as the end."""
    import socket
    import threading

    import egress_mux  # type: ignore[import-not-found]  # sandlot-lib/ in the guest

    poller = select.poll()
    poller.register(door, select.POLLIN | select.POLLOUT)
    deadline = time.monotonic() + 10.0
    while True:
        events = poller.poll(50)
        if events and not events[0][1] & (select.POLLHUP | select.POLLERR):
            break
        if time.monotonic() > deadline:
            raise OSError("the host never connected the egress port")
        time.sleep(0.005)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    mux = egress_mux.Mux(door, listener=listener)
    threading.Thread(target=mux.serve_forever, name="egress", daemon=True).start()


def template(lib: str, bootstrap: str) -> None:
    reader = os.fdopen(0, "rb", closefd=False)
    request = read_message(reader, "template")
    preload = [str(name) for name in request.get("preload") or []]
    # Imported with no effective capabilities and an empty bounding set (the saved uid
    # and the permitted set stay root's for step 2), the C library loaded for it.
    try:
        drop_bounding_set()
    except OSError as exc:
        sys.stderr.write(f"sandlot guest: {exc}\n")
        sys.exit(70)
    os.setegid(GID)
    os.seteuid(UID)
    sys.path.insert(0, lib)
    import socket  # noqa: F401 - imported before the save

    from sandlot.protocol.layout import HOME
    from sandlot.runner import _processes, _supervisor, _zygote

    _zygote._preload(preload)
    # The template's matplotlib files in the home now (a tmpfs in guest memory: each
    # restored copy has its own): copied after the restore, they cost a restore 30 to
    # 70 ms of emulated CPU before "ready". The supervisor skips them (home_ready).
    home_ready: str | None = os.environ.get("HOME", HOME)
    try:
        _supervisor._prepare_home(str(home_ready))
    except OSError as exc:
        home_ready = None  # the supervisor tries again, and says why if it fails
        sys.stderr.write(f"sandlot guest: matplotlib settings: {exc}\n")
    kernel = prestart_kernel(lib, bootstrap)
    shrink_memory()
    write_all(b'{"type": "template-ready"}\n')
    # --- the VM is saved here; everything below runs in each restored copy ----------
    restore = read_message(reader, "restore")
    door = None
    try:
        os.seteuid(0)  # back to root (effective capabilities) for the reseed and the drop
        reseed_kernel(bytes.fromhex(str(restore.get("entropy", ""))))
        random.seed()  # this process's own; the kernel's are reseeded as it starts
        if restore.get("egress"):
            door = os.open(port_device(EGRESS_PORT_NAME), os.O_RDWR | os.O_CLOEXEC)
        drop_privileges()
        if door is not None:
            open_door(door, int(restore["egress"]))
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"sandlot guest: cannot give this VM a fresh identity: {exc}\n")
        sys.exit(70)
    # What a cold VM's pid 1 shows (the supervisor's command line), not this script's.
    python = sys.executable
    _processes.set_cmdline([python, "-I", "-B", "-c", bootstrap, lib, "supervisor", "--stdio"])
    config = _supervisor.read_configuration(reader)
    if config is None:
        sys.exit(70)
    channel = _supervisor.StdioChannel(0, 1)
    sys.exit(_supervisor.run(channel, reader, config, home_ready=home_ready, prestarted=kernel))


def main() -> None:
    lib, bootstrap = sys.argv[1], sys.argv[2]
    # The guest kernel starts pid 1 at 1024 open files (soft): the supervisor's watches
    # hold a descriptor per directory and would fail with EMFILE before their own cap
    # (1024 directories). Up to the hard limit, as a sandbox's pid 1 has under bwrap;
    # the kernels apply Resources.open_files themselves.
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    wait_for_host()
    if sys.argv[3:] == ["--template"]:
        template(lib, bootstrap)
        return
    python = sys.executable
    os.execv(python, [python, "-I", "-B", "-c", bootstrap, lib, "supervisor", "--stdio"])


main()
