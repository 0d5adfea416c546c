"""Behaviours E2B's own test suites check, with the unmodified E2B clients in normal mode.

Each test here stands for tests of code-interpreter's ``python/tests`` that failed
against ``sandlot serve`` (docs/e2b.md lists the suites' runs): what a result's text
and data read as, IPython's raw ``display``, and what ``run_code`` raises when the
sandbox is killed under a running cell.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]


@pytest.fixture(scope="module")
def opts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    server = ServerProcess(tmp_path_factory.mktemp("e2b-parity")).start()
    try:
        yield server.e2b_opts(server.key("parity"))
    finally:
        server.stop()


def test_results_read_as_e2bs_code_interpreter_gives_them(opts: dict[str, Any]) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120, envs={"ON_SANDBOX": "supertest"}, **opts)
    try:
        # A string's repr loses its enclosing quotes (env_vars/test_python.py).
        assert sbx.run_code("import os; os.getenv('ON_SANDBOX')").text == "supertest"
        assert sbx.run_code("os.getenv('FOO')", envs={"FOO": "bar"}).text == "bar"
        assert sbx.run_code('"double"').text == "double"
        assert sbx.run_code("42").text == "42"
        assert sbx.run_code("[1, 'a']").text == "[1, 'a']"

        # A DataFrame's data is one list per column (test_data.py).
        frame = sbx.run_code(
            "import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})"
        )
        assert frame.error is None, frame.error
        assert frame.results[0].data == {"a": [1, 2, 3], "b": ["x", "y", "z"]}

        # IPython's display(bundle, raw=True) sends the bundle as it is
        # (test_custom_repr_object.py).
        raw = sbx.run_code(
            "from IPython.display import display\n"
            "display({'text/latex': r'\\text{CustomReprObject}'}, raw=True)"
        )
        assert raw.error is None, raw.error
        assert [r.formats() for r in raw.results] == [["latex"]]
        assert raw.results[0].latex == r"\text{CustomReprObject}"
    finally:
        sbx.kill()


def test_run_code_raises_when_the_sandbox_is_killed_during_the_cell(
    opts: dict[str, Any],
) -> None:
    from e2b import TimeoutException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120, **opts)
    killer = Sandbox.connect(sbx.sandbox_id, **opts)
    killed: list[threading.Thread] = []

    def kill_once_running(_: object) -> None:
        # The cell has started (it printed): kill its sandbox from another client.
        if not killed:
            thread = threading.Thread(target=killer.kill)
            thread.start()
            killed.append(thread)

    try:
        with pytest.raises(TimeoutException, match="sandbox was killed while the request"):
            sbx.run_code(
                "import time\nprint('running', flush=True)\ntime.sleep(300)",
                timeout=300,
                on_stdout=kill_once_running,
            )
    finally:
        for thread in killed:
            thread.join()
        sbx.kill()
    assert killed and not sbx.is_running()


def test_list_started_after_and_metrics_in_a_time_range(opts: dict[str, Any]) -> None:
    import datetime

    from e2b import Sandbox, SandboxQuery

    tag = uuid.uuid4().hex
    sbx = Sandbox.create(timeout=60, metadata={"parity": tag}, **opts)
    try:
        started = sbx.get_info().started_at

        def listed(after: datetime.datetime) -> list[str]:
            query = SandboxQuery(metadata={"parity": tag}, started_after=after)
            return [s.sandbox_id for s in Sandbox.list(query=query, **opts).next_items()]

        assert listed(started) == [sbx.sandbox_id]
        assert listed(started + datetime.timedelta(seconds=1)) == []

        now = datetime.datetime.now(datetime.UTC)
        [sample] = sbx.get_metrics(start=started, end=now + datetime.timedelta(seconds=5))
        assert sample.mem_used > 0
        # A range that ended before the sandbox existed has no samples.
        before = started - datetime.timedelta(hours=1)
        assert sbx.get_metrics(start=before, end=before + datetime.timedelta(minutes=30)) == []
    finally:
        sbx.kill()


def test_files_and_commands_answer_as_envd(opts: dict[str, Any]) -> None:
    from e2b import Sandbox, TimeoutException

    sbx = Sandbox.create(timeout=60, **opts)
    try:
        # Removing what is not there is no error (files/test_remove.py).
        sbx.files.remove("never-written.txt")
        # A link's target is its absolute path (files/test_info.py).
        sbx.files.write("linked/target.txt", "x")
        sbx.commands.run("ln -s target.txt link.txt", cwd="/home/user/linked")
        assert sbx.files.get_info("linked/link.txt").symlink_target == (
            "/home/user/linked/target.txt"
        )
        # A command past its timeout is the SDK's TimeoutException, not an exit code
        # (commands/test_run.py).
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 10", timeout=1)
        # A command whose sandbox is killed under it (test_sandbox_killed_during_run.py).
        handle = sbx.commands.run("sleep 60", background=True)
        sbx.kill()
        with pytest.raises(TimeoutException, match="killed or reached its end of life"):
            handle.wait()
    finally:
        sbx.kill()


def test_a_sandbox_past_its_timeout_is_not_running_at_once(opts: dict[str, Any]) -> None:
    import time

    from e2b import Sandbox

    sbx = Sandbox.create(timeout=60, **opts)
    try:
        sbx.set_timeout(1)
        # Just past the timeout, before the server's reaper (every second) has come by:
        # E2B answers "not running" from then on (test_timeout.py).
        time.sleep(1.1)
        assert sbx.is_running() is False
    finally:
        sbx.kill()


def test_signed_file_urls(opts: dict[str, Any]) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=60, secure=True, **opts)
    other = Sandbox.create(timeout=60, secure=True, **opts)
    try:
        sbx.files.write("signed.txt", "for the link")
        other.files.write("signed.txt", "the other sandbox's")
        # A plain GET, no headers: the signature alone names the sandbox and the file
        # (files/test_secured.py).
        for url in (sbx.download_url("signed.txt", "user"), sbx.download_url("signed.txt")):
            assert httpx.get(url).text == "for the link"
        assert httpx.get(other.download_url("signed.txt", "user", 120)).text == (
            "the other sandbox's"
        )
        expired = httpx.get(sbx.download_url("signed.txt", "user", use_signature_expiration=-120))
        assert expired.status_code == 401
        assert expired.json() == {"code": 401, "message": "signature is already expired"}
        # Signed for another path, or tampered with: refused.
        url = sbx.download_url("signed.txt", "user")
        assert httpx.get(url.replace("signed.txt", "other.txt")).status_code == 401
        assert httpx.get(url[:-2] + "xx").status_code == 401
        upload = httpx.post(
            sbx.upload_url("up.txt", "user"), files={"file": ("up.txt", b"uploaded")}
        )
        assert upload.status_code == 200, upload.text
        assert sbx.files.read("up.txt") == "uploaded"
        # A read signature does not allow a write.
        denied = httpx.post(
            sbx.download_url("up.txt", "user"), files={"file": ("up.txt", b"overwritten")}
        )
        assert denied.status_code == 401
    finally:
        sbx.kill()
        other.kill()
