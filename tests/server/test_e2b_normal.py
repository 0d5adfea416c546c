"""The unmodified ``e2b`` and ``e2b_code_interpreter`` packages in E2B's normal mode.

Configured as an E2B user would move a program onto sandlot: the API URL and the
sandbox URL are the server's root URL, the API key a sandlot key (passed as the SDK's
own ``api_url`` / ``sandbox_url`` / ``api_key`` arguments); no debug flag, nothing of
the clients patched.
"""

from __future__ import annotations

import asyncio
import io
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

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Wire:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.key = server.key("e2b-normal")
        self.other_key = server.key("e2b-other")

    def opts(self, key: str | None = None) -> dict[str, Any]:
        return self.server.e2b_opts(key or self.key)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    server = ServerProcess(
        tmp_path_factory.mktemp("e2b-normal"), "--e2b-template", "my-team/analysis=python-data"
    ).start()
    try:
        yield Wire(server)
    finally:
        server.stop()


def test_code_interpreter_sync_end_to_end(wire: Wire) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120, metadata={"suite": "normal-sync"}, **wire.opts())
    try:
        assert sbx.sandbox_id
        lines: list[str] = []
        execution = sbx.run_code("x = 41\nprint('hi there')\nx + 1", on_stdout=lines.append)
        assert execution.text == "42"
        assert execution.logs.stdout == ["hi there\n"]
        assert [str(line) for line in lines] == ["hi there\n"]

        failed = sbx.run_code("1 / 0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"

        chart = sbx.run_code(
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [4, 5, 6], label='sales')\n"
            "plt.title('Sales')\n"
            "plt.show()"
        )
        assert chart.error is None, chart.error
        png = chart.results[0].png
        assert png is not None
        import base64

        assert base64.b64decode(png).startswith(PNG_MAGIC)
        assert chart.results[0].chart is not None
        assert chart.results[0].chart.title == "Sales"

        context = sbx.create_code_context()
        sbx.run_code("y = 'in context'", context=context)
        assert sbx.run_code("y", context=context).text == "in context"
        assert context.id in [c.id for c in sbx.list_code_contexts()]
        sbx.remove_code_context(context)

        # files over envd: HTTP upload/download and the Connect filesystem service
        info = sbx.files.write("notes/a.txt", "alpha")
        assert info.path.endswith("notes/a.txt")
        assert sbx.files.read("notes/a.txt") == "alpha"
        assert sbx.files.read("notes/a.txt", format="bytes") == bytearray(b"alpha")
        assert b"".join(sbx.files.read("notes/a.txt", format="stream")) == b"alpha"
        assert sbx.files.read("notes/a.txt", gzip=True) == "alpha"
        assert sbx.files.exists("notes/a.txt")
        assert not sbx.files.exists("notes/missing.txt")
        written = sbx.files.write_files(
            [
                {"path": "multi/one.txt", "data": "1"},
                {"path": "multi/two.bin", "data": b"\x00\x02"},
                {"path": "multi/three.txt", "data": io.BytesIO(b"three")},
            ]
        )
        assert sorted(w.name for w in written) == ["one.txt", "three.txt", "two.bin"]
        assert sbx.files.read("multi/two.bin", format="bytes") == bytearray(b"\x00\x02")
        sbx.files.write("gz.txt", "zipped " * 100, gzip=True)
        assert sbx.files.read("gz.txt") == "zipped " * 100
        names = {entry.name for entry in sbx.files.list("multi")}
        assert names == {"one.txt", "two.bin", "three.txt"}
        deep = {entry.path.split("/home/user/")[-1] for entry in sbx.files.list(".", depth=2)}
        assert "multi/one.txt" in deep
        stat = sbx.files.get_info("multi/three.txt")
        assert stat.size == 5 and stat.type is not None and stat.type.value == "file"
        assert sbx.files.make_dir("made/here") is True
        assert sbx.files.make_dir("made/here") is False
        moved = sbx.files.rename("multi/one.txt", "made/here/one.txt")
        assert moved.name == "one.txt"
        assert sbx.files.read("made/here/one.txt") == "1"
        sbx.files.remove("made")
        assert not sbx.files.exists("made/here/one.txt")

        from e2b import InvalidArgumentException, NotFoundException

        with pytest.raises(NotFoundException):
            sbx.files.read("nope.txt")
        with pytest.raises(NotFoundException):
            sbx.files.get_info("nope.txt")
        with pytest.raises((InvalidArgumentException, NotFoundException)):
            sbx.files.list("multi/two.bin")

        # commands over envd's Connect process service
        out: list[str] = []
        result = sbx.commands.run("echo hi; echo oops >&2; pwd", on_stdout=out.append)
        assert result.exit_code == 0
        assert result.stdout == "hi\n/home/user\n"
        assert result.stderr == "oops\n"
        assert "".join(out) == "hi\n/home/user\n"
        env = sbx.commands.run("echo $GREETING", envs={"GREETING": "hello"}, cwd="/tmp")
        assert env.stdout == "hello\n"

        from e2b import CommandExitException

        with pytest.raises(CommandExitException) as exited:
            sbx.commands.run("exit 3")
        assert exited.value.exit_code == 3

        # control plane
        assert sbx.is_running()
        sbx.set_timeout(600)
        details = sbx.get_info()
        assert details.sandbox_id == sbx.sandbox_id
        assert details.metadata == {"suite": "normal-sync"}
        assert details.template_id == "code-interpreter-v1"
        left = (details.end_at - details.started_at).total_seconds()
        assert 590 <= left <= 700

        again = Sandbox.connect(sbx.sandbox_id, **wire.opts())
        assert again.run_code("x").text == "41"
    finally:
        assert sbx.kill() is True
    assert not sbx.is_running()
    from e2b import SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id, **wire.opts())


