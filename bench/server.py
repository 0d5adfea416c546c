"""The server path, side by side with the local SDK, in one run on one machine.

Rows (each p50 / p95 / p99 over ``--runs`` runs, after one warm-up):

* ``local pool``: ``Sandbox(pool=...)`` in this process, create -> first result of a
  pandas cell (the floor the server path adds to);
* ``remote pool``: the remote SDK against ``sandlot serve`` on 127.0.0.1 with its warm
  pool (the default), create -> first result of the same cell;
* ``remote cold``: the same against a server with ``--pool-size 0``;
* ``e2b client``: the unmodified ``e2b_code_interpreter`` client in E2B's normal mode
  (``E2B_API_URL``/``E2B_SANDBOX_URL`` at the server), ``Sandbox.create()`` -> first
  ``run_code`` result, when the package is installed and the server speaks E2B's wire;
* ``1+1`` round trip: plain ``eval`` in this process (the floor), the local SDK, the
  remote SDK over loopback (its cell WebSocket, then the HTTP route), and the E2B client;
* ``HTTP floor``: the same client calls against a bare ASGI app on uvicorn that answers
  ``/execute`` with a canned two-line NDJSON body at once (no sandbox, no server work):
  what HTTP on loopback costs by itself, the part of a cell's overhead no server
  change removes.

Each timed create waits first until the server's pool has a ready sandbox again (its
refill rate is not what these rows measure); its span ends after the sandbox's kill. Run::

    .venv/bin/python bench/server.py --runs 30

It prints a Markdown table, each server row's p50 over its local counterpart's, and writes
``bench/results/server-<UTC time>.md``; ``--json PATH`` also writes ``{row name: [ms
values]}``. To compare two checkouts, run it with ``PYTHONPATH`` at each one's ``src``
(the servers it starts inherit it), then ``--compare BEFORE.json AFTER.json`` prints
both. Numbers on a shared 2-core machine are noisy: read them next to the load average
printed with them.

On a busy machine two runs one after the other see different loads; ``--interleave
OTHER_SRC`` instead times the ``1+1`` rows of the remote SDK (its socket, then HTTP)
and the E2B client against this checkout's server and OTHER_SRC's (e.g. a ``git
archive`` of an older commit), each with its own SDK, in alternating blocks of 25
cells, so both see the same load::

    .venv/bin/python bench/server.py --interleave /tmp/base/src --blocks 24
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from sandlot import Pool, Sandbox

CELL = "import pandas as pd\npd.DataFrame({'a': [1, 2, 3]})['a'].sum()"
RESULTS = Path(__file__).parent / "results"


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


MEASURED: dict[str, list[float]] = {}
"""Every row's values in ms, by row name (written by ``--json``)."""


def _row(name: str, values: list[float]) -> str:
    MEASURED[name] = values
    if not values:
        return f"| {name} | not measured |"
    p50, p95, p99 = (_pct(values, p) for p in (50, 95, 99))
    return f"| {name} | {p50:.2f} / {p95:.2f} / {p99:.2f} | {len(values)} |"


def _time(
    fn: Callable[[], object], runs: int, before: Callable[[], None] | None = None
) -> list[float]:
    fn()  # warm-up, not counted
    values = []
    for _ in range(runs):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        values.append((time.perf_counter() - started) * 1000)
    return values


