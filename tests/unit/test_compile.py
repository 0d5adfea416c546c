"""Policy -> bubblewrap argv (``backends.bwrap._compile``): goldens and properties.

The golden files under ``golden/`` are the complete argv for two specs; any change
to the sandbox's shape shows up in review as a diff of them. After an intended
change, regenerate with ``SANDLOT_UPDATE_GOLDEN=1 pytest tests/unit/test_compile.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sandlot.backends.bwrap._compile import (
    EGRESS_PORT,
    EGRESS_SOCKET_GUEST,
    GENERATED_ETC,
    GUEST_PYTHON,
    HOME,
    LIB_GUEST,
    TEMPLATE_GUEST,
    HostLayout,
    build_argv,
    egress_env,
    guest_env,
    runner_config,
)
from sandlot.policy import MiB, NetworkPolicy, Resources, SandboxSpec

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SANDLOT_UPDATE_GOLDEN") == "1"

LAYOUT = HostLayout(
    template_dir="/host/cache/templates/python-data",
    base_prefix="/usr",
    protocol_dir="/host/site/sandlot/protocol",
    runner_dir="/host/site/sandlot/runner",
    generated_etc_dir="/host/site/sandlot/backends/bwrap/etc",
    root_symlinks={"/bin": "usr/bin", "/lib": "usr/lib", "/sbin": "usr/sbin"},
    root_dirs=("/lib64",),
    etc_entries=("/etc/ld.so.cache", "/etc/ssl/certs", "/etc/localtime"),
    channel_fd=3,
)
PYENV_LAYOUT = replace(
    LAYOUT, base_prefix="/host/.pyenv/versions/3.11.9", channel_fd=7, root_dirs=()
)

DEFAULT_SPEC = SandboxSpec()
CUSTOM_SPEC = SandboxSpec(
    template="tiny",
    resources=Resources(
        memory_mb=512,
        cpu_seconds=30,
        pids=32,
        disk_mb=64,
        tmp_mb=16,
        file_size_mb=8,
        open_files=128,
        output_bytes=1000,
        max_results=4,
        result_bytes=2 * MiB,
    ),
    envs={"API_MODE": "test", "EMPTY": "", "WITH SPACE": "a b=c"},
)
UNLIMITED_SPEC = SandboxSpec(
    resources=Resources(
        memory_mb=None,
        cpu_seconds=None,
        pids=None,
        disk_mb=None,
        tmp_mb=None,
        file_size_mb=None,
        open_files=None,
        output_bytes=None,
        max_results=None,
        result_bytes=None,
    )
)

NETWORK_SPEC = SandboxSpec(
    network=NetworkPolicy(allow_out=("pypi.org", "*.files.example:443"), deny_out=("10.0.0.0/8",))
)
NETWORK_LAYOUT = replace(LAYOUT, egress_socket="/host/tmp/sandlot-egress-x/0123.sock")

CASES: dict[str, tuple[SandboxSpec, HostLayout]] = {
    "default": (DEFAULT_SPEC, LAYOUT),
    "custom": (CUSTOM_SPEC, PYENV_LAYOUT),
    "unlimited": (UNLIMITED_SPEC, LAYOUT),
    "network": (NETWORK_SPEC, NETWORK_LAYOUT),
}

# Every bwrap option build_argv may use, with its number of arguments. An option
# not listed here fails the tests: a new one must be reviewed, not slip in.
ARITY = {
    "--unshare-user": 0,
    "--unshare-pid": 0,
    "--unshare-net": 0,
    "--unshare-ipc": 0,
    "--unshare-uts": 0,
    "--unshare-cgroup-try": 0,
    "--disable-userns": 0,
    # A checkpointable sandbox: the host's user namespace, every capability dropped.
    "--userns": 1,
    "--cap-drop": 1,
    "--seccomp": 1,
    "--as-pid-1": 0,
    "--die-with-parent": 0,
    "--new-session": 0,
    "--clearenv": 0,
    "--uid": 1,
    "--gid": 1,
    "--hostname": 1,
    "--proc": 1,
    "--dev": 1,
    "--perms": 1,
    "--size": 1,
    "--tmpfs": 1,
    "--chdir": 1,
    "--remount-ro": 1,
    "--setenv": 2,
    "--ro-bind": 2,
    "--symlink": 2,
}


def parse(argv: list[str]) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """Split a bwrap argv into its options (name, args) and the command after ``--``."""
    assert argv[0] == "bwrap"
    options: list[tuple[str, tuple[str, ...]]] = []
    i = 1
    while argv[i] != "--":
        name = argv[i]
        assert name in ARITY, f"unreviewed bwrap option {name!r}"
        n = ARITY[name]
        options.append((name, tuple(argv[i + 1 : i + 1 + n])))
        i += 1 + n
    return options, argv[i + 1 :]


def args_of(argv: list[str], name: str) -> list[tuple[str, ...]]:
    return [args for option, args in parse(argv)[0] if option == name]


def config_of(spec: SandboxSpec, layout: HostLayout) -> dict[str, Any]:
    """The runner configuration as the host sends it (JSON on the channel)."""
    config: dict[str, Any] = json.loads(json.dumps(runner_config(spec, layout.channel_fd)))
    return config


# --- goldens ------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_argv(case: str) -> None:
    spec, layout = CASES[case]
    argv = build_argv(spec, layout)
    path = GOLDEN / f"bwrap_argv_{case}.json"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(argv, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    expected = json.loads(path.read_text(encoding="utf-8"))
    assert argv == expected, f"argv changed; if intended, regenerate {path.name} (see docstring)"


def test_default_argv_spelled_out() -> None:
    """The default policy written out by hand, so a golden regenerated blindly still
    has to get past a human-readable statement of the isolation."""
    argv = build_argv(DEFAULT_SPEC, LAYOUT)
    options, command = parse(argv)
    etc = LAYOUT.generated_etc_dir
    assert options == [
        ("--unshare-user", ()),
        ("--unshare-pid", ()),
        ("--unshare-net", ()),
        ("--unshare-ipc", ()),
        ("--unshare-uts", ()),
        ("--unshare-cgroup-try", ()),
        ("--disable-userns", ()),
        ("--seccomp", ("4",)),
        ("--as-pid-1", ()),
        ("--die-with-parent", ()),
        ("--new-session", ()),
        ("--uid", ("1000",)),
        ("--gid", ("1000",)),
        ("--hostname", ("sandlot",)),
        ("--clearenv", ()),
        ("--setenv", ("PATH", f"{TEMPLATE_GUEST}/env/bin:/usr/local/bin:/usr/bin:/bin")),
        ("--setenv", ("HOME", "/home/user")),
        ("--setenv", ("LANG", "C.UTF-8")),
        ("--ro-bind", ("/usr", "/usr")),
        ("--symlink", ("usr/bin", "/bin")),
        ("--symlink", ("usr/lib", "/lib")),
        ("--symlink", ("usr/sbin", "/sbin")),
        ("--ro-bind", ("/lib64", "/lib64")),
        ("--ro-bind", ("/etc/ld.so.cache", "/etc/ld.so.cache")),
        ("--ro-bind", ("/etc/ssl/certs", "/etc/ssl/certs")),
        ("--ro-bind", ("/etc/localtime", "/etc/localtime")),
        ("--ro-bind", (f"{etc}/passwd", "/etc/passwd")),
        ("--ro-bind", (f"{etc}/group", "/etc/group")),
        ("--ro-bind", (f"{etc}/hosts", "/etc/hosts")),
        ("--ro-bind", (f"{etc}/nsswitch.conf", "/etc/nsswitch.conf")),
        ("--ro-bind", (f"{etc}/hostname", "/etc/hostname")),
        ("--ro-bind", (LAYOUT.template_dir, "/opt/sandlot/template")),
        ("--ro-bind", (LAYOUT.protocol_dir, "/opt/sandlot/lib/sandlot/protocol")),
        ("--ro-bind", (LAYOUT.runner_dir, "/opt/sandlot/lib/sandlot/runner")),
        ("--proc", ("/proc",)),
        ("--dev", ("/dev",)),
        ("--perms", ("1777",)),
        ("--size", (str(256 * MiB),)),
        ("--tmpfs", ("/tmp",)),
        ("--perms", ("1777",)),
        ("--size", (str(256 * MiB),)),
        ("--tmpfs", ("/dev/shm",)),
        ("--perms", ("0755",)),
        ("--size", (str(1024 * MiB),)),
        ("--tmpfs", ("/home/user",)),
        ("--chdir", ("/home/user",)),
        ("--remount-ro", ("/dev",)),  # bwrap's /dev tmpfs has no size cap: no writes
        ("--remount-ro", ("/",)),
    ]
    assert command[:4] == ["/opt/sandlot/template/env/bin/python", "-I", "-B", "-c"]
    assert command[5:] == ["/opt/sandlot/lib", "supervisor", "--fd", "3"]


def test_custom_bwrap_path() -> None:
    assert build_argv(DEFAULT_SPEC, LAYOUT, bwrap="/opt/bin/bwrap")[0] == "/opt/bin/bwrap"


# --- properties ---------------------------------------------------------------------

ALL = pytest.mark.parametrize("case", sorted(CASES))


@ALL
def test_every_namespace_is_unshared(case: str) -> None:
    options = {name for name, _ in parse(build_argv(*CASES[case]))[0]}
    for flag in (
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",
    ):
        assert flag in options, flag
    # Never the weaker "try" variants where a real namespace is required.
    assert "--unshare-user-try" not in build_argv(*CASES[case])
    assert "--share-net" not in build_argv(*CASES[case])


def test_a_checkpointable_sandbox_joins_the_hosts_user_namespace_and_drops_every_cap() -> None:
    argv = build_argv(DEFAULT_SPEC, replace(LAYOUT, userns_fd=9))
    options = {name for name, _ in parse(argv)[0]}
    assert argv[argv.index("--userns") + 1] == "9"
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    # One user namespace (CRIU refuses nested ones): not bwrap's own, not a second one.
    assert "--unshare-user" not in options and "--disable-userns" not in options
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"):
        assert flag in options, flag
    same = build_argv(DEFAULT_SPEC, LAYOUT)
    assert [a for a in argv if a not in ("--userns", "9", "--cap-drop", "ALL")] == [
        a for a in same if a not in ("--unshare-user", "--disable-userns")
    ]


def test_disable_userns_follows_the_layout() -> None:
    old_bwrap = replace(LAYOUT, disable_userns=False)
    assert "--disable-userns" not in build_argv(DEFAULT_SPEC, old_bwrap)


@ALL
def test_clearenv_comes_before_every_setenv(case: str) -> None:
    argv = build_argv(*CASES[case])
    names = [name for name, _ in parse(argv)[0]]
    assert names.count("--clearenv") == 1
    first_setenv = names.index("--setenv")
    assert names.index("--clearenv") < first_setenv


@ALL
def test_environment_is_exactly_guest_env(case: str) -> None:
    spec, layout = CASES[case]
    setenv = {key: value for key, value in args_of(build_argv(spec, layout), "--setenv")}
    assert setenv == guest_env(spec)
    assert set(setenv) == {"PATH", "HOME", "LANG"}


def test_caller_envs_travel_in_the_runner_config() -> None:
    config = config_of(CUSTOM_SPEC, PYENV_LAYOUT)
    assert config["envs"] == CUSTOM_SPEC.envs
    assert config_of(DEFAULT_SPEC, LAYOUT)["envs"] == {}


@pytest.mark.parametrize(
    "envs",
    [
        CUSTOM_SPEC.envs,
        {"SECRET_TOKEN": "sk-live-0123456789abcdef"},
        {"LANG": "de_DE.UTF-8"},  # overriding a default does not move it to argv either
    ],
    ids=["custom", "secret", "override"],
)
def test_caller_envs_never_appear_in_argv(envs: dict[str, str]) -> None:
    """argv is readable by every process in the sandbox (/proc/1/cmdline) and on the
    host (ps): a caller's values must not be on it, in any argument or inside one."""
    spec = SandboxSpec(envs=envs)
    for layout in (LAYOUT, PYENV_LAYOUT):
        argv = build_argv(spec, layout)
        for key, value in envs.items():
            if value:  # "" is a substring of everything
                assert not [arg for arg in argv if value in arg], (key, value)
        setenv = dict(args_of(argv, "--setenv"))
        assert setenv == guest_env(spec) == guest_env(DEFAULT_SPEC)
        assert setenv["LANG"] == "C.UTF-8"