def test_list_filters_by_metadata_and_pages(wire: Wire) -> None:
    from e2b import Sandbox, SandboxQuery

    run = uuid.uuid4().hex
    made = [
        Sandbox.create(timeout=60, metadata={"run": run, "n": str(i)}, **wire.opts())
        for i in range(3)
    ]
    try:
        paginator = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=2, **wire.opts())
        seen: list[str] = []
        pages = 0
        while paginator.has_next and pages < 5:
            seen += [info.sandbox_id for info in paginator.next_items()]
            pages += 1
        assert sorted(seen) == sorted(s.sandbox_id for s in made)
        assert pages == 2
        one = Sandbox.list(
            query=SandboxQuery(metadata={"run": run, "n": "1"}), **wire.opts()
        ).next_items()
        assert [info.sandbox_id for info in one] == [made[1].sandbox_id]
        # another tenant sees none of them, and cannot connect to them
        theirs = Sandbox.list(
            query=SandboxQuery(metadata={"run": run}), **wire.opts(wire.other_key)
        )
        assert theirs.next_items() == []
        from e2b import SandboxNotFoundException

        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(made[0].sandbox_id, **wire.opts(wire.other_key))
        assert Sandbox.get_info(made[2].sandbox_id, **wire.opts()).metadata["n"] == "2"
        Sandbox.set_timeout(made[2].sandbox_id, 30, **wire.opts())
    finally:
        assert [Sandbox.kill(sbx.sandbox_id, **wire.opts()) for sbx in made] == [True] * 3
    assert Sandbox.kill(made[0].sandbox_id, **wire.opts()) is False


def test_envd_refuses_requests_without_the_sandbox_token(wire: Wire) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=60, **wire.opts())
    try:
        sbx.files.write("secret.txt", "mine")
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        url = wire.server.url
        bare = httpx.get(f"{url}/files", params={"path": "secret.txt"}, headers=headers)
        assert bare.status_code == 401, bare.text
        wrong = httpx.get(
            f"{url}/files",
            params={"path": "secret.txt"},
            headers={**headers, "X-Access-Token": "not-the-token"},
        )
        # as for an unknown id: a wrong token does not tell the sandbox exists
        assert wrong.status_code == 502 and "was not found" in wrong.json()["message"]
        rpc = httpx.post(
            f"{url}/filesystem.Filesystem/Stat",
            json={"path": "secret.txt"},
            headers={**headers, "Content-Type": "application/json"},
        )
        assert rpc.status_code == 401 and rpc.json()["code"] == "unauthenticated"
        # another tenant's API key is no better than no token
        other = httpx.get(
            f"{url}/files",
            params={"path": "secret.txt"},
            headers={**headers, "X-API-Key": wire.other_key},
        )
        assert other.status_code == 502 and "was not found" in other.json()["message"]
        ok = httpx.get(
            f"{url}/files",
            params={"path": "secret.txt"},
            headers={**headers, "X-Access-Token": sbx._envd_access_token or ""},
        )
        assert ok.status_code == 200 and ok.text == "mine"
    finally:
        sbx.kill()


def test_template_aliases_and_unknown_names(wire: Wire) -> None:
    from e2b import Sandbox, SandboxException

    sbx = Sandbox.create("my-team/analysis", timeout=60, **wire.opts())
    try:
        assert sbx.get_info().template_id == "my-team/analysis"
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create("no-such-template", **wire.opts())


