"""A throwaway PostgreSQL server for tests: initdb in a temporary directory, a Unix
socket only (no TCP), stopped and removed afterwards."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def postgres(database: str, *, prefix: str, settings: str = "") -> Iterator[str]:
    """Yield a SQLAlchemy URL for ``database`` on a fresh server; ``settings``: more
    ``-c name=value`` server options."""
    bindir = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])
    # Not under pytest's tmp_path: PostgreSQL refuses to run as root, and its user
    # must be able to reach the directory.
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)
    as_user: list[str] = []
    if os.getuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres", "postgres")
    data, sock = base / "data", base / "sock"

    def run(*argv: str | Path) -> None:
        subprocess.run([*as_user, *map(str, argv)], check=True, capture_output=True, timeout=120)

    run("mkdir", sock)
    run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "sandlot")
    options = f"-k {sock} -c listen_addresses='' {settings}".strip()
    run(bindir / "pg_ctl", "-D", data, "-o", options, "-l", base / "log", "-w", "start")
    try:
        run(bindir / "createdb", "-h", sock, "-U", "sandlot", database)
        yield f"postgresql+psycopg://sandlot@/{database}?host={sock}"
    finally:
        run(bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)
