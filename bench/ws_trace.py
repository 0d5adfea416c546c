"""Where a remote SDK ``1+1`` goes over the cell WebSocket: a timestamped trace of each
stage, client and server, medians over thousands of cells.

It copies a checkout's ``src`` (``--rev``, a git revision; default the working tree) to
a temporary directory, inserts ``perf_counter_ns`` stamps at each stage (in the copy
only: nothing here changes sandlot), starts ``sandlot serve`` from the copy, sends
``--cells`` cells with the remote SDK after 50 warm-ups, and prints each stage's p25 /
p50 / p75 in microseconds. Both processes stamp the same monotonic clock, so client
and server stages line up. A stamp whose anchor is not in the copy (the code moved) is
reported as skipped and its rows are left out::

    .venv/bin/python bench/ws_trace.py --cells 3000
    .venv/bin/python bench/ws_trace.py --rev 8296d03 --cells 3000

Stages: ``k_`` the client, ``s_`` the server's event loop (``s_frame_in`` is uvicorn's
``data_received``), ``w_`` the cell's worker thread, ``c_`` the local core in it,
``l_put`` the event loop taking what the worker handed it.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRACE_MODULE = """
import os, time
_T = []
_ns = time.perf_counter_ns
def t(label):
    _T.append((label, _ns()))
def dump():
    with open(f"{os.environ['WS_TRACE_OUT']}.{os.getpid()}", "w") as f:
        f.writelines(f"{label} {ns}\\n" for label, ns in _T)
def patch_uvicorn():
    from uvicorn.protocols.websockets import wsproto_impl as w
    def data_received(self, data):
        t("s_frame_in")
        self.conn.receive_data(data)
        t("s_wsproto_in")
        self.handle_events()
        t("s_queued")
    receive = w.WSProtocol.receive
    async def received(self):
        message = await receive(self)
        t("s_received")
        return message
    send = w.WSProtocol.send
    async def sent(self, message):
        if message.get("type") == "websocket.send":
            t("s_send_call")
        await send(self, message)
    w.WSProtocol.data_received = data_received
    w.WSProtocol.receive = received
    w.WSProtocol.send = sent
