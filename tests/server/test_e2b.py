"""The unmodified ``e2b_code_interpreter`` client (its PyPI package) against sandlot.

Configured the documented way: ``E2B_DEBUG=true`` and ``E2B_SANDBOX_URL`` with the API
key as the URL's password; nothing of the client is patched.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterator

import httpx
import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class E2B:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.key = server.key("e2b-user")

    def url(self, suffix: str = "/e2b") -> str:
        host = self.server.url.removeprefix("http://")
        return f"http://sandlot:{self.key}@{host}{suffix}"


@pytest.fixture(scope="module")
def e2b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2B]:
    server = ServerProcess(tmp_path_factory.mktemp("e2b")).start()
    try:
        yield E2B(server)
    finally:
        server.stop()


@pytest.fixture
def client_env(e2b: E2B, monkeypatch: pytest.MonkeyPatch) -> E2B:
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b.url())
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    return e2b


def test_run_code_stdout_errors_charts_and_dataframes(
    client_env: E2B, caplog: pytest.LogCaptureFixture
) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    lines: list[str] = []
    execution = sbx.run_code("x = 41\nprint('hello from sandlot')\nx + 1", on_stdout=lines.append)
    assert execution.logs.stdout == ["hello from sandlot\n"]
    assert [str(line) for line in lines] == ["hello from sandlot\n"]
    assert execution.text == "42"
    assert execution.execution_count is not None

    failed = sbx.run_code("1 / 0")
    assert failed.error is not None
    assert failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value
    assert "ZeroDivisionError" in failed.error.traceback

    with caplog.at_level(logging.ERROR, logger="e2b_code_interpreter"):
        chart = sbx.run_code(
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [4, 5, 6], label='sales')\n"
            "plt.title('Sales')\n"
            "plt.show()"
        )
    assert chart.error is None, chart.error
    [figure] = chart.results
    assert figure.png is not None
    assert base64.b64decode(figure.png)[:8] == PNG_MAGIC
    assert figure.chart is not None and figure.chart.title == "Sales"
    assert not [r for r in caplog.records if "chart" in r.getMessage()]  # it deserialized

    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert frame.error is None, frame.error
    [table] = frame.results
    assert table.is_main_result
    assert table.html is not None and "<table" in table.html
    assert table.data is not None


def test_contexts(client_env: E2B) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.cwd == "/tmp" and ctx.language == "python"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.run_code("only_here = 1", context=ctx)
    assert sbx.run_code("only_here", context=ctx).text == "1"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    assert sbx.run_code("only_here").error is not None  # default context: separate state
    sbx.restart_code_context(ctx)
    restarted = sbx.run_code("only_here", context=ctx)
    assert restarted.error is not None and restarted.error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_files_read_and_write(client_env: E2B) -> None:
    from e2b.exceptions import NotFoundException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    info = sbx.files.write("e2b/notes.txt", "héllo")  # multipart upload
    assert info.path == "/home/user/e2b/notes.txt" and info.name == "notes.txt"
    assert sbx.files.read("e2b/notes.txt") == "héllo"
    payload = bytes(range(256)) * 4096  # 1 MiB, streamed as octet-stream
    sbx.files.write("e2b/blob.bin", io.BytesIO(payload))
    assert bytes(sbx.files.read("e2b/blob.bin", format="bytes")) == payload
    assert sbx.run_code("len(open('e2b/blob.bin', 'rb').read())").text == str(len(payload))
    sbx.run_code("open('made-by-code.csv', 'w').write('a,b\\n1,2\\n')")
    assert sbx.files.read("made-by-code.csv") == "a,b\n1,2\n"
    with pytest.raises(NotFoundException):
        sbx.files.read("e2b/missing.txt")


def test_a_named_sandbox_and_a_wrong_key(e2b: E2B, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b_code_interpreter import Sandbox

    headers = {"Authorization": f"Bearer {e2b.key}"}
    created = httpx.post(f"{e2b.server.url}/v1/sandboxes", json={}, headers=headers, timeout=120)
    sandbox_id = created.json()["sandbox_id"]
    try:
        monkeypatch.setenv("E2B_DEBUG", "true")
        monkeypatch.setenv("E2B_SANDBOX_URL", e2b.url(f"/e2b/sandboxes/{sandbox_id}"))
        Sandbox.create().run_code("marker = 'named'")
        check = httpx.post(
            f"{e2b.server.url}/v1/sandboxes/{sandbox_id}/execute",
            json={"code": "marker"},
            headers=headers,
            timeout=120,
        )
        assert '"text": "\'named\'"' in check.text

        monkeypatch.setenv("E2B_SANDBOX_URL", e2b.url().replace(e2b.key, "sl_00_wrong"))
        with pytest.raises(Exception, match="401"):
            Sandbox.create().run_code("1")
    finally:
        httpx.delete(f"{e2b.server.url}/v1/sandboxes/{sandbox_id}", headers=headers)


def test_envd_connect_calls_in_debug_mode_fail_loudly(client_env: E2B) -> None:
    """In debug mode the E2B SDK sends envd's Connect calls (files.exists/list/...,
    commands) without the URL's credentials: they are refused, naming the fix, never
    answered wrongly (files.exists of an existing file was False)."""
    from e2b.exceptions import AuthenticationException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    sbx.files.write("dbg/a.txt", "a")
    assert sbx.files.read("dbg/a.txt") == "a"  # the HTTP file routes carry the key
    with pytest.raises(AuthenticationException, match="normal mode"):
        sbx.files.exists("dbg/a.txt")
    with pytest.raises(AuthenticationException, match="normal mode"):
        sbx.files.list("dbg")
    with pytest.raises(AuthenticationException, match="normal mode"):
        sbx.commands.run("echo hi")


def test_debug_mode_connect_to_an_unknown_id_fails_loudly(client_env: E2B) -> None:
    """Sandbox.connect(id) in debug mode sends the id in E2b-Sandbox-Id: an unknown one
    is an error, never the default sandbox answering in its place."""
    from e2b.exceptions import NotFoundException
    from e2b_code_interpreter import Sandbox

    ghost = Sandbox.connect("no-such-id")
    with pytest.raises(NotFoundException):
        ghost.run_code("1")
    with pytest.raises(NotFoundException):
        ghost.files.read("anything.txt")
