"""The bubblewrap backend: Linux namespaces, no daemon, the default on Linux.

Side effects live here and in :mod:`._host` (shared with the zygote backend); the
isolation decisions live in :mod:`._compile`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

from sandlot._exceptions import (
    BackendUnavailable,
    CheckpointError,
    IsolationUnavailable,
    SandboxStartError,
)
from sandlot.backends._base import Backend, Finding, Probe, SandboxHandle
from sandlot.backends.bwrap import _host, _persist, _seccomp
from sandlot.backends.bwrap._compile import build_argv, runner_config
from sandlot.backends.bwrap._host import (
    SPAWNER,
    START_TIMEOUT,
    BwrapHandle,
    Enter,
    StderrTail,
    bwrap_path,
    cgroup_for,
    host_ids,
    host_layout,
    probe_host,
    say,
    sweep_once,
)
from sandlot.egress import EgressLease, EgressProxy, default_proxy
from sandlot.policy import SandboxSpec
from sandlot.protocol import encode
from sandlot.templates import ensure_template

__all__ = ["START_TIMEOUT", "BwrapBackend", "BwrapHandle", "host_layout"]


class BwrapBackend(Backend):
    """Runs each sandbox as a bubblewrap process tree in fresh namespaces."""

    name = "bwrap"
    # "auto" starts bubblewrap sandboxes from a zygote when it can: the same layers,
    # built around a fork of a process that has the data stack imported already.
    fast_path = "zygote"

    def __init__(self, *, egress: EgressProxy | None = None) -> None:
        """``egress``: the proxy for sandboxes with a network policy (default: the
        process-wide :func:`sandlot.egress.default_proxy`)."""
        self._egress = egress

    @property
    def egress(self) -> EgressProxy:
        return self._egress or default_proxy()

    @classmethod
    def probe(cls) -> Probe:
        return probe_host()

    @classmethod
    def checks(cls) -> list[Finding]:
        return _host.checks()

    @classmethod
    def cleanup_orphans(cls) -> list[str]:
        roots = [f"restored root {name}" for name in _persist.sweep_orphan_roots()]
        return _host.cleanup_orphans() + roots

    @classmethod
    def reap(cls, token: Mapping[str, Any]) -> bool:
        return _host.reap(token)

    def restore(self, source: str, spec: SandboxSpec) -> SandboxHandle:
        if spec.network.enabled:
            raise CheckpointError("a sandbox with a network policy cannot be restored yet")
        return _persist.restore(source, spec)

    def start(self, spec: SandboxSpec) -> SandboxHandle:
        probe = self.probe()
        if not probe.available:
            raise BackendUnavailable(f"bwrap backend unavailable: {probe.reason}. Fix: {probe.fix}")
        bwrap = bwrap_path()
        assert bwrap is not None
        template = ensure_template(spec.template, progress=say)
        sweep_once()
        with contextlib.ExitStack() as cleanup:
            # Everything opened here is closed when start() returns or fails; the
            # cgroup is removed on failure and, once started, when the sandbox ends.
            group = cgroup_for(spec)
            if group is not None:
                cleanup.callback(group.close_fds)
                failed = cleanup.enter_context(contextlib.ExitStack())
                failed.callback(group.destroy)
            # This sandbox's own host uid/gid (as root): given back when it ends.
            userns_fd: int | None = None
            ids: Any
            if spec.checkpointable:
                if spec.network.enabled:
                    raise CheckpointError(
                        "a sandbox with a network policy cannot be checkpointable yet"
                    )
                ids, userns_fd = _persist.checkpointable_ids()
                cleanup.callback(os.close, userns_fd)
            else:
                ids = host_ids()
            drop = ids.pair if ids is not None else None
            if ids is not None:
                failed_ids = cleanup.enter_context(contextlib.ExitStack())
                failed_ids.callback(ids.release)
            program_fd = _seccomp.program_fd()
            cleanup.callback(os.close, program_fd)
            host_sock, child_sock = socket.socketpair()
            cleanup.callback(child_sock.close)
            lease: EgressLease | None = None
            if spec.network.enabled:
                # Its own socket on the shared proxy; closed with the sandbox.
                lease = self.egress.open(spec.sandbox_id or "sandbox", spec.network, drop)
                unleash = cleanup.enter_context(contextlib.ExitStack())
                unleash.callback(lease.close)
            layout = host_layout(
                template,
                drop,
                channel_fd=child_sock.fileno(),
                seccomp_fd=program_fd,
                egress_socket=lease.socket_path if lease is not None else None,
                userns_fd=userns_fd,
            )
            fd = child_sock.fileno()
            argv = build_argv(spec, layout, bwrap=bwrap)
            extra_fds = () if userns_fd is None else (userns_fd,)
            try:
                # env={}: bwrap's own process (pid 1 inside) keeps the environment it was
                # started with, visible as /proc/1/environ; give it nothing. A
                # checkpointable sandbox's bwrap runs as root (it joins a root-owned
                # user namespace; the sandbox's processes run as its host ids there).
                process = SPAWNER.popen(
                    argv,
                    env={},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=(fd, program_fd, *extra_fds),
                    close_fds=True,
                    preexec_fn=Enter(
                        group.attach_fds if group else (),
                        None if userns_fd is not None else drop,
                        # A checkpointable sandbox's share of root's queue bytes and
                        # queued signals (see _persist.quota_share).
                        _persist.quota_share()[1] if userns_fd is not None else (),
                    ),
                )
            except (OSError, subprocess.SubprocessError) as exc:
                host_sock.close()
                raise SandboxStartError(f"could not start bwrap: {exc}") from exc
            if group is not None:
                failed.pop_all()  # from here on the handle owns the cgroup
            if lease is not None:
                unleash.pop_all()  # and the egress lease
            if ids is not None:
                failed_ids.pop_all()  # and the host ids
        assert process.stderr is not None
        tail = StderrTail(process.stderr)
        config = runner_config(spec, fd, cgroup_limits=group is not None)
        configure = {"type": "configure", "id": "configure", "config": config}
        # OSError: the sandbox died at once; wait_ready reports it with bwrap's stderr.
        with contextlib.suppress(OSError):
            host_sock.sendall(encode(configure))
        handle = BwrapHandle(
            host_sock,
            process,
            stderr_tail=tail,
            cgroup=group,
            egress=lease,
            resources=spec.resources,
            ids=ids,
            checkpointer=(
                _persist.checkpointer(_persist.info_from_argv(argv, fd))
                if spec.checkpointable
                else None
            ),
        )
        try:
            handle.wait_ready(START_TIMEOUT)
        except SandboxStartError as exc:
            if "seccomp" in tail():
                raise IsolationUnavailable(
                    f"bwrap could not install the syscall filter, so sandlot refuses to run "
                    f"the sandbox: {tail()}. Fix: a kernel with CONFIG_SECCOMP_FILTER "
                    f"(every mainstream distribution has it) and no outer seccomp policy "
                    f"that forbids filters"
                ) from exc
            raise
        return handle
