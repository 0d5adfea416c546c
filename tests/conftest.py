"""Shared test setup: host prerequisites and sandbox fixtures.

Tests marked ``requires_bwrap`` need a working bubblewrap backend; tests marked
``requires_template`` need the ``python-data`` template built; ``requires_server``
tests need the ``server`` and ``dev`` extras (FastAPI, the E2B client...). Each prerequisite is
checked once per session (cached). When one is missing the test is skipped with
the reason, unless ``$SANDLOT_REQUIRE`` names it ("bwrap", "template", "docker",
"runsc", "podman", "microvm", "server", "postgres", "browser", "ray", "criu"; CI sets
it): then
the test fails, so a broken CI host cannot pass by skipping everything.

The checks run in ``pytest_runtest_setup`` (before any fixture), so a module- or
session-scoped sandbox fixture is never started on a host that cannot run it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandlot import Sandbox

TEMPLATE = "python-data"
FIXTURE_TIMEOUT = 900
"""Seconds a fixture sandbox may live (the SDK default of 300 s could end a long module)."""


@functools.cache
def _probe_problem(name: str) -> str | None:
    """Why the declared backend ``name`` cannot run here, or None if it can (probed once)."""
    from sandlot.backends import load_backend

    probe = load_backend(name).probe()
    if probe.available:
        return None
    return probe.reason or f"{name} backend unavailable (the probe gave no reason)"


def _bwrap_problem() -> str | None:
    """Why the bwrap backend cannot run here, or None if it can (probed once)."""
    return _probe_problem("bwrap")


@functools.cache
def _template_problem() -> str | None:
    """Why the python-data template cannot be used, or None if it is built."""
    from sandlot.templates import find_template

    if find_template(TEMPLATE) is None:
        return f"template {TEMPLATE!r} is not built (run: sandlot template build {TEMPLATE})"
    return None


@functools.cache
def _microvm_problem() -> str | None:
    """Why the microvm backend cannot run here (QEMU, kernel, image: scripts/setup-vm.sh)."""
    from sandlot.backends.microvm import MicroVMBackend

    probe = MicroVMBackend.probe()
    return None if probe.available else f"{probe.reason} (fix: {probe.fix})"


def _container_problem(backend: str) -> str | None:
    """Why a container backend ("docker", "docker-runsc", "podman") cannot run here."""
    from sandlot.backends import load_backend
    from sandlot.backends.docker import container_backend_problem

    made = _make_backend(backend)
    return container_backend_problem(load_backend(made)() if isinstance(made, str) else made)


def _make_backend(name: str) -> Any:
    """A backend for a fixture parameter: a declared backend's registry name (the SDK
    resolves it as it does a user's ``Sandbox(backend=NAME)``), "docker-runsc"
    (Docker with gVisor's runtime), or "restored" / "forked" (test-only backends whose
    sandboxes come back from a CRIU checkpoint: tests/_restored.py)."""
    from sandlot.backends import load_backend

    if name in ("restored", "forked"):
        from _restored import BACKENDS

        return BACKENDS[name]()
    if name == "docker-runsc":
        docker: Any = load_backend("docker")
        return docker(runtime="runsc")
    return name


@functools.cache
def _server_problem() -> str | None:
    """Why the server and its test clients cannot run, or None (the server/dev extras)."""
    import importlib

    for module in (
        "fastapi",
        "uvicorn",
        "httpx",
        "sqlalchemy",
        "prometheus_client",
        "python_multipart",
        "e2b_code_interpreter",
        "schemathesis",
    ):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} is not installed (pip install -e '.[dev]'): {exc}"
    return None


@functools.cache
def _postgres_problem() -> str | None:
    """Why a throwaway PostgreSQL cannot be started here, or None."""
    import glob
    import importlib.util

    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        return "PostgreSQL's server binaries are missing (apt-get install postgresql)"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install -e '.[dev]')"
    return None


@functools.cache
def _browser_problem() -> str | None:
    """Why the web app's browser tests cannot run, or None (Debian's chromium and
    chromium-driver, and selenium from the dev extra)."""
    import importlib.util

    for path in ("/usr/bin/chromium", "/usr/bin/chromedriver"):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


def _ray_problem() -> str | None:
    """Why a local multi-node Ray cluster cannot be started here, or None (the ray extra)."""
    import importlib.util
    import shutil
    import sys
    from pathlib import Path

    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install -e '.[dev]' or '.[ray]')"
    ray_cli = Path(sys.executable).with_name("ray")
    if not ray_cli.exists() and shutil.which("ray") is None:
        return f"the ray command is missing next to {sys.executable}"
    return None


@functools.cache
def _criu_problem() -> str | None:
    """Why sandboxes cannot be checkpointed here, or None (root and CRIU 4.x)."""
    from sandlot.backends import _checkpoint

    if os.geteuid() != 0:
        return "checkpointing a sandbox needs root (CRIU)"
    found = _checkpoint.finding()
    if found.status != "ok":
        return f"{found.detail} ({found.fix})"
    return None


_PREREQUISITES: tuple[tuple[str, str, Callable[[], str | None]], ...] = (
    # (marker, word in $SANDLOT_REQUIRE that turns a skip into a failure, check)
    ("requires_bwrap", "bwrap", _bwrap_problem),
    ("requires_template", "template", _template_problem),
    ("requires_docker", "docker", lambda: _container_problem("docker")),
    ("requires_runsc", "runsc", lambda: _container_problem("docker-runsc")),
    ("requires_podman", "podman", lambda: _container_problem("podman")),
    ("requires_microvm", "microvm", _microvm_problem),
    ("requires_server", "server", _server_problem),
    ("requires_postgres", "postgres", _postgres_problem),
    ("requires_browser", "browser", _browser_problem),
    ("requires_ray", "ray", _ray_problem),
    ("requires_criu", "criu", _criu_problem),
)

_RESTORED_MARKS = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_criu,
]
BACKEND_MARKS: dict[str, Any] = {
    "bwrap": pytest.mark.requires_bwrap,
    # bwrap sandboxes forked from a zygote that has the data stack imported.
    "zygote": pytest.mark.requires_bwrap,
    # Sandboxes handed out by a warm pool (refilled from the zygote).
    "pool": pytest.mark.requires_bwrap,
    "docker": pytest.mark.requires_docker,
    "docker-runsc": pytest.mark.requires_runsc,
    "podman": pytest.mark.requires_podman,
    # A QEMU VM per sandbox, restored from a snapshot: all_backends suites run it only
    # when $SANDLOT_BACKENDS names it (OPT_IN_BACKENDS), and under TCG leave out what
    # costs seconds of emulated CPU (MICROVM_LEFT_OUT).
    "microvm": pytest.mark.requires_microvm,
    # The SDK's remote mode: the same suite through a real ``sandlot serve`` subprocess
    # (which runs bwrap sandboxes). ``@pytest.mark.local_only`` tests skip it.
    "remote": pytest.mark.requires_server,
    # bwrap sandboxes that were checkpointed and restored with CRIU (tests/_restored.py):
    # the restored copy, or one of two copies restored from one checkpoint (a fork).
    # Opt-in (OPT_IN_BACKENDS); CI runs the escape suite against them in a pass of its own.
    "restored": _RESTORED_MARKS,
    "forked": _RESTORED_MARKS,
}
"""Backends the ``all_backends`` suites run against, with the prerequisite each needs;
every other backend the registry declares (an installed plug-in) joins them, run where
its probe passes. ``$SANDLOT_BACKENDS`` (comma separated) narrows them, e.g.
``SANDLOT_BACKENDS=bwrap`` while iterating."""


OPT_IN_BACKENDS = frozenset({"microvm", "restored", "forked"})
"""Backends the ``all_backends`` suites run against only when ``$SANDLOT_BACKENDS`` names
them (their own test modules run them regardless). CI runs the suites against microvm,
and the escape suite against restored and forked, in passes of their own
(scripts/test.sh)."""

_BWRAP_LAYER = (
    "asserts a layer of the bwrap sandbox (its seccomp filter or its mount layout); in a VM "
    "the call or path reaches the guest's own kernel and root image, and the VM's own "
    "escapes are tried in tests/microvm"
)
_TIME = "time: seconds of emulated CPU per test under TCG"
MICROVM_LEFT_OUT: dict[str, str] = {
    "test_seccomp_abi.py": _BWRAP_LAYER,
    "test_privilege.py::test_syscall_is_refused": _BWRAP_LAYER,
    "test_privilege.py::test_cannot_create_namespaces_or_mount": _BWRAP_LAYER,
    "test_privilege.py::test_setuid_binaries_grant_nothing": (
        "the guest image has no setuid binary left to try (the image build clears them)"
    ),
    "test_filesystem.py::test_host_directories_are_not_visible": _BWRAP_LAYER,
    "test_filesystem.py::test_cannot_reach_the_host_through_proc_self_or_kernel_interfaces": (
        _BWRAP_LAYER
    ),
    "test_network.py::test_only_loopback_and_no_name_resolution": _BWRAP_LAYER,
    "test_network.py::test_raw_packet_and_netlink_sockets_are_refused": _BWRAP_LAYER,
    "test_resources.py": _TIME + " (bombs and floods)",
    "test_behaviour.py::test_command_timeout_kills_it_and_its_children": (
        "a 1 s command timeout: under TCG the command's wrapper (a Python start in the "
        "guest) takes most of that second before the command runs"
    ),
    "test_behaviour.py::test_memory_bomb_is_out_of_memory_and_sandbox_survives": _TIME,
    "test_behaviour.py::test_fifty_megabyte_binary_round_trip": _TIME,
    "test_behaviour.py::test_a_system_call_out_of_memory_is_out_of_memory_and_variables_stay": (
        _TIME
    ),
    "test_commands.py": _TIME + " (a command starts a Python wrapper in the guest)",
    "test_watch.py": _TIME,
    "test_ipython.py": _TIME,
    "test_bash_contexts.py": _TIME,
}
"""``module::test`` (or a whole ``module``) of the ``all_backends`` suites not run against
microvm, with the reason (docs/microvm.md lists them): under TCG every instruction is
emulated, so tests that spend seconds of CPU would put CI's added time over its budget.
``$SANDLOT_MICROVM_ALL=1`` runs them anyway."""


def _left_out_of_microvm(definition: Any) -> str | None:
    if os.environ.get("SANDLOT_MICROVM_ALL") == "1":
        return None
    module = os.path.basename(str(definition.path))
    name = definition.name.split("[", 1)[0]
    return MICROVM_LEFT_OUT.get(f"{module}::{name}") or MICROVM_LEFT_OUT.get(module)


def _backend_marks() -> dict[str, Any]:
    from sandlot.backends import backend_names

    marks = dict(BACKEND_MARKS)
    for name in backend_names():
        if name not in marks:
            problem = _probe_problem(name)
            marks[name] = pytest.mark.skipif(problem is not None, reason=str(problem))
    return marks


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Modules marked ``all_backends`` run every sandbox fixture once per backend.
    if "sandlot_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("all_backends") is None:
        return
    marks = _backend_marks()
    wanted = os.environ.get("SANDLOT_BACKENDS", "").split(",")
    names = (
        [n for n in marks if n in wanted]
        if any(wanted)
        else [n for n in marks if n not in OPT_IN_BACKENDS]
    )
    if metafunc.definition.get_closest_marker("local_only") is not None:
        names = [n for n in names if n != "remote"]
    left_out = _left_out_of_microvm(metafunc.definition)
    params = [
        pytest.param(
            n,
            marks=[marks[n], pytest.mark.skip(reason=f"not run on microvm: {left_out}")]
            if n == "microvm" and left_out
            else marks[n],
            id=n,
        )
        for n in names
    ]
    metafunc.parametrize("sandlot_backend", params, indirect=True, scope="module")


@pytest.fixture(scope="module")
def sandlot_backend(request: pytest.FixtureRequest) -> Any:
    """The backend sandbox fixtures use: "bwrap" unless the module is ``all_backends``."""
    name = getattr(request, "param", "bwrap")
    if name == "remote":
        return request.getfixturevalue("sandlot_server")
    if name == "pool":
        return request.getfixturevalue("sandlot_pool")
    return _make_backend(name)


@pytest.fixture(scope="module")
def sandlot_pool() -> Iterator[Any]:
    """A warm pool refilled from the zygote; sandbox fixtures take theirs from it."""
    from sandlot import Pool

    with Pool(size=2, backend="zygote") as pool:
        pool.warm(TEMPLATE)
        yield pool


@pytest.fixture(scope="module")
def sandlot_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real ``sandlot serve`` on loopback with one tenant; ``.url`` and ``.api_key``.

    Module-scoped: the server is a child of the test process, and later modules may
    check that the test process has no children left."""
    from _server_harness import ServerProcess

    server = ServerProcess(
        tmp_path_factory.mktemp("sandlot-server"),
        "--max-sandboxes",
        "200",
        "--creates-per-minute",
        "100000",
        "--max-memory-mb",
        "10000000",
    ).start()
    server.api_key = server.key("behaviour")  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    required = os.environ.get("SANDLOT_REQUIRE", "")
    for marker, word, check in _PREREQUISITES:
        if item.get_closest_marker(marker) is None:
            continue
        problem = check()
        if problem is None:
            continue
        if word in required:
            pytest.fail(f"SANDLOT_REQUIRE={required!r} but {problem}", pytrace=False)
        pytest.skip(problem)


