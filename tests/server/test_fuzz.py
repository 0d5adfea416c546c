"""Schemathesis fuzzes a real server from the checked-in OpenAPI document: no 5xx.

Bounded (examples per operation, a time budget, a fixed seed) so CI stays fast. The
tenant's quotas keep the sandboxes it can create few; everything else it sends is
malformed or aimed at sandboxes that do not exist, and must be a clean 4xx.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


@pytest.mark.timeout(900)
def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "state",
        "--max-sandboxes",
        "2",
        "--creates-per-minute",
        "20",
        "--idle-ttl",
        "30",
    ).start()
    try:
        key = server.key("fuzzer")
        done = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"),
                "run",
                str(OPENAPI),
                "--url",
                server.url,
                "--header",
                f"Authorization: Bearer {key}",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "5",
                "--seed",
                "20261122",
                # One worker: CPython 3.11's ast module is not thread-safe (a spurious
                # "AST constructor recursion depth mismatch" SystemError, CPython
                # gh-106905) and hypothesis parses lambdas with it from each worker.
                "--workers",
                "1",
                "--max-time",
                "150",
                "--request-timeout",
                "120",
                "--suppress-health-check",
                "all",
                # A background process's stream lasts as long as the process: a generated
                # terminal (pty) or timeout=0 command legitimately outlives any request
                # timeout. tests/server/test_processes.py covers these two routes.
                "--exclude-operation-id",
                "start_process_v1_sandboxes__sandbox_id__processes_post",
                "--exclude-operation-id",
                "connect_process_v1_sandboxes__sandbox_id__processes__pid__get",
                # A watch streams until its client leaves (tests/server/test_watch.py).
                "--exclude-operation-id",
                "watch_dir_v1_sandboxes__sandbox_id__files_watch_post",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=800,
            cwd=tmp_path,
        )
    finally:
        server.stop()
    report = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "Traceback" not in server.log(), server.log()[-6000:]