def test_caller_envs_can_override_defaults_but_not_add_host_env() -> None:
    spec = SandboxSpec(envs={"LANG": "de_DE.UTF-8"})
    config = config_of(spec, LAYOUT)
    assert config["envs"] == {"LANG": "de_DE.UTF-8"}
    setenv = {key: value for key, value in args_of(build_argv(spec, LAYOUT), "--setenv")}
    for key in os.environ:
        if key not in ("PATH", "HOME", "LANG"):
            assert key not in setenv
            assert key not in config["envs"]


@ALL
def test_argv_carries_no_config(case: str) -> None:
    """The configuration is the first message on the channel, never a command-line
    argument; the command ends at the channel's fd."""
    spec, layout = CASES[case]
    argv = build_argv(spec, layout)
    assert "--config" not in argv
    _, command = parse(argv)
    assert command[-3:] == ["supervisor", "--fd", str(layout.channel_fd)]
    assert not [arg for arg in argv if arg.startswith("{")]


@ALL
def test_supervisor_is_pid_1(case: str) -> None:
    """--as-pid-1: no bwrap init inside; the supervisor is the pid namespace's init,
    which signals from inside the namespace cannot kill or stop."""
    options, _ = parse(build_argv(*CASES[case]))
    assert options.count(("--as-pid-1", ())) == 1
    assert ("--unshare-pid", ()) in options