def _start(backend: Any = "bwrap", **kwargs: Any) -> Sandbox:
    kwargs.setdefault("timeout", FIXTURE_TIMEOUT)
    if hasattr(backend, "api_key"):  # the sandlot_server fixture: remote mode
        return Sandbox(TEMPLATE, api_url=backend.url, api_key=backend.api_key, **kwargs)
    if hasattr(backend, "acquire"):  # the sandlot_pool fixture
        return Sandbox(TEMPLATE, backend=backend._backend, pool=backend, **kwargs)
    return Sandbox(TEMPLATE, backend=backend, **kwargs)


@pytest.fixture(scope="module")
def sandbox(sandlot_backend: Any) -> Iterator[Sandbox]:
    """A sandbox shared by a module's tests: only for tests that leave it usable and
    do not depend on state other tests might leave (use unique names)."""
    sbx = _start(sandlot_backend)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def fresh_sandbox(sandlot_backend: Any) -> Iterator[Sandbox]:
    """A sandbox of the test's own, for tests that kill, restart or inspect it whole."""
    sbx = _start(sandlot_backend)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def make_sandbox(sandlot_backend: Any) -> Iterator[Callable[..., Sandbox]]:
    """Factory for sandboxes with custom arguments; all are killed after the test."""
    started: list[Sandbox] = []

    def make(**kwargs: Any) -> Sandbox:
        sbx = _start(sandlot_backend, **kwargs)
        started.append(sbx)
        return sbx

    try:
        yield make
    finally:
        for sbx in started:
            sbx.kill()


