"""The bubblewrap backend: Linux namespaces, no daemon, the default on Linux.

Side effects live here; the isolation decisions live in :mod:`._compile`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import sandlot.protocol
import sandlot.runner
from sandlot._exceptions import (
    BackendUnavailable,
    IsolationUnavailable,
    ProtocolError,
    SandboxStartError,
)
from sandlot.backends._base import Backend, Probe, SandboxHandle
from sandlot.backends._channel import ChannelHandle
from sandlot.backends.bwrap._compile import ETC_ENTRIES, HostLayout, build_argv, runner_config
from sandlot.policy import SandboxSpec
from sandlot.protocol import PROTOCOL_VERSION, encode
from sandlot.templates import ensure_template

START_TIMEOUT = 30.0
MIN_VERSION = (0, 8, 0)  # --disable-userns, --size for tmpfs

_HOST_FIX = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap) and allow unprivileged user namespaces "
    "(sysctl -w kernel.unprivileged_userns_clone=1 where that sysctl exists; "
    "sysctl -w user.max_user_namespaces=15000 if it is 0; on Ubuntu >= 23.10 also "
    "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for "
    "bwrap; inside Docker, run the container with --security-opt seccomp=unconfined "
    "--security-opt apparmor=unconfined or use sandlot's docker backend)"
)


def _bwrap_path() -> str | None:
    """The bwrap binary: ``$SANDLOT_BWRAP`` if set (and then only that), else PATH."""
    configured = os.environ.get("SANDLOT_BWRAP")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )


def _version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [bwrap, "--version"], capture_output=True, text=True, timeout=10, env={}
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _probe() -> Probe:
    details: dict[str, str] = {}
    bwrap = _bwrap_path()
    if bwrap is None:
        where = os.environ.get("SANDLOT_BWRAP") or "PATH"
        return Probe(
            "bwrap",
            False,
            f"bubblewrap (bwrap) is not installed (looked in {where})",
            _HOST_FIX,
            10,
            details,
        )
    version = _version(bwrap)
    details["bwrap"] = f"{bwrap} {'.'.join(map(str, version or ()))}"
    if version is None or version < MIN_VERSION:
        return Probe(
            "bwrap",
            False,
            f"bubblewrap {'.'.join(map(str, version or ())) or '?'} is too old; sandlot needs "
            f">= {'.'.join(map(str, MIN_VERSION))}",
            "upgrade bubblewrap (Debian 12 and Ubuntu 24.04 ship a recent enough one)",
            10,
            details,
        )
    for knob in (
        "kernel.unprivileged_userns_clone",
        "user.max_user_namespaces",
        "kernel.apparmor_restrict_unprivileged_userns",
    ):
        value = _sysctl(knob)
        if value is not None:
            details[knob] = value
    # The real test: start a minimal sandbox with every namespace sandlot uses.
    argv = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--disable-userns",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        *_root_args(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(1 << 20),
        "--tmpfs",
        "/tmp",
        "--",
        "/usr/bin/true",
    ]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=20, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe("bwrap", False, f"bwrap self-test failed: {exc}", _HOST_FIX, 10, details)
    if result.returncode != 0:
        reason = result.stderr.strip() or f"exit status {result.returncode}"
        return Probe(
            "bwrap", False, f"bwrap cannot create namespaces here: {reason}", _HOST_FIX, 10, details
        )
    details["namespaces"] = "user, pid, net, ipc, uts, mount: ok"
    return Probe("bwrap", True, "", "", 10, details)


def _root_args() -> list[str]:
    args: list[str] = []
    links, dirs = _root_layout()
    for path, target in sorted(links.items()):
        args += ["--symlink", target, path]
    for path in dirs:
        args += ["--ro-bind", path, path]
    return args


@functools.lru_cache(maxsize=1)
def _root_layout() -> tuple[dict[str, str], tuple[str, ...]]:
    """Which of /bin, /sbin, /lib* are symlinks into /usr (merged /usr) or real dirs."""
    links: dict[str, str] = {}
    dirs: list[str] = []
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            dirs.append(path)
    return links, tuple(dirs)


def _say(line: str) -> None:
    # A first Sandbox() may build the template (about a minute); say so on stderr
    # rather than look hung.
    print(f"sandlot: {line}", file=sys.stderr, flush=True)


class _StderrTail:
    """Keeps the last lines bwrap and the runner wrote to stderr, for error messages.

    Bounded in lines and in line length: code in the sandbox may be able to write to
    this pipe, and must not make the host buffer an endless line.
    """

    MAX_LINE = 1000

    def __init__(self, stream: Any) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: Any) -> None:
        partial = b""
        try:
            while chunk := stream.read1(65536):
                *complete, partial = (partial + chunk).split(b"\n")
                for line in complete:
                    self.lines.append(line[: self.MAX_LINE].decode("utf-8", "replace"))
                partial = partial[: self.MAX_LINE]
            if partial:
                self.lines.append(partial.decode("utf-8", "replace"))
        finally:
            # EOF: the sandbox is gone. Close the pipe here instead of leaving it to the
            # garbage collector, which held the fd until then and raised ResourceWarning.
            stream.close()

    def __call__(self) -> str:
        return "\n".join(self.lines)


class _Spawner:
    """Starts every bwrap process from one thread that lives as long as this process.

    ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, and Linux delivers it when the
    *thread* that forked the child exits, not the process. Popen'ed from the caller's
    thread, a sandbox created in a short-lived thread (a worker, a request handler,
    ``asyncio.to_thread``) was killed the moment that thread ended, and the next call
    silently started a new, empty one. From this thread, the sandbox still dies with
    the process (SIGKILL included), which is what --die-with-parent is for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[subprocess.Popen[bytes]], list[str], Any]]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        done: Future[subprocess.Popen[bytes]] = Future()
        with self._lock:
            # Not alive after os.fork() in a child process: start one there too.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="sandlot-bwrap-spawner", daemon=True
                )
                self._thread.start()
            self._jobs.put((done, argv, kwargs))
        return done.result()

    def _serve(self) -> None:
        while True:
            done, argv, kwargs = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:
                done.set_exception(exc)