def test_internet_access_stays_within_the_egress_ceiling(wire: Wire) -> None:
    """This server lets tenants reach nothing: E2B's default (internet on) is no
    network; asking for it explicitly, or for a destination, is refused."""
    from e2b import Sandbox, SandboxException

    sbx = Sandbox.create(timeout=60, **wire.opts())
    try:
        assert sbx.get_info().allow_internet_access is False
        probe = sbx.commands.run(
            "python -c \"import socket; socket.create_connection(('127.0.0.1', 9), 2)\" "
            "2>&1 || true"
        )
        assert "Error" in probe.stdout
    finally:
        sbx.kill()
    with pytest.raises(SandboxException, match="no network destinations"):
        Sandbox.create(allow_internet_access=True, **wire.opts())
    with pytest.raises(SandboxException, match="400"):
        Sandbox.create(network={"allow_out": ["pypi.org"]}, **wire.opts())


def test_not_implemented_calls_raise_the_sdks_errors(wire: Wire) -> None:
    """A server not started with --checkpointable says so on pause, snapshot and fork
    (E2B's shape), and the sandbox runs on."""
    from e2b import Sandbox, SandboxException

    sbx = Sandbox.create(timeout=60, **wire.opts())
    try:
        for call in (sbx.pause, sbx.create_snapshot, sbx.fork):
            with pytest.raises(SandboxException, match="--checkpointable"):
                call()
        assert sbx.is_running()
        [metrics] = sbx.get_metrics()
        assert metrics.mem_total > 0 and metrics.mem_used > 0
    finally:
        sbx.kill()


def test_mcp_is_refused_as_the_sdk_reports_a_gateway_failure(wire: Wire) -> None:
    """E2B code that asks for MCP servers gets the SDK's own failure text, and no
    sandbox is left running behind the refusal."""
    from e2b import Sandbox, SandboxException, SandboxQuery, SandboxState

    metadata = {"mcp-refusal": uuid.uuid4().hex}
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create(timeout=60, metadata=metadata, mcp={"some_server": {}}, **wire.opts())
    query = SandboxQuery(state=[SandboxState.RUNNING], metadata=metadata)
    assert Sandbox.list(query=query, **wire.opts()).next_items() == []


def test_async_clients(wire: Wire) -> None:
    async def main() -> None:
        from e2b import AsyncSandbox as PlainAsync
        from e2b_code_interpreter import AsyncSandbox

        sbx = await AsyncSandbox.create(timeout=60, metadata={"suite": "async"}, **wire.opts())
        try:
            execution = await sbx.run_code("print(6 * 7)")
            assert execution.logs.stdout == ["42\n"]
            await sbx.files.write("async.txt", "from async")
            assert await sbx.files.read("async.txt") == "from async"
            assert await sbx.files.exists("async.txt")
            assert [e.name for e in await sbx.files.list(".") if e.name == "async.txt"]
            result = await sbx.commands.run("echo async-hi")
            assert result.stdout == "async-hi\n"
            await sbx.set_timeout(120)
            info = await sbx.get_info()
            assert info.metadata == {"suite": "async"}
            other = await PlainAsync.connect(sbx.sandbox_id, **wire.opts())
            assert (await other.commands.run("cat async.txt")).stdout == "from async"
        finally:
            assert await sbx.kill() is True

    asyncio.run(main())


def test_background_commands_and_terminals_sync(wire: Wire) -> None:
    """envd's process service: background handles, list, stdin, reattach, kill, pty."""
    from e2b import CommandExitException, Sandbox
    from e2b.sandbox.commands.command_handle import PtySize

    sbx = Sandbox.create(**wire.opts())
    try:
        cat = sbx.commands.run("cat", background=True, stdin=True)
        assert cat.pid in [p.pid for p in sbx.commands.list()]
        sbx.commands.send_stdin(cat.pid, "through stdin\n")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "through stdin\n"
        assert cat.pid not in [p.pid for p in sbx.commands.list()]

        counter = sbx.commands.run(
            "for i in 1 2 3; do echo $i; done; echo done > counted; sleep 600", background=True
        )
        seen: list[str] = []
        for stdout, _, _ in counter:
            seen.append(stdout or "")
            if "".join(seen).count("\n") == 3:
                break
        counter.disconnect()  # the process runs on
        again = sbx.commands.connect(counter.pid)
        assert sbx.commands.kill(counter.pid)
        with pytest.raises(CommandExitException) as killed:
            again.wait()
        assert killed.value.stdout == "1\n2\n3\n"  # replayed on reattach
        assert killed.value.exit_code != 0
        assert not sbx.commands.kill(counter.pid)  # gone
        assert sbx.files.read("counted") == "done\n"

        output: list[bytes] = []
        terminal = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(terminal.pid, b"echo pty-$((40 + 2)); stty size; exit\n")
        terminal.wait(on_pty=output.append)
        text = b"".join(output)
        assert b"pty-42" in text and b"30 100" in text
    finally:
        sbx.kill()