@ALL
def test_no_host_path_but_the_layouts(case: str) -> None:
    spec, layout = CASES[case]
    argv = build_argv(spec, layout)
    allowed = {
        "/usr",
        layout.template_dir,
        layout.protocol_dir,
        layout.runner_dir,
        *layout.root_dirs,
        *layout.etc_entries,
        *(f"{layout.generated_etc_dir}/{name}" for name in GENERATED_ETC),
        *([layout.egress_socket] if spec.network.enabled and layout.egress_socket else []),
    }
    if not layout.base_prefix.startswith("/usr"):
        allowed.add(layout.base_prefix)
    options, _ = parse(argv)
    sources = {args[0] for name, args in options if name == "--ro-bind"}
    assert sources <= allowed, sorted(sources - allowed)
    # Nothing is bound writable or with devices.
    assert not {name for name, _ in options} & {"--bind", "--dev-bind", "--bind-try"}
    # A host path (all start with /host in these layouts) appears only as a bind
    # source, or as the target of a bind at the same path (base_prefix); never in
    # the environment, another mount, or the command and its config.
    for name, args in options:
        for index, arg in enumerate(args):
            if arg.startswith("/host/"):
                assert name == "--ro-bind", (name, args)
                assert index == 0 or args[0] == args[1], (name, args)
    _, command = parse(argv)
    assert not [arg for arg in command if "/host/" in arg]
    assert "/host/" not in json.dumps(config_of(spec, layout))