@contextmanager
def _server(state: Path, *args: str) -> Iterator[tuple[str, str, Callable[[], None]]]:
    """A ``sandlot serve`` on 127.0.0.1: (url, key, wait until its pool has a sandbox)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANDLOT_API_", "E2B_"))}
    env["SANDLOT_SERVER_DIR"] = str(state)
    log_path = state / "server.log"
    state.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sandlot", "serve", "--port", "0", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        url = ""
        deadline = time.monotonic() + 120
        while not url:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"sandlot serve did not come up:\n{log_path.read_text()}")
            found = re.search(r"running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            url = found.group(1) if found else ""
            time.sleep(0.1)
        key = subprocess.run(
            # No creates-per-minute quota in the way: the rows create faster than the
            # default allows.
            [
                sys.executable,
                *("-m", "sandlot", "keys", "create", "--tenant", "bench"),
                *("--creates-per-minute", "1000000"),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout.split()[-1]

        def ready() -> None:
            limit = time.monotonic() + 120
            while time.monotonic() < limit:
                text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
                match = re.search(r"^sandlot_pool_ready (\S+)$", text, re.MULTILINE)
                if match is None or float(match.group(1)) >= 1:
                    return
                time.sleep(0.05)

        yield url, key, ready
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write {row name: [ms values]} here"
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="print two --json files' p50s side by side and exit (measures nothing)",
    )
    parser.add_argument(
        "--interleave",
        type=Path,
        metavar="OTHER_SRC",
        help="time the 1+1 rows against this checkout and OTHER_SRC alternately, and exit",
    )
    parser.add_argument("--blocks", type=int, default=24, help="blocks of 25 cells per row")
    parser.add_argument("--interleave-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare is not None:
        print(_compare(*args.compare))
        return 0
    if args.interleave_worker:
        return _interleave_worker()
    if args.interleave is not None:
        print(_interleave(args.interleave, args.blocks))
        return 0
    rows: list[str] = []

    with Pool(size=1) as pool:
        pool.warm()

        def local_create() -> None:
            with Sandbox(pool=pool) as sbx:
                sbx.run_code(CELL)

        def local_ready() -> None:
            while pool.stats().size < 1:
                time.sleep(0.05)

        rows.append(
            _row("local pool: create -> first result", _time(local_create, args.runs, local_ready))
        )
        with Sandbox(pool=pool) as sbx:
            local_ready()
            rows.append(
                _row("local SDK: `1+1`", _time(lambda: sbx.run_code("1+1"), args.runs * 10))
            )
    rows.append(_row("plain python: `eval('1+1')`", _time(lambda: eval("1+1"), args.runs * 10)))

    with tempfile.TemporaryDirectory(prefix="sandlot-bench-") as tmp:
        with _server(Path(tmp) / "pooled", "--pool-size", "1") as (url, key, ready):

            def remote_create() -> None:
                with Sandbox(api_url=url, api_key=key) as sbx:
                    sbx.run_code(CELL)

            rows.append(
                _row("remote pool: create -> first result", _time(remote_create, args.runs, ready))
            )
            with Sandbox(api_url=url, api_key=key) as sbx:
                ready()  # the pool's refill behind this create is not in the round trips
                rows.append(
                    _row("remote SDK: `1+1`", _time(lambda: sbx.run_code("1+1"), args.runs * 10))
                )
                # The same cells over the HTTP route (what a server without the cell
                # WebSocket gets, and what the remote SDK sent before it).
                sbx._core._socket_offered = False  # type: ignore[attr-defined]
                rows.append(
                    _row(
                        "remote SDK over HTTP: `1+1`",
                        _time(lambda: sbx.run_code("1+1"), args.runs * 10),
                    )
                )
            rows.extend(_e2b_rows(url, key, ready, args.runs))
            rows.extend(_floor_rows(url, key, args.runs))
        with _server(Path(tmp) / "cold", "--pool-size", "0") as (url, key, _):

            def cold_create() -> None:
                with Sandbox(api_url=url, api_key=key) as sbx:
                    sbx.run_code(CELL)

            rows.append(
                _row(
                    "remote cold: create -> first result",
                    _time(cold_create, max(3, args.runs // 5)),
                )
            )

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    table = "\n".join(
        [
            f"# Server path, {stamp} ({os.cpu_count()} CPUs, load average {load})",
            "",
            "| row | p50 / p95 / p99 ms | runs |",
            "|---|---|---|",
            *rows,
            "",
            "Over the local SDK in the same run (p50 minus p50, ms):",
            "",
            *_overheads(),
            "",
        ]
    )
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(MEASURED, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"server-{stamp}.md").write_text(table)
    return 0


def _compare(before: Path, after: Path) -> str:
    """Two ``--json`` files' rows, p50 / p95 each, side by side."""
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    lines = [
        f"| row | {before.name} p50 / p95 ms | {after.name} p50 / p95 ms |",
        "|---|---|---|",
    ]
    for name in dict.fromkeys([*old, *new]):
        cells = [
            f"{_pct(values, 50):.2f} / {_pct(values, 95):.2f}" if values else "-"
            for values in (old.get(name) or [], new.get(name) or [])
        ]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


_BLOCK = 25


def _interleave_worker() -> int:
    """One side of ``--interleave``: a server and its clients, timing a block of each
    ``1+1`` row per line read from stdin, answering with the times as JSON."""
    from e2b_code_interpreter import Sandbox as E2BSandbox

    with (
        tempfile.TemporaryDirectory(prefix="sandlot-bench-") as tmp,
        _server(Path(tmp)) as (
            url,
            key,
            _,
        ),
    ):
        sdk = Sandbox(api_url=url, api_key=key)
        http = Sandbox(api_url=url, api_key=key)
        http._core._socket_offered = False  # type: ignore[attr-defined]
        e2b = E2BSandbox.create(api_key=key, api_url=url, sandbox_url=url)
        clients: dict[str, Any] = {
            "remote SDK: `1+1`": sdk,
            "remote SDK over HTTP: `1+1`": http,
            "e2b client: `1+1`": e2b,
        }
        try:
            for client in clients.values():
                for _ in range(20):  # warm-up (and the SDK's socket opened)
                    client.run_code("1+1")
            print("ready", flush=True)
            for _ in sys.stdin:
                block = {}
                for name, client in clients.items():
                    times = []
                    for _ in range(_BLOCK):
                        started = time.perf_counter()
                        client.run_code("1+1")
                        times.append((time.perf_counter() - started) * 1000)
                    block[name] = times
                print(json.dumps(block), flush=True)
        finally:
            sdk.kill()
            http.kill()
            e2b.kill()
    return 0