def test_background_commands_async(wire: Wire) -> None:
    from e2b import AsyncSandbox

    async def scenario() -> tuple[str, list[int], bool]:
        sbx = await AsyncSandbox.create(**wire.opts())
        try:
            sleeper = await sbx.commands.run("sleep 600", background=True)
            listed = [p.pid for p in await sbx.commands.list()]
            killed = await sbx.commands.kill(sleeper.pid)
            done = await (await sbx.commands.run("echo bg", background=True)).wait()
            return done.stdout, listed, killed and sleeper.pid in listed
        finally:
            await sbx.kill()

    stdout, listed, killed = asyncio.run(scenario())
    assert stdout == "bg\n" and listed and killed


def test_watch_dir_sync_and_async(wire: Wire) -> None:
    """envd's polling watcher (the sync SDK) and WatchDir stream (the async SDK)."""
    import time

    from e2b import AsyncSandbox, FilesystemEventType, Sandbox

    sbx = Sandbox.create(**wire.opts())
    try:
        sbx.files.make_dir("/home/user/watched")
        handle = sbx.files.watch_dir("/home/user/watched")
        sbx.files.write("/home/user/watched/a.txt", "x")
        sbx.files.remove("/home/user/watched/a.txt")
        seen: list[tuple[str, FilesystemEventType]] = []
        deadline = time.monotonic() + 30
        while ("a.txt", FilesystemEventType.REMOVE) not in seen:
            assert time.monotonic() < deadline, seen
            seen += [(event.name, event.type) for event in handle.get_new_events()]
            time.sleep(0.05)
        assert seen[0] == ("a.txt", FilesystemEventType.CREATE)
        handle.stop()
    finally:
        sbx.kill()

    async def scenario() -> list[tuple[str, FilesystemEventType]]:
        got: list[tuple[str, FilesystemEventType]] = []
        arrived = asyncio.Event()

        def on_event(event: object) -> None:
            got.append((event.name, event.type))  # type: ignore[attr-defined]
            if event.type == FilesystemEventType.CREATE:  # type: ignore[attr-defined]
                arrived.set()

        asbx = await AsyncSandbox.create(**wire.opts())
        try:
            await asbx.files.make_dir("/home/user/deep/er")
            watch = await asbx.files.watch_dir("/home/user/deep", on_event, recursive=True)
            await asbx.files.write("/home/user/deep/er/b.txt", "y")
            await asyncio.wait_for(arrived.wait(), 30)
            await watch.stop()
        finally:
            await asbx.kill()
        return got

    assert ("er/b.txt", FilesystemEventType.CREATE) in asyncio.run(scenario())


def test_a_user_the_sandbox_does_not_have_is_refused(wire: Wire) -> None:
    """`user="root"` (common in E2B programs) must not quietly run as the sandbox's one
    unprivileged user: commands, file reads and writes and signed file URLs refuse it
    with the SDK's InvalidArgumentException; `user="user"` and no user work."""
    from e2b import InvalidArgumentException, Sandbox

    sbx = Sandbox.create(**wire.opts())
    try:
        for user in ("root", "postgres"):
            with pytest.raises(InvalidArgumentException, match=f"user '{user}' is not available"):
                sbx.commands.run("id -u", user=user)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentException, match="not available"):
                sbx.files.write("owned-by-root.txt", "x", user=user)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentException, match="not available"):
                sbx.files.read("/home/user/.bashrc", user=user)  # type: ignore[arg-type]
        assert not sbx.files.exists("owned-by-root.txt")
        assert sbx.commands.run("id -un", user="user").stdout.strip() == "user"
        assert sbx.commands.run("id -un").stdout.strip() == "user"
        sbx.files.write("mine.txt", "ok", user="user")
        signed = sbx.upload_url("signed.txt", user="root")  # type: ignore[arg-type]
        refused = httpx.post(signed, files={"file": ("signed.txt", b"x")})
        assert refused.status_code == 400 and "not available" in refused.text
        assert not sbx.files.exists("signed.txt")
    finally:
        sbx.kill()