"""

# (file under src/sandlot, a unique piece of one line, where, what): the code goes in
# before that line, after it, into the block it opens, or instead of it.
STAMPS: list[tuple[str, str, str, str]] = [
    (
        "server/__init__.py",
        "    import uvicorn",
        "after",
        "from sandlot import _trace; _trace.patch_uvicorn()",
    ),
    ("server/__init__.py", "await super().shutdown(sockets)", "after", "_trace.dump()"),
    ("server/_cellsocket.py", "message = listening.result()", "after", "s_app_msg"),
    ("server/_cellsocket.py", "message = await listening", "after", "s_app_msg"),
    ("server/_cellsocket.py", "body = _parse(state, message)", "after", "s_parsed"),
    (
        "server/_cellsocket.py",
        "entry = state.manager.lease(principal, sandbox_id)",
        "before",
        "s_authed",
    ),
    (
        "server/_cellsocket.py",
        "return cell_runner(state, principal, entry, body)",
        "before",
        "s_leased",
    ),
    ("server/_cellsocket.py", "flow = _ndjson(", "before", "s_runner_made"),
    (
        "server/_cellsocket.py",
        'await send({"type": "websocket.send", "text": chunk',
        "before",
        "s_chunk",
    ),
    ("server/_cells.py", "executor.submit(job).add_done_callback", "before", "s_submitted"),
    ("server/_cells.py", "forward_output, forward_result = stream_only(", "before", "w_start"),
    ("server/_cells.py", "# DEBUG: the audit row is the record", "before", "w_audit1"),
    ("server/_cells.py", "self._finish(execution, sizes, with_held)", "before", "w_core_done"),
    ("server/_cells.py", "        count = (", "before", "w_audit2"),
    ("server/_cells.py", "# After the end went out (its audit row", "before", "w_pushed"),
    ("server/_cells.py", "loop.call_soon_threadsafe(put)", "before", "w_deliver"),
    ("server/_cells.py", "items = pending.copy()", "before", "l_put"),
    ("_local.py", "before = handle.usage_counters()", "before", "c_core_in"),
    ("_local.py", "deadline = started + limit + HOST_BACKSTOP", "before", "c_req_written"),
    ("_local.py", "                    builder.add(event)", "before", "c_answer"),
    ("_local.py", "execution = builder.execution", "before", "c_folded"),
    ("_remote.py", 'request = json.dumps({"type": "execute", **body})', "before", "k_cell"),
    (
        "_remote.py",
        "self._sock.sendall(self._ws.send(ws.TextMessage(request)))",
        "instead",
        "frame = self._ws.send(ws.TextMessage(request)); self._sock.sendall(frame)",
    ),
    ("_remote.py", "self._sock.sendall(frame)", "before", "k_framed"),
    ("_remote.py", "self._sock.sendall(frame)", "after", "k_sent"),
    ("_remote.py", "data = self._sock.recv(256 * 1024)", "after", "k_recv"),
    ("_remote.py", "data = self._recv()", "after", "k_recv"),
    ("_remote.py", 'if message.get("type") == "end_of_execution":', "into", "k_parsed"),
]

ORDER = [
    *("k_run", "k_cell", "k_framed", "k_sent"),
    *("s_frame_in", "s_wsproto_in", "s_queued", "s_received", "s_app_msg"),
    *("s_parsed", "s_authed", "s_leased", "s_runner_made", "s_submitted"),
    *("w_start", "w_audit1", "c_core_in", "c_req_written", "c_answer", "c_folded"),
    *("w_core_done", "w_audit2", "w_deliver", "w_pushed", "l_put", "s_chunk", "s_send_call"),
    *("k_recv", "k_parsed", "k_done"),
]
LAST_BEFORE = {"s_frame_in", "s_wsproto_in", "s_queued", "s_received"}
"""Stamped per read, not per cell: the last before the next stage counts."""


def _instrument(src: Path) -> list[str]:
    (src / "sandlot" / "_trace.py").write_text(TRACE_MODULE)
    skipped = []
    for rel, anchor, where, what in STAMPS:
        path = src / "sandlot" / rel
        lines = path.read_text().splitlines(keepends=True)
        found = [i for i, line in enumerate(lines) if anchor in line]
        if len(found) != 1:
            skipped.append(f"{rel}: {anchor.strip()}")
            continue
        i = found[0]
        line = lines[i]
        indent = line[: len(line) - len(line.lstrip())]
        code = what if " " in what or "(" in what else f"from sandlot._trace import t; t({what!r})"
        if where == "instead":
            lines[i] = "".join(f"{indent}{part}\n" for part in code.split("; "))
        elif where == "before":
            lines.insert(i, f"{indent}{code}\n")
        else:
            lines.insert(i + 1, f"{indent}{'    ' if where == 'into' else ''}{code}\n")
        path.write_text("".join(lines))
    return skipped


def _drive(cells: int) -> None:
    """In the instrumented copy: a server, the SDK, ``cells`` timed cells."""
    sys.path.insert(0, str(ROOT / "bench"))
    import server as bench  # bench/server.py: its server harness
    from sandlot import Sandbox, _trace  # type: ignore[attr-defined]

    with (
        tempfile.TemporaryDirectory(prefix="sandlot-ws-trace-") as tmp,
        bench._server(Path(tmp)) as (url, key, _),
    ):
        sdk = Sandbox(api_url=url, api_key=key)
        for _ in range(50):
            sdk.run_code("1+1")
        _trace._T.clear()
        for _ in range(cells):
            _trace.t("k_run")
            sdk.run_code("1+1")
            _trace.t("k_done")
        sdk.kill()
    _trace.dump()


def _report(out: Path) -> str:
    by: dict[str, list[int]] = {}
    for path in out.parent.glob(out.name + ".*"):
        for line in path.read_text().splitlines():
            label, ns = line.split()
            by.setdefault(label.rstrip("_"), []).append(int(ns))
    for values in by.values():
        values.sort()

    def first_after(label: str, ns: int) -> int | None:
        values = by.get(label, [])
        i = bisect.bisect_left(values, ns)
        return values[i] if i < len(values) else None

    def last_before(label: str, ns: int) -> int | None:
        values = by.get(label, [])
        i = bisect.bisect_right(values, ns)
        return values[i - 1] if i else None

    order = [label for label in ORDER if label in by]
    cells = []
    for start in by.get("k_run", []):
        cell = {"k_run": start}
        at = start
        for label in order[1:]:
            if label in LAST_BEFORE or label == "k_recv":
                continue
            found = first_after(label, at)
            if found is None:
                break
            cell[label] = at = found
        else:
            for label in LAST_BEFORE & set(order):
                cell[label] = last_before(label, cell["s_app_msg"]) or 0
            if "k_recv" in order:
                cell["k_recv"] = last_before("k_recv", cell["k_parsed"]) or 0
            if all(cell[a] <= cell[b] for a, b in itertools.pairwise(order)):
                cells.append(cell)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"{len(by.get('k_run', []))} cells, {len(cells)} with every stage in order "
        f"(load average {load})",
        "",
        "| stage (from the one before) | p25 | p50 | p75 us |",
        "|---|---|---|---|",
    ]
    for a, b in itertools.pairwise(order):
        q = statistics.quantiles([(c[b] - c[a]) / 1000 for c in cells], n=4)
        lines.append(f"| {a} -> {b} | {q[0]:.0f} | {q[1]:.0f} | {q[2]:.0f} |")
    total = statistics.median((c["k_done"] - c["k_run"]) / 1000 for c in cells)
    lines.append(f"| **k_run -> k_done** | | **{total:.0f}** | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--cells", type=int, default=3000)
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        _drive(args.cells)
        return 0
    with tempfile.TemporaryDirectory(prefix="sandlot-ws-trace-src-") as tmp:
        copy = Path(tmp)
        if args.rev:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.rev, "src"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
        else:
            shutil.copytree(ROOT / "src", copy / "src")
        for skipped in _instrument(copy / "src"):
            print(f"(no stamp: {skipped})", file=sys.stderr)
        out = copy / "trace"
        env = {**os.environ, "PYTHONPATH": str(copy / "src"), "WS_TRACE_OUT": str(out)}
        subprocess.run(
            [sys.executable, __file__, "--drive", "--cells", str(args.cells)], env=env, check=True
        )
        print(_report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
