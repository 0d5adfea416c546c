"""When isolation is unavailable, sandlot refuses to run: it never falls back.

Both cases are real: a missing bwrap binary, and a host where user namespaces are
refused (the test runs sandlot inside an outer bubblewrap sandbox started with
--disable-userns, so the kernel itself denies the namespaces sandlot asks for).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import json, sys
    import sandlot
    from sandlot.backends.bwrap import BwrapBackend
    outcome = {}
    try:
        sandlot.Sandbox(timeout=None).kill()
        outcome["ran"] = True
    except sandlot.BackendUnavailable as exc:
        outcome["error"] = type(exc).__name__
        outcome["message"] = str(exc)
    outcome["probe"] = BwrapBackend.probe().available
    print(json.dumps(outcome))
    """
)


# No container engine either: "auto" would rightly pick one (it is a sandbox too).
NO_ENGINES = {
    "DOCKER_HOST": "unix:///nonexistent.sock",
    "SANDLOT_PODMAN_HOST": "unix:///nonexistent.sock",
}


def _run_child(argv_prefix: list[str], env: dict[str, str]) -> dict[str, object]:
    env = {**env, **NO_ENGINES}
    result = subprocess.run(
        [*argv_prefix, sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_missing_bwrap_refuses_with_fix() -> None:
    env = {**os.environ, "SANDLOT_BWRAP": "/nonexistent/bwrap"}
    outcome = _run_child([], env)
    assert "ran" not in outcome
    assert outcome["error"] == "BackendUnavailable"
    message = str(outcome["message"])
    assert "not installed" in message
    assert "apt-get install bubblewrap" in message
    assert "never runs code unsandboxed" in message
    assert outcome["probe"] is False


@pytest.mark.requires_bwrap
def test_refused_user_namespaces_refuse_with_fix() -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    # An outer sandbox that sees the whole host read-only but may not create user
    # namespaces: exactly what a locked-down host (or a default container) looks like.
    outer = [
        bwrap,
        "--unshare-user",
        "--disable-userns",
        # Not root inside: only one uid is mapped, so root's switch to the sandbox uid
        # could not happen anyway; the namespaces are what this test is about.
        "--uid",
        "1000",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        # No --tmpfs /tmp: the checkout (and its .venv) may itself live under /tmp.
        "--",
    ]
    outcome = _run_child(outer, dict(os.environ))
    assert "ran" not in outcome
    assert outcome["error"] == "BackendUnavailable"
    message = str(outcome["message"])
    assert "cannot create namespaces" in message
    assert "user namespaces" in message  # the fix names the knob to turn
    assert outcome["probe"] is False


@pytest.mark.requires_bwrap
@pytest.mark.requires_template
def test_a_limit_that_cannot_be_applied_refuses_to_run() -> None:
    import resource

    import sandlot

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.fail("this host has no hard RLIMIT_NOFILE; the test needs one to exceed")
    with pytest.raises(sandlot.IsolationUnavailable) as caught:
        sandlot.Sandbox(resources={"open_files": hard + 1}, timeout=None)
    message = str(caught.value)
    assert "nofile" in message and "hard limit" in message
    assert "ulimit -H" in message  # says how to fix the host


def test_the_runner_says_why_it_refuses_on_its_channel() -> None:
    # The real supervisor, in a plain process (it exits before it would start anything
    # that needs a sandbox): a limit above its hard limit is reported as a typed
    # "fatal" message on the host channel, not only as a line on stderr.
    import resource
    import socket
    from pathlib import Path

    import sandlot
    from sandlot.protocol import RUNNER_MESSAGES, decode, encode
    from sandlot.runner import BOOTSTRAP

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.fail("this host has no hard RLIMIT_NOFILE; the test needs one to exceed")
    lib = str(Path(sandlot.__file__).resolve().parents[1])
    host, theirs = socket.socketpair()
    with host:
        runner = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-c",
                BOOTSTRAP,
                lib,
                "supervisor",
                "--fd",
                str(theirs.fileno()),
            ],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        theirs.close()
        config = {"rlimits": {"nofile": hard + 1}}
        host.sendall(encode({"type": "configure", "id": "configure", "config": config}))
        host.settimeout(60)
        line = host.makefile("rb").readline()
        _, stderr = runner.communicate(timeout=60)
    assert runner.returncode == 70
    message = decode(line, RUNNER_MESSAGES)
    assert message["type"] == "fatal" and message["reason"] == "limits", message
    assert "nofile" in message["message"] and "hard limit" in message["message"]
    assert b"cannot apply resource limits" in stderr  # still told to a human reading stderr


@pytest.mark.requires_bwrap
@pytest.mark.requires_template
def test_a_zygote_sandbox_that_cannot_apply_a_limit_refuses_too() -> None:
    # A zygote-made sandbox has no stderr the host reads: the typed message is the only
    # way its runner can say why it refuses (before it, this was a SandboxStartError).
    import resource

    import sandlot

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.fail("this host has no hard RLIMIT_NOFILE; the test needs one to exceed")
    with pytest.raises(sandlot.IsolationUnavailable) as caught:
        sandlot.Sandbox(backend="zygote", resources={"open_files": hard + 1}, timeout=None)
    message = str(caught.value)
    assert "nofile" in message and "hard limit" in message
    assert "ulimit -H" in message


ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="host uids per sandbox are what sandlot does as root"
)


@ROOT_ONLY
@pytest.mark.requires_bwrap
@pytest.mark.requires_template
@pytest.mark.parametrize("backend", ["bwrap", "zygote"])
@pytest.mark.parametrize(
    "env",
    [
        {"SANDLOT_HOST_UID": "65534"},  # the old single shared uid
        {"SANDLOT_HOST_IDS": "0-65535"},  # would include root
    ],
    ids=["shared-uid", "range-with-root"],
)
def test_no_usable_host_id_range_refuses_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, backend: str, env: dict[str, str]
) -> None:
    import sandlot
    from sandlot.backends.bwrap import _zygote

    # A zygote that is already up keeps the host ids it took; the range is read when a
    # sandbox or a zygote starts, so this needs the zygote to start under the bad range.
    _zygote.close_all()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(sandlot.IsolationUnavailable, match="usermod --add-subuids"):
        sandlot.Sandbox(backend=backend, timeout=None)


@ROOT_ONLY
@pytest.mark.requires_bwrap
@pytest.mark.requires_template
def test_a_full_host_id_range_refuses_until_a_sandbox_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sandlot
    from sandlot.backends._hostids import HostIdsExhausted

    # Two ids no account uses, and a lock directory of this test's own. Cold sandboxes,
    # one id each (a zygote, which "auto" would start in the background, takes one too).
    monkeypatch.setenv("SANDLOT_HOST_IDS", "2000000000-2000000001")
    monkeypatch.setenv("SANDLOT_HOST_IDS_DIR", str(tmp_path))
    started: list[sandlot.Sandbox] = []  # killed whatever fails: they hold the ids
    try:
        first = sandlot.Sandbox(backend="bwrap", timeout=None)
        started.append(first)
        started.append(sandlot.Sandbox(backend="bwrap", timeout=None))
        with pytest.raises(HostIdsExhausted, match="all 2 host uids"):
            sandlot.Sandbox(backend="bwrap", timeout=None)
        first.kill()
        started.append(sandlot.Sandbox(backend="bwrap", timeout=None))
        assert started[-1].run_code("import os; os.getuid()").text == "1000"
    finally:
        for sbx in started:
            sbx.kill()
