"""Policy -> container settings (``backends.docker._compile``), the seccomp profile and the
template Dockerfile: goldens and security properties. No engine needed.

The golden files under ``golden/`` are the complete Engine API bodies; any change to
the container's shape shows up in review as a diff of them. After an intended change,
regenerate with ``SANDLOT_UPDATE_GOLDEN=1 pytest tests/docker/test_docker_compile.py``.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sandlot.backends.docker._accounts import group_text, passwd_text
from sandlot.backends.docker._compile import (
    LABEL,
    LABEL_OWNER,
    LIB_GUEST,
    ContainerLayout,
    build_create_body,
    runner_config,
)
from sandlot.backends.docker._image import build_config, dockerfile
from sandlot.backends.docker._seccomp import build_profile, profile_json
from sandlot.policy import MiB, Resources, SandboxSpec
from sandlot.seccomp import (
    DENIED,
    NAMESPACE_FLAGS,
    SYSCALL_NUMBERS,
    UNREVIEWED_ERRNO,
    denied_names,
)

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SANDLOT_UPDATE_GOLDEN") == "1"

LAYOUT = ContainerLayout(
    image="sandlot/template-python-data:latest",
    protocol_dir="/host/site/sandlot/protocol",
    runner_dir="/host/site/sandlot/runner",
    etc_dir="/host/site/sandlot/backends/docker/etc",
    seccomp="<profile>",
    sandbox_id="0123456789abcdef",
    owner="host:4242",
    labels={"org.sandlot.template": "python-data"},
    uid=100007,
    gid=100007,
    accounts_dir="/run/sandlot/host-ids/container-etc/100007",
)
PODMAN_GVISOR = replace(
    LAYOUT, engine="podman", runtime="runsc", cpus=0.5, seccomp="/cache/seccomp/p.json"
)
CUSTOM_SPEC = SandboxSpec(
    template="tiny",
    resources=Resources(
        memory_mb=512, cpu_seconds=30, pids=32, disk_mb=64, tmp_mb=16, file_size_mb=8,
        open_files=128,
    ),
    envs={"API_TOKEN": "secret-value"},
)  # fmt: skip
UNLIMITED = SandboxSpec(
    resources=Resources(
        memory_mb=None, cpu_seconds=None, pids=None, disk_mb=None, tmp_mb=None,
        file_size_mb=None, open_files=None,
    )
)  # fmt: skip


def _golden(name: str, value: Any) -> None:
    path = GOLDEN / name
    text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with SANDLOT_UPDATE_GOLDEN=1"
    assert json.loads(path.read_text()) == value, f"{name} changed; review and regenerate"


@pytest.mark.parametrize(
    ("name", "spec", "layout"),
    [
        ("docker_default.json", SandboxSpec(), LAYOUT),
        ("podman_gvisor_custom.json", CUSTOM_SPEC, PODMAN_GVISOR),
        ("docker_unlimited.json", UNLIMITED, replace(LAYOUT, cpus=None)),
    ],
)
def test_create_body_matches_golden(name: str, spec: SandboxSpec, layout: ContainerLayout) -> None:
    _golden(name, build_create_body(spec, layout))


@pytest.mark.parametrize("spec", [SandboxSpec(), CUSTOM_SPEC, UNLIMITED])
@pytest.mark.parametrize("layout", [LAYOUT, PODMAN_GVISOR])
def test_every_body_keeps_the_boundary(spec: SandboxSpec, layout: ContainerLayout) -> None:
    body = build_create_body(spec, layout)
    host = body["HostConfig"]
    assert host["NetworkMode"] == "none" and body["NetworkDisabled"] is True
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and host["CapAdd"] == []
    assert host["Privileged"] is False
    assert "no-new-privileges" in host["SecurityOpt"]
    assert f"seccomp={layout.seccomp}" in host["SecurityOpt"]
    assert not any("unconfined" in opt for opt in host["SecurityOpt"])
    # The container's own host ids (never 1000, which every container used to share).
    assert body["User"] == f"{layout.uid}:{layout.gid}" == "100007:100007"
    # The only host paths are the runner's packages, sandlot's neutral /etc files and
    # the container's account files, read-only.
    assert all(m["ReadOnly"] is True and m["Type"] == "bind" for m in host["Mounts"])
    assert {m["Target"] for m in host["Mounts"]} == {
        f"{LIB_GUEST}/sandlot/protocol",
        f"{LIB_GUEST}/sandlot/runner",
        "/etc/hosts",
        "/etc/resolv.conf",
        "/etc/passwd",
        "/etc/group",
    }
    accounts = {m["Target"]: m["Source"] for m in host["Mounts"]}
    assert accounts["/etc/passwd"] == f"{layout.accounts_dir}/passwd"
    assert accounts["/etc/group"] == f"{layout.accounts_dir}/group"
    # No sysfs: an empty read-only tmpfs in its place, spelled per engine.
    if layout.engine == "podman":
        assert "mask=/sys:/run:/var" in host["SecurityOpt"]
    else:
        assert host["Tmpfs"]["/sys"].startswith("ro,")
    assert "Binds" not in host and "Devices" not in host and "VolumesFrom" not in host
    assert set(host["Tmpfs"]) - {"/sys"} == {"/tmp", "/home/user"}
    # The supervisor is pid 1 (an engine init would make it killable by user code).
    assert host["Init"] is False
    assert host["AutoRemove"] is True
    assert host["LogConfig"]["Type"] == "none"
    assert body["Labels"][LABEL] == layout.sandbox_id
    assert body["Labels"][LABEL_OWNER] == layout.owner
    # The caller's envs never reach the engine (inspect, /proc/1/environ).
    assert not any("secret-value" in entry for entry in body["Env"])
    assert "secret-value" not in json.dumps(body)
    if layout.runtime is not None:
        assert host["Runtime"] == layout.runtime


def test_limits_are_whole_sandbox_cgroup_limits() -> None:
    host = build_create_body(CUSTOM_SPEC, LAYOUT)["HostConfig"]
    assert host["Memory"] == host["MemorySwap"]  # no swap
    assert host["Memory"] >= 512 * MiB
    assert host["PidsLimit"] >= 32
    assert host["NanoCpus"] == 1_000_000_000
    assert host["ShmSize"] == 16 * MiB
    assert f"size={64 * MiB}" in host["Tmpfs"]["/home/user"]
    assert f"size={16 * MiB}" in host["Tmpfs"]["/tmp"]
    assert {"Name": "nofile", "Soft": 128, "Hard": 128} in host["Ulimits"]
    unlimited = build_create_body(UNLIMITED, replace(LAYOUT, cpus=None))["HostConfig"]
    assert not {"Memory", "PidsLimit", "NanoCpus"} & set(unlimited)


def test_tmpfs_owner_is_spelled_per_engine() -> None:
    docker = build_create_body(SandboxSpec(), LAYOUT)["HostConfig"]["Tmpfs"]["/home/user"]
    podman = build_create_body(SandboxSpec(), PODMAN_GVISOR)["HostConfig"]["Tmpfs"]["/home/user"]
    assert {"uid=100007", "gid=100007"} <= set(docker.split(",")) and "U" not in docker.split(",")
    assert "U" in podman.split(",") and "uid=" not in podman


@pytest.mark.parametrize(("uid", "gid"), [(0, 100007), (100007, 0)])
def test_a_container_never_runs_as_host_root(uid: int, gid: int) -> None:
    with pytest.raises(ValueError, match="host root"):
        build_create_body(SandboxSpec(), replace(LAYOUT, uid=uid, gid=gid))


def test_account_files_name_the_containers_own_ids_user() -> None:
    passwd = passwd_text(100007, 100008).splitlines()
    assert "user:x:100007:100008:sandlot:/home/user:/bin/sh" in passwd
    assert not any(":1000:" in line for line in passwd)
    assert "user:x:100008:" in group_text(100008).splitlines()


def test_runner_config_carries_envs_and_leaves_nproc_to_the_cgroup() -> None:
    config = runner_config(CUSTOM_SPEC)
    assert config["envs"] == {"API_TOKEN": "secret-value"}
    rlimits = config["rlimits"]
    assert isinstance(rlimits, dict)
    assert rlimits["as"] == 512 * MiB and rlimits["nproc"] is None and rlimits["core"] == 0


def test_under_gvisor_pids_is_rlimit_nproc_and_the_cgroup_bounds_the_sentry() -> None:
    # gVisor's kernel is the sandbox's own: RLIMIT_NPROC counts only its processes. The
    # host cgroup counts the Sentry's tasks (about 8 per sandbox process), a looser bound.
    rlimits = runner_config(CUSTOM_SPEC, "runsc")["rlimits"]
    assert isinstance(rlimits, dict) and rlimits["nproc"] == 32
    host = build_create_body(CUSTOM_SPEC, PODMAN_GVISOR)["HostConfig"]
    assert host["PidsLimit"] >= 8 * 32


# --- seccomp ------------------------------------------------------------------------------


def test_seccomp_profile_matches_golden() -> None:
    _golden("seccomp_profile.json", build_profile())


def test_seccomp_profile_is_the_allowlist_of_the_policy() -> None:
    profile = build_profile()
    # Whatever no rule names (calls of a newer kernel, or that the engine cannot name)
    # fails with ENOSYS: TRACE with no tracer, on every runtime.
    assert profile["defaultAction"] == "SCMP_ACT_TRACE"
    assert UNREVIEWED_ERRNO == errno.ENOSYS
    outright = [r for r in profile["syscalls"] if "args" not in r]
    allowed = {n for r in outright if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    denied = {n for r in outright if r["action"] != "SCMP_ACT_ALLOW" for n in r["names"]}
    assert denied == set(denied_names())
    conditional = {d.syscall for d in DENIED if d.when}
    reviewed = {name for table in SYSCALL_NUMBERS.values() for name in table}
    assert allowed == reviewed - denied - conditional
    for must in ("mount", "unshare", "setns", "ptrace", "bpf", "keyctl", "clone3", "mseal"):
        assert must in denied and must not in allowed
    for name in ("statmount", "listmount", "open_tree_attr"):
        assert name in denied
    assert json.loads(profile_json()) == profile


def test_seccomp_calls_of_one_architecture_are_allowed_only_there() -> None:
    rules = [
        r
        for r in build_profile()["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and "args" not in r
    ]
    by_arch = {tuple(r.get("includes", {}).get("arches", [])): set(r["names"]) for r in rules}
    assert {"arch_prctl", "open", "fork", "uretprobe"} <= by_arch[("amd64",)]
    assert "openat" in by_arch[()] and "arch_prctl" not in by_arch[()]
    assert not set(by_arch) - {(), ("amd64",), ("arm64",)}


def test_seccomp_rules_test_each_argument_once() -> None:
    # runc splits a rule with two tests of one argument into rules any may match.
    for rule in build_profile()["syscalls"]:
        indexes = [arg["index"] for arg in rule.get("args", [])]
        assert len(indexes) == len(set(indexes)), rule


def test_seccomp_calls_denied_for_some_arguments_are_allowed_for_the_others() -> None:
    rules = build_profile()["syscalls"]
    clone = [r for r in rules if r["names"] == ["clone"] and r["action"] == "SCMP_ACT_ALLOW"]
    assert [r["args"] for r in clone] == [
        [{"index": 0, "value": NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]
    ]
    socket = [r["args"] for r in rules if r["names"] == ["socket"] and "errnoRet" not in r]
    assert [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}] in socket  # AF_UNIX, any type


def test_seccomp_blocks_new_user_namespaces_through_clone() -> None:
    clone_rules = [r for r in build_profile()["syscalls"] if r["names"] == ["clone"]]
    user_ns = [
        r for r in clone_rules
        if r["args"] == [
            {"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}
        ]
    ]  # fmt: skip
    assert user_ns and user_ns[0]["action"] == "SCMP_ACT_ERRNO"


def test_enosys_denials_use_trace_so_every_runtime_returns_enosys() -> None:
    rules = build_profile()["syscalls"]
    clone3 = next(r for r in rules if "clone3" in r["names"])
    assert clone3["action"] == "SCMP_ACT_TRACE"
    assert "errnoRet" not in clone3
    eperm = next(r for r in rules if "mount" in r["names"])
    assert eperm == {**eperm, "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}


# --- template image -----------------------------------------------------------------------


def test_dockerfile_matches_golden() -> None:
    text = dockerfile("sandlot/base:bookworm", "python-data")
    path = GOLDEN / "Dockerfile.python-data"
    if UPDATE:
        path.write_text(text)
    assert path.read_text() == text


def test_build_config_lists_the_template_packages() -> None:
    config = build_config("python-data")
    assert "pandas" in config["packages"] and "ipython" in config["packages"]
    assert "font.family: sans-serif\n" in config["matplotlibrc"]