def _interleave(other: Path, blocks: int) -> str:
    """``--interleave``: both checkouts' ``1+1`` rows, timed in alternating blocks."""
    here = Path(__file__).resolve().parents[1] / "src"
    sides = {"this checkout": str(here), str(other): str(other)}
    workers = {}
    for side, path in sides.items():
        env = {**os.environ, "PYTHONPATH": path}
        workers[side] = subprocess.Popen(
            [sys.executable, __file__, "--interleave-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
    try:
        for worker in workers.values():
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError("an --interleave worker did not start")
        measured: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
        for _ in range(blocks):
            for side, worker in workers.items():
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write("go\n")
                worker.stdin.flush()
                for name, times in json.loads(worker.stdout.readline()).items():
                    measured[side].setdefault(name, []).extend(times)
    finally:
        for worker in workers.values():
            if worker.stdin is not None:
                worker.stdin.close()
            worker.wait(120)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    mine, theirs = measured["this checkout"], measured[str(other)]
    lines = [
        f"Interleaved, {blocks} blocks of {_BLOCK} cells per row (load average {load}):",
        "",
        f"| row | {other} p50 / p95 ms | this checkout p50 / p95 ms |",
        "|---|---|---|",
    ]
    for name in mine:
        cells = [
            f"{_pct(values, 50):.2f} / {_pct(values, 95):.2f}"
            for values in (theirs.get(name, []), mine[name])
        ]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _overheads() -> list[str]:
    """Each server row's p50 less its local counterpart's."""
    pairs = [
        ("remote SDK: `1+1`", "local SDK: `1+1`"),
        ("remote SDK over HTTP: `1+1`", "local SDK: `1+1`"),
        ("e2b client: `1+1`", "local SDK: `1+1`"),
        ("remote pool: create -> first result", "local pool: create -> first result"),
        ("e2b client: create -> first result", "local pool: create -> first result"),
        ("HTTP floor: httpx, POST /execute", "plain python: `eval('1+1')`"),
        ("HTTP floor: e2b client, `1+1`", "plain python: `eval('1+1')`"),
    ]
    lines = []
    for row, local in pairs:
        if MEASURED.get(row) and MEASURED.get(local):
            extra = _pct(MEASURED[row], 50) - _pct(MEASURED[local], 50)
            lines.append(f"- {row}: {extra:+.2f}")
    return lines


def _e2b_rows(url: str, key: str, ready: Callable[[], None], runs: int) -> list[str]:
    """The unmodified E2B client in its normal mode, if installed and answered."""
    try:
        from e2b_code_interpreter import Sandbox as E2BSandbox
    except ImportError:
        return [_row("e2b client (not installed)", [])]
    options = {"api_key": key, "api_url": url, "sandbox_url": url}

    def create() -> None:
        sbx = E2BSandbox.create(**options)
        try:
            sbx.run_code(CELL)
        finally:
            sbx.kill()

    try:
        create()
    except Exception as exc:  # the server does not speak E2B's normal mode
        return [_row(f"e2b client ({type(exc).__name__})", [])]
    rows = [_row("e2b client: create -> first result", _time(create, runs, ready))]
    sbx = E2BSandbox.create(**options)
    try:
        ready()  # as for the remote SDK's round trips
        rows.append(_row("e2b client: `1+1`", _time(lambda: sbx.run_code("1+1"), runs * 10)))
    finally:
        sbx.kill()
    return rows


_BARE_APP = """
import sys, uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson")]})
    await send({"type": "http.response.body", "more_body": True,
                "body": b'{"type": "result", "text": "2", "is_main_result": true}\\n'})
    await send({"type": "http.response.body",
                "body": b'{"type": "number_of_executions", "execution_count": 1}\\n'})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _floor_rows(url: str, key: str, runs: int) -> list[str]:
    """httpx and the E2B client against a bare ASGI app (see the module docstring)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bare = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-c", _BARE_APP, str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(f"{bare}/execute", json={})
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    return [_row("HTTP floor (the bare app did not start)", [])]
                time.sleep(0.05)
        rows = []
        with httpx.Client() as client:

            def raw() -> None:
                with client.stream("POST", f"{bare}/execute", json={"code": "1+1"}) as response:
                    for _ in response.iter_lines():
                        pass

            rows.append(_row("HTTP floor: httpx, POST /execute", _time(raw, runs * 10)))
        try:
            from e2b_code_interpreter import Sandbox as E2BSandbox
        except ImportError:
            return rows
        # Created on the server (its control plane), then every call for the sandbox
        # goes to the bare app.
        sbx = E2BSandbox.create(api_key=key, api_url=url, sandbox_url=bare)
        try:
            rows.append(
                _row("HTTP floor: e2b client, `1+1`", _time(lambda: sbx.run_code("1+1"), runs * 10))
            )
        finally:
            E2BSandbox.kill(sbx.sandbox_id, api_key=key, api_url=url)
        return rows
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