@ALL
def test_binds_are_read_only_to_their_guest_paths(case: str) -> None:
    spec, layout = CASES[case]
    binds = {dst: src for src, dst in args_of(build_argv(spec, layout), "--ro-bind")}
    assert binds[TEMPLATE_GUEST] == layout.template_dir
    assert binds[f"{LIB_GUEST}/sandlot/protocol"] == layout.protocol_dir
    assert binds[f"{LIB_GUEST}/sandlot/runner"] == layout.runner_dir
    for name in GENERATED_ETC:
        assert binds[f"/etc/{name}"] == f"{layout.generated_etc_dir}/{name}"
    for entry in layout.etc_entries:
        assert binds[entry] == entry
    for guest in ("/root", "/home", "/tmp", "/sys", "/var", "/run", "/etc", "/"):
        assert guest not in binds


@ALL
def test_tmpfs_sizes_follow_resources(case: str) -> None:
    spec, layout = CASES[case]
    options, _ = parse(build_argv(spec, layout))
    r = spec.resources
    expected = {"/home/user": r.disk_mb, "/tmp": r.tmp_mb, "/dev/shm": r.tmp_mb}
    seen = {}
    for i, (name, args) in enumerate(options):
        if name != "--tmpfs":
            continue
        # Options that modify a mount come right before it.
        modifiers = {}
        j = i - 1
        while options[j][0] in ("--size", "--perms"):
            modifiers[options[j][0]] = options[j][1][0]
            j -= 1
        seen[args[0]] = modifiers
    assert set(seen) == set(expected)
    for path, size_mb in expected.items():
        if size_mb is None:
            assert "--size" not in seen[path]
        else:
            assert seen[path]["--size"] == str(size_mb * MiB)
    assert seen["/tmp"]["--perms"] == seen["/dev/shm"]["--perms"] == "1777"
    assert seen[HOME]["--perms"] == "0755"


