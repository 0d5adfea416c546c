"""The runner's ``configure`` message, shared by every backend (a pure function).

The limits the runner applies to itself and enforces per cell do not depend on how
the sandbox was built; each backend adds only what is its own (the channel's file
descriptor). A sandbox with a network policy also gets the egress forwarder's settings
and the proxy variables (:func:`egress_env`); the backend mounts the lease's socket at
:data:`EGRESS_SOCKET_GUEST`.
"""

from __future__ import annotations

from sandlot.policy import MiB, SandboxSpec
from sandlot.protocol.layout import EGRESS_PORT, EGRESS_SOCKET_GUEST, HOME, LIB_GUEST

__all__ = ["EGRESS_PORT", "EGRESS_SOCKET_GUEST", "egress_env", "runner_config"]


def runner_config(
    spec: SandboxSpec, *, channel_fd: int, cgroup_limits: bool, envs: dict[str, str]
) -> dict[str, object]:
    """The configuration for ``spec``.

    ``cgroup_limits``: whole-sandbox cgroup limits are in place (False only in the
    caller's explicit best-effort mode). ``envs``: what the supervisor applies to
    everything it starts (kept off every command line).
    """
    r = spec.resources
    config: dict[str, object] = {
        "workdir": HOME,
        "lib": LIB_GUEST,
        "memory_mb": r.memory_mb,
        "output_bytes": r.output_bytes,
        "max_results": r.max_results,
        "result_bytes": r.result_bytes,
        "max_processes": r.background_processes,
        "kill_grace": 1.0,
        "rlimits": {
            "as": None if r.memory_mb is None else r.memory_mb * MiB,
            "cpu": r.cpu_seconds,
            # RLIMIT_NPROC counts every process of the host uid, which sandboxes share
            # when sandlot is not root, inside one zygote, and in containers: as a limit
            # it would make them fail each other's forks. The cgroup pids.max is the exact
            # per-sandbox limit; without cgroups (best effort) this is the only one left.
            "nproc": None if cgroup_limits else r.pids,
            "fsize": None if r.file_size_mb is None else r.file_size_mb * MiB,
            "nofile": r.open_files,
            "core": 0,
        },
        "fd": channel_fd,
        "envs": envs,
        "preload": list(spec.preload),
    }
    if spec.network.enabled:
        config["egress"] = {"socket": EGRESS_SOCKET_GUEST, "port": EGRESS_PORT}
    if spec.checkpointable:
        config["checkpointable"] = True
    return config


def egress_env(spec: SandboxSpec) -> dict[str, str]:
    """Proxy settings for everything in a sandbox with a network policy (else none):
    the usual variables, which urllib, requests, httpx, curl and pip read, plus pip's
    own. Connections to the sandbox's own loopback stay direct."""
    if not spec.network.enabled:
        return {}
    url = f"http://127.0.0.1:{EGRESS_PORT}"
    env: dict[str, str] = {}
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        env[name] = env[name.upper()] = url
    env["no_proxy"] = env["NO_PROXY"] = "localhost,127.0.0.1,::1"
    env["PIP_PROXY"] = url
    return env
