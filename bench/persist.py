"""Pause, resume and fork of a session holding a 100 MB DataFrame, beside what a user
does without them: start afresh and run the setup again ("replay").

The session: a checkpointable sandbox that ran ``SETUP`` (pandas and numpy imported, a
DataFrame of 1,638,400 x 8 float64, 104.9 MB). Rows, p50 / p90 over ``--runs``:

* ``pause()``: the call's wall time (CRIU dumps the session, the sandbox ends);
* ``resume -> first result``: ``connect()`` then ``run_code("df.shape")`` answering
  (the ``connect()`` part alone in its own row);
* the same two with the DataFrame also saved in ``/home/user`` (``np.save``, 104.9 MB;
  ``--no-home`` skips them): CRIU archives the home tmpfs with tar and gzip;
* ``create_snapshot()`` (a dump, then the session restored from it to carry on) and
  ``Sandbox.create(snapshot)`` -> first result (one copy);
* ``fork(n)``: the call's wall time (a snapshot of the parent, the parent restored from
  it, ``n`` copies restored in parallel threads) and that divided by ``n`` ("per
  copy"); then each copy's first ``run_code("df.shape")``;
* the baselines, measured in the same run: ``replay, checkpointable``: a new
  ``Sandbox(checkpointable=True)`` (a bubblewrap cold start), ``SETUP`` and
  ``df.shape`` answering; ``replay, Sandbox()``: the same from a default (zygote)
  sandbox;
* sizes (MB): the checkpoint's ``images`` directory on disk, its ``pages-*.img`` (the
  memory) part, the session's private memory before the pause (Private_Clean +
  Private_Dirty in ``/proc/<pid>/smaps_rollup`` of each of its processes), and the bytes
  in the session's ``/home/user`` and ``/tmp``;
* compression of the ``pages-*.img`` files of the first run's checkpoint (CRIU writes
  them raw): ``zstd -1``, ``zstd -3``, ``lz4`` and ``gzip -1`` of the same bytes, size
  and time, one thread each (``--no-compress`` skips them).

The last lines check what the run left behind: checkpoints in the store, processes of
the sandboxes it started or restored, root directories its restores built (seen
through an internal hook, ``_checkpoint.build_root``).

Every timed pause, snapshot or fork starts from a session set up afresh: a sandbox
restored from a checkpoint cannot be checkpointed again on this CRIU (the dump fails
with "Can't open <pid>/ns/net on procfs: Permission denied"). Needs root, CRIU
(``sandlot doctor``), the python-data template. The checkpoint store is a fresh 0711
directory under ``/var/tmp`` unless ``$SANDLOT_CHECKPOINT_DIR`` is set::

    .venv/bin/python bench/persist.py                 # --runs 5: one to two minutes
    .venv/bin/python bench/persist.py --runs 10 --json out.json --out report.md

Numbers on a shared 2-core machine are noisy: read them next to the load average.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sandlot
from sandlot import Sandbox
from sandlot.backends import _checkpoint
from sandlot.backends.bwrap._host import BwrapHandle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import pct

ROWS = 1_638_400
"""DataFrame rows: x 8 float64 columns = 100 MiB."""
SETUP = (
    "import pandas as pd, numpy as np\n"
    f"df = pd.DataFrame(np.random.rand({ROWS}, 8))\n"
    "int(df.memory_usage(index=False).sum())"
)
PROBE = "df.shape"
ANSWER = f"({ROWS}, 8)"
SIZE_CODE = (
    "import os\n"
    "sum(os.path.getsize(os.path.join(d, f)) for top in ('/home/user', '/tmp')"
    " for d, _, fs in os.walk(top) for f in fs if os.path.isfile(os.path.join(d, f)))"
)
MB = 1e6
COMPRESSORS = {
    "zstd -1": ["zstd", "-1", "-c", "-q", "-T1"],
    "zstd -3": ["zstd", "-3", "-c", "-q", "-T1"],
    "lz4": ["lz4", "-1", "-c", "-q"],
    "gzip -1": ["gzip", "-1", "-c"],
}


def _ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def _probe(sbx: Sandbox) -> None:
    execution = sbx.run_code(PROBE)
    if execution.text != ANSWER:
        raise RuntimeError(f"df.shape answered {execution.text!r} ({execution.error})")


def _set_up(**kwargs: Any) -> Sandbox:
    sbx = _track(Sandbox(timeout=600, **kwargs))
    execution = sbx.run_code(SETUP)
    if execution.error is not None:
        sbx.kill()
        raise RuntimeError(f"setup failed: {execution.error}")
    return sbx


def _replay(**kwargs: Any) -> float:
    """A new sandbox, SETUP, df.shape answering, in ms (the kill is not counted)."""
    started = time.perf_counter()
    sbx = _set_up(**kwargs)
    _probe(sbx)
    elapsed = (time.perf_counter() - started) * 1000
    sbx.kill()
    return elapsed


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (processes, not threads)."""
    out, todo = [], [pid]
    while todo:
        one = todo.pop()
        out.append(one)
        for task in Path(f"/proc/{one}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def _private_bytes(sbx: Sandbox) -> int:
    """Private_Clean + Private_Dirty of the sandbox's processes (bubblewrap's own
    process outside the sandbox excluded)."""
    handle = sbx.handle
    if not isinstance(handle, BwrapHandle):
        raise RuntimeError("not a running bubblewrap sandbox")
    total = 0
    for pid in _tree(int(handle.process.pid)):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "bwrap":
                continue
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def _images(store: Path, checkpoint_id: str) -> tuple[int, int, list[Path]]:
    """(bytes on disk of the images dir, bytes of its pages-*.img, those files)."""
    images = store / checkpoint_id / "images"
    disk = sum(p.stat().st_blocks * 512 for p in images.rglob("*") if p.is_file())
    pages = sorted(images.glob("pages-*.img"))
    return disk, sum(p.stat().st_size for p in pages), pages


def _compress(pages: list[Path], scratch: Path) -> dict[str, dict[str, Any]]:
    """Each compressor over the pages files: output bytes and wall ms (one run each)."""
    out: dict[str, dict[str, Any]] = {}
    raw = sum(p.stat().st_size for p in pages)
    for name, argv in COMPRESSORS.items():
        if shutil.which(argv[0]) is None:
            continue
        target = scratch / "out"
        size = 0
        started = time.perf_counter()
        for page in pages:
            with target.open("wb") as f:
                subprocess.run([*argv, str(page)], stdout=f, check=True)
            size += target.stat().st_size
        ms = (time.perf_counter() - started) * 1000
        decompress = [*argv[:1], "-d", "-c"] + (["-q"] if argv[0] != "gzip" else [])
        started = time.perf_counter()
        with target.open("rb") as f:
            subprocess.run(decompress, stdin=f, stdout=subprocess.DEVNULL, check=True)
        # one file decompressed (the last, the heap's): scaled to all pages by size
        back = (time.perf_counter() - started) * 1000 * raw / max(1, pages[-1].stat().st_size)
        target.unlink()
        out[name] = {"bytes": size, "ms": ms, "decompress_ms": back, "ratio": raw / max(1, size)}
    return out


def _started(pid: int) -> str | None:
    """The start time of ``pid`` (field 22 of its stat), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


SEEN: dict[int, str] = {}
"""Every process of every sandbox this run started or restored: pid -> start time."""
ROOTS_MADE: list[str] = []
"""The root directories restores in this process built (/run/sandlot/roots/<hex>)."""


def _track(sbx: Sandbox) -> Sandbox:
    handle = sbx.handle
    if isinstance(handle, BwrapHandle):
        for pid in _tree(int(handle.process.pid)):
            started = _started(pid)
            if started is not None:
                SEEN[pid] = started
    return sbx


def _record_roots() -> None:
    """Note each root directory a restore builds (sandlot's internal hook, for the
    left-behind rows only)."""
    build = _checkpoint.build_root

    def recording(points: Any, root: str) -> None:
        ROOTS_MADE.append(root)
        build(points, root)

    _checkpoint.build_root = recording


def _left_behind() -> tuple[list[int], list[str]]:
    """This run's sandbox processes still running, and its restores' roots still there."""
    alive = [pid for pid, started in SEEN.items() if _started(pid) == started]
    return alive, [root for root in ROOTS_MADE if os.path.exists(root)]


HOME_CODE = "np.save('/home/user/df.npy', df.values)"
COMPRESSION_INPUT: list[Path] = []


def _pause_resume(
    store: Path,
    rows: dict[str, list[float]],
    sizes: dict[str, list[float]],
    suffix: str,
    compress: bool,
) -> None:
    """A fresh session (which also runs ``HOME_CODE`` when ``suffix``): its sizes, then
    pause() and resume -> first result, timed. The first memory-only checkpoint's
    pages files are kept (hard links beside the store) in ``COMPRESSION_INPUT``."""
    sbx = _set_up(checkpointable=True)
    try:
        if suffix:
            sbx.run_code(HOME_CODE)
        else:
            sizes["session private memory"].append(_private_bytes(sbx) / MB)
        sizes["home + /tmp files" + suffix].append(int(sbx.run_code(SIZE_CODE).text or 0) / MB)
        rows["pause()" + suffix].append(_ms(sbx.pause))
        disk, pages, files = _images(store, sbx.sandbox_id)
        sizes["checkpoint images on disk" + suffix].append(disk / MB)
        sizes["  of which pages-*.img" + suffix].append(pages / MB)
        if not suffix and not COMPRESSION_INPUT and compress:
            for page in files:
                link = store.parent / f".{store.name}-{page.name}"
                os.link(page, link)
                COMPRESSION_INPUT.append(link)
        started = time.perf_counter()
        sbx.connect()
        _track(sbx)
        rows["resume: connect()" + suffix].append((time.perf_counter() - started) * 1000)
        _probe(sbx)
        rows["resume -> first result" + suffix].append((time.perf_counter() - started) * 1000)
    finally:
        sbx.kill()


def measure(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    home = ", + df.npy in /home/user" if args.home else ""
    names = ["pause()", "resume: connect()", "resume -> first result"]
    rows: dict[str, list[float]] = {name: [] for name in names}
    rows |= {name + home: [] for name in names if home}
    rows |= {
        name: []
        for name in (
            "replay, checkpointable",
            "replay, Sandbox()",
            "create_snapshot()",
            "Sandbox.create(snapshot) -> first result",
            "fork(1)",
            "fork(1) copy first result",
            f"fork({args.fork})",
            f"fork({args.fork}) per copy",
            f"fork({args.fork}) copy first result",
        )
    }
    sizes: dict[str, list[float]] = {"session private memory": []}
    for suffix in ["", home] if home else [""]:
        for name in ("checkpoint images on disk", "  of which pages-*.img", "home + /tmp files"):
            sizes[name + suffix] = []
    extra: dict[str, Any] = {"errors": []}
    _replay()  # the zygote starts in the background after the first default sandbox
    time.sleep(args.settle)
    _record_roots()
    for _ in range(args.runs):
        rows["replay, Sandbox()"].append(_replay())
        rows["replay, checkpointable"].append(_replay(checkpointable=True))
        _pause_resume(store, rows, sizes, "", args.compress)
        if home:
            _pause_resume(store, rows, sizes, home, args.compress)

        parent = _set_up(checkpointable=True)
        try:
            started = time.perf_counter()
            snapshot = parent.create_snapshot()
            rows["create_snapshot()"].append((time.perf_counter() - started) * 1000)
            _track(parent)
        finally:
            parent.kill()
        try:
            started = time.perf_counter()
            copy = _track(Sandbox.create(snapshot.snapshot_id, timeout=600))
            try:
                _probe(copy)
                elapsed = (time.perf_counter() - started) * 1000
                rows["Sandbox.create(snapshot) -> first result"].append(elapsed)
            finally:
                copy.kill()
        finally:
            Sandbox.delete_snapshot(snapshot.snapshot_id)

        for count in (1, args.fork):
            parent = _set_up(checkpointable=True)
            copies: list[Sandbox | Exception] = []
            try:
                started = time.perf_counter()
                copies = parent.fork(count=count)
                elapsed = (time.perf_counter() - started) * 1000
                failed = [c for c in copies if isinstance(c, Exception)]
                if failed:
                    extra["errors"].append(f"fork({count}): {failed[0]!r}"[:300])
                    continue
                rows[f"fork({count})"].append(elapsed)
                if count > 1:
                    rows[f"fork({count}) per copy"].append(elapsed / count)
                _track(parent)
                for one in copies:
                    if isinstance(one, Sandbox):
                        _track(one)
                        first = _ms(functools.partial(_probe, one))
                        rows[f"fork({count}) copy first result"].append(first)
            finally:
                for one in copies:
                    if isinstance(one, Sandbox):
                        one.kill()
                parent.kill()
    try:
        if args.compress and COMPRESSION_INPUT:
            raw = sum(p.stat().st_size for p in COMPRESSION_INPUT)
            with tempfile.TemporaryDirectory(dir=store.parent) as scratch:
                extra["compression"] = {"raw": raw, **_compress(COMPRESSION_INPUT, Path(scratch))}
    finally:
        for link in COMPRESSION_INPUT:
            link.unlink(missing_ok=True)
    # killed sandboxes' processes are reaped within a few seconds
    deadline = time.monotonic() + 10
    while _left_behind()[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    alive, roots = _left_behind()
    extra["left behind"] = {
        "checkpoints in the store": len([p for p in store.iterdir() if not p.name.startswith(".")]),
        f"sandbox processes still running (of {len(SEEN)} seen)": len(alive),
        f"restored sandboxes' root dirs still there (of {len(ROOTS_MADE)} made)": len(roots),
    }
    return {"ms": rows, "MB": sizes, "extra": extra}


def _p(values: list[float], p: float) -> str:
    return f"{pct(values, p):.1f}" if values else "-"


TARGETS = {
    "pause()": "<= 300",
    "resume -> first result": "<= 200",
    "fork(1)": "<= 200 per copy",
}


def report(result: dict[str, Any], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    ms, sizes, extra = result["ms"], result["MB"], result["extra"]
    lines = [
        f"`{meta['command']}`; {meta['date']}, {meta['host']}, {os.cpu_count()} cores, "
        f"kernel {platform.release()}, load {meta['load_start'][0]:.2f} -> "
        f"{meta['load_end'][0]:.2f} (1-min avg; 5-min {meta['load_end'][1]:.2f}); sandlot "
        f"from {meta['sandlot']}; {meta['criu']}",
        "",
        f"Session: `{SETUP.splitlines()[1]}` ({ROWS * 8 * 8 / MB:.1f} MB of float64) after "
        "`import pandas as pd, numpy as np`.",
        "",
        "| row (ms) | p50 | p90 | n | target |",
        "|---|---|---|---|---|",
    ]
    fork_n = f"fork({args.fork}) per copy"
    targets = {**TARGETS, fork_n: "<= 200"}
    for name, values in ms.items():
        lines.append(
            f"| {name} | {_p(values, 50)} | {_p(values, 90)} | {len(values)} "
            f"| {targets.get(name, '')} |"
        )
    lines += ["", "| size (MB) | p50 | p90 | n |", "|---|---|---|---|"]
    for name, values in sizes.items():
        lines.append(f"| {name} | {_p(values, 50)} | {_p(values, 90)} | {len(values)} |")
    compression = extra.get("compression")
    if compression:
        raw = compression["raw"]
        lines += [
            "",
            f"Compressing the first run's pages-*.img ({raw / MB:.1f} MB), one thread:",
            "",
            "| tool | MB | ratio | compress ms | decompress ms (est.) |",
            "|---|---|---|---|---|",
        ]
        for name, row in compression.items():
            if name == "raw":
                continue
            lines.append(
                f"| {name} | {row['bytes'] / MB:.1f} | {row['ratio']:.2f} | {row['ms']:.0f} "
                f"| {row['decompress_ms']:.0f} |"
            )
    lines += ["", "Left behind after the run:", ""]
    lines += [f"* {k}: {v}" for k, v in extra["left behind"].items()]
    for error in extra["errors"]:
        lines.append(f"* error: {error}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (each row once)")
    parser.add_argument("--fork", type=int, default=4, help="copies in the second fork row")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the warm-up")
    parser.add_argument("--no-compress", dest="compress", action="store_false")
    parser.add_argument(
        "--no-home",
        dest="home",
        action="store_false",
        help="skip the pause/resume rows of a session that also saved its DataFrame in "
        "/home/user (np.save): CRIU archives a tmpfs with tar and gzip",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    args = parser.parse_args()
    own_store = "SANDLOT_CHECKPOINT_DIR" not in os.environ
    if own_store:
        path = Path(tempfile.mkdtemp(prefix="sandlot-bench-", dir="/var/tmp"))
        path.chmod(0o711)
        os.environ["SANDLOT_CHECKPOINT_DIR"] = str(path)
    store = Path(os.environ["SANDLOT_CHECKPOINT_DIR"])
    criu = subprocess.run(
        ["/usr/local/sbin/criu", "--version"], capture_output=True, text=True, check=False
    ).stdout.split("\n")[0]
    load = os.getloadavg()
    try:
        result = measure(args, store)
    finally:
        for link in COMPRESSION_INPUT:
            link.unlink(missing_ok=True)
        if own_store:
            shutil.rmtree(store, ignore_errors=True)
    meta = {
        "command": " ".join(["bench/persist.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "load_start": load,
        "load_end": os.getloadavg(),
        "sandlot": str(Path(sandlot.__file__).resolve().parent),
        "criu": f"CRIU {criu.removeprefix('Version: ')}" if criu else "CRIU version unknown",
    }
    text = report(result, args, meta)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({**result, "_meta": meta}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