# --- code run inside sandboxes ---------------------------------------------------------

DAEMON_PROGRAM = """
import os, signal, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
open("/tmp/%s.ready" % sys.argv[1], "w").close()
while True:
    time.sleep(1)
"""
"""A well-behaved daemon (double fork, setsid, stdio closed) that ignores SIGTERM and
SIGHUP. Started as ``python -c DAEMON_PROGRAM <marker>``, so ``<marker>`` is in its argv
(``/proc/PID/cmdline``) for its whole life; it creates ``/tmp/<marker>.ready`` once it
is the daemon (the two processes before it also carry the marker, briefly)."""


@pytest.fixture
def daemon_cell() -> Callable[[str], str]:
    """``daemon_cell(marker)`` -> cell code that leaves a daemon with ``marker`` in its
    argv running (its parent exits at once; the daemon is re-parented in the sandbox)."""

    def code(marker: str) -> str:
        return (
            "import os, subprocess, sys, time\n"
            f"subprocess.run([sys.executable, '-c', {DAEMON_PROGRAM!r}, {marker!r}], check=True)\n"
            "for _ in range(200):\n"
            f"    if os.path.exists('/tmp/{marker}.ready'):\n"
            "        break\n"
            "    time.sleep(0.05)\n"
            "else:\n"
            "    raise RuntimeError('the daemon did not start')\n"
        )

    return code