@pytest.mark.parametrize(
    ("base_prefix", "bound"),
    [
        ("/usr", False),
        ("/usr/local", False),
        ("/usr/lib/python3.11", False),
        ("/usrlocal", True),  # a sibling of /usr, not inside it
        ("/opt/python/3.11", True),
        ("/host/.pyenv/versions/3.11.9", True),
    ],
)
def test_base_prefix_bound_only_outside_usr(base_prefix: str, bound: bool) -> None:
    argv = build_argv(DEFAULT_SPEC, replace(LAYOUT, base_prefix=base_prefix))
    binds = args_of(argv, "--ro-bind")
    always = 1 if base_prefix == "/usr" else 0  # /usr itself is always bound
    assert binds.count((base_prefix, base_prefix)) == always + bound
    if not always:
        assert (base_prefix in argv) is bound


@ALL
def test_root_is_remounted_read_only_last(case: str) -> None:
    options, _ = parse(build_argv(*CASES[case]))
    assert options[-1] == ("--remount-ro", ("/",))


@ALL
def test_runs_as_unprivileged_user(case: str) -> None:
    argv = build_argv(*CASES[case])
    assert args_of(argv, "--uid") == [("1000",)]
    assert args_of(argv, "--gid") == [("1000",)]
    assert args_of(argv, "--chdir") == [(HOME,)]


@ALL
def test_command_starts_the_supervisor_isolated(case: str) -> None:
    spec, layout = CASES[case]
    _, command = parse(build_argv(spec, layout))
    assert command[0] == GUEST_PYTHON
    assert "-I" in command[1:4]
    assert command[command.index("--fd") + 1] == str(layout.channel_fd)
    # The fd on the command line is the one the configuration names.
    assert config_of(spec, layout)["fd"] == layout.channel_fd