_SPAWNER = _Spawner()


class BwrapBackend(Backend):
    """Runs each sandbox as a bubblewrap process tree in fresh namespaces."""

    name = "bwrap"

    @classmethod
    def probe(cls) -> Probe:
        return _probe()

    def start(self, spec: SandboxSpec) -> SandboxHandle:
        probe = self.probe()
        if not probe.available:
            raise BackendUnavailable(f"bwrap backend unavailable: {probe.reason}. Fix: {probe.fix}")
        bwrap = _bwrap_path()
        assert bwrap is not None
        template = ensure_template(spec.template, progress=_say)
        links, dirs = _root_layout()
        host_sock, child_sock = socket.socketpair()
        layout = HostLayout(
            template_dir=str(template.path),
            base_prefix=str(template.base_prefix),
            protocol_dir=str(Path(sandlot.protocol.__file__).parent),
            runner_dir=str(Path(sandlot.runner.__file__).parent),
            generated_etc_dir=str(Path(__file__).parent / "etc"),
            root_symlinks=links,
            root_dirs=dirs,
            etc_entries=[p for p in ETC_ENTRIES if os.path.exists(p)],
            channel_fd=child_sock.fileno(),
        )
        fd = child_sock.fileno()
        argv = build_argv(spec, layout, bwrap=bwrap)
        try:
            # env={}: bwrap's own process (pid 1 inside) keeps the environment it was
            # started with, visible as /proc/1/environ; give it nothing.
            process = _SPAWNER.popen(
                argv,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(fd,),
                close_fds=True,
            )
        except OSError as exc:
            host_sock.close()
            raise SandboxStartError(f"could not start bwrap: {exc}") from exc
        finally:
            child_sock.close()
        assert process.stderr is not None
        tail = _StderrTail(process.stderr)
        configure = {"type": "configure", "id": "configure", "config": runner_config(spec, fd)}
        # OSError: the sandbox died at once; wait_ready reports it with bwrap's stderr.
        with contextlib.suppress(OSError):
            host_sock.sendall(encode(configure))
        handle = ChannelHandle(host_sock, process, stderr_tail=tail)
        try:
            ready = handle.wait_ready(START_TIMEOUT)
        except SandboxStartError as exc:
            if "cannot apply resource limits" in tail():
                raise IsolationUnavailable(
                    f"the sandbox could not apply its resource limits, so sandlot refuses to "
                    f"run it: {tail()}. Lower the limits in Resources or raise the host's hard "
                    f"limits (ulimit -H)."
                ) from exc
            raise
        if ready.get("version") != PROTOCOL_VERSION:
            handle.kill()
            raise ProtocolError(
                f"runner speaks protocol {ready.get('version')}, the host {PROTOCOL_VERSION}"
            )
        return handle