PROCESS_LIST_CELL = """
import json, os
def _sandlot_processes():
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                stat = handle.read()
            with open("/proc/%s/cmdline" % name, "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue  # exited while we looked
        fields = stat[stat.rfind(b")") + 2:].split()
        found.append({
            "pid": int(name),
            "ppid": int(fields[1]),
            "state": fields[0].decode(),
            "comm": stat[stat.find(b"(") + 1:stat.rfind(b")")].decode("utf-8", "replace"),
            "cmdline": cmdline.replace(b"\\0", b" ").decode("utf-8", "replace").strip(),
        })
    return found
print(json.dumps({"self": os.getpid(), "processes": _sandlot_processes()}))
"""
"""Cell code printing every process the sandbox can see as one JSON document."""


@pytest.fixture
def list_processes() -> Callable[[Sandbox], tuple[int, list[dict[str, Any]]]]:
    """``list_processes(sbx)`` -> (pid of the listing kernel, every process in ``sbx``)."""

    def run(sbx: Sandbox) -> tuple[int, list[dict[str, Any]]]:
        execution = sbx.run_code(PROCESS_LIST_CELL, timeout=30)
        assert execution.error is None, execution.error
        document = json.loads("".join(execution.logs.stdout))
        return document["self"], document["processes"]

    return run