@ALL
def test_runner_config_matches_resources(case: str) -> None:
    spec, layout = CASES[case]
    config = config_of(spec, layout)
    r = spec.resources
    mib = lambda v: None if v is None else v * MiB  # noqa: E731
    assert config["rlimits"] == {
        "as": mib(r.memory_mb),
        "cpu": r.cpu_seconds,
        # cgroup pids.max is the per-sandbox limit; NPROC would count every sandbox
        # sharing the host uid.
        "nproc": None,
        "fsize": mib(r.file_size_mb),
        "nofile": r.open_files,
        "core": 0,
    }
    assert config["memory_mb"] == r.memory_mb
    assert config["output_bytes"] == r.output_bytes
    assert config["max_results"] == r.max_results
    assert config["result_bytes"] == r.result_bytes
    assert config["fd"] == layout.channel_fd
    assert config["workdir"] == HOME
    assert config["lib"] == LIB_GUEST
    assert config["envs"] == {**egress_env(spec), **spec.envs}


def test_best_effort_mode_keeps_nproc_as_the_only_process_limit() -> None:
    config = runner_config(CUSTOM_SPEC, 3, cgroup_limits=False)
    assert config["rlimits"]["nproc"] == CUSTOM_SPEC.resources.pids


def test_custom_rlimits_in_bytes() -> None:
    config = config_of(CUSTOM_SPEC, PYENV_LAYOUT)
    assert config["rlimits"]["as"] == 512 * 1024 * 1024
    assert config["rlimits"]["fsize"] == 8 * 1024 * 1024
    assert config["rlimits"]["core"] == 0


def test_build_argv_is_pure() -> None:
    assert build_argv(CUSTOM_SPEC, PYENV_LAYOUT) == build_argv(CUSTOM_SPEC, PYENV_LAYOUT)


def test_preload_travels_in_the_runner_config() -> None:
    spec = SandboxSpec(preload=("numpy", "matplotlib.pyplot"))
    assert runner_config(spec, 3)["preload"] == ["numpy", "matplotlib.pyplot"]
    assert runner_config(SandboxSpec(), 3)["preload"] == []


# --- network policy -----------------------------------------------------------------


def test_network_policy_adds_only_its_own_socket() -> None:
    """With a network policy the sandbox keeps its own network namespace (loopback
    only); the one addition is a read-only bind of its socket to the host's proxy."""
    plain = parse(build_argv(DEFAULT_SPEC, NETWORK_LAYOUT))[0]
    with_network = parse(build_argv(NETWORK_SPEC, NETWORK_LAYOUT))[0]
    added = [option for option in with_network if option not in plain]
    assert added == [("--ro-bind", (NETWORK_LAYOUT.egress_socket, EGRESS_SOCKET_GUEST))]
    assert ("--unshare-net", ()) in with_network
    # Without a policy, a layout's socket is never mounted.
    assert NETWORK_LAYOUT.egress_socket not in build_argv(DEFAULT_SPEC, NETWORK_LAYOUT)


def test_network_policy_needs_its_socket() -> None:
    with pytest.raises(ValueError, match="egress socket"):
        build_argv(NETWORK_SPEC, LAYOUT)


def test_network_policy_configures_the_forwarder_and_proxy_variables() -> None:
    config = config_of(NETWORK_SPEC, NETWORK_LAYOUT)
    assert config["egress"] == {"socket": EGRESS_SOCKET_GUEST, "port": EGRESS_PORT}
    proxy = f"http://127.0.0.1:{EGRESS_PORT}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "PIP_PROXY", "http_proxy"):
        assert config["envs"][name] == proxy
    assert config["envs"]["NO_PROXY"] == "localhost,127.0.0.1,::1"
    assert config["envs"] == egress_env(NETWORK_SPEC)
    # No policy: no forwarder, no proxy variables.
    assert "egress" not in config_of(DEFAULT_SPEC, LAYOUT)
    assert egress_env(DEFAULT_SPEC) == {}


def test_caller_envs_win_over_proxy_variables() -> None:
    spec = replace(NETWORK_SPEC, envs={"HTTPS_PROXY": "http://mine:1"})
    assert config_of(spec, NETWORK_LAYOUT)["envs"]["HTTPS_PROXY"] == "http://mine:1"
