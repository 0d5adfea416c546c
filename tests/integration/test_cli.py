"""The sandlot CLI, run as a real subprocess against the real backend."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sandlot(
    *args: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandlot", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        input=stdin,
        timeout=180,
    )


def run_json(*args: str, cwd: Path | None = None) -> dict[str, object]:
    result = sandlot("run", "--json", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one JSON object, got: {result.stdout!r}"
    outcome = json.loads(lines[0])
    assert isinstance(outcome, dict)
    return outcome


def test_json_success_has_the_documented_fields() -> None:
    outcome = run_json("-c", "print('hello'); import sys; print('warn', file=sys.stderr); 6 * 7")
    assert outcome["stdout"] == "hello\n"
    assert outcome["stderr"] == "warn\n"
    assert outcome["error"] is None
    assert outcome["timed_out"] is False
    assert isinstance(outcome["duration_ms"], (int, float)) and outcome["duration_ms"] > 0
    results = outcome["results"]
    assert isinstance(results, list)
    assert results == [{"is_main_result": True, "text": "42"}]


def test_json_user_error_is_data_and_exit_zero() -> None:
    outcome = run_json("-c", "print('before'); 1/0")
    assert outcome["stdout"] == "before\n"
    error = outcome["error"]
    assert isinstance(error, dict)
    assert error["name"] == "ZeroDivisionError"
    assert "1/0" in str(error["traceback"])


def test_json_timeout_is_reported() -> None:
    outcome = run_json("--timeout", "1", "-c", "import time\nwhile True: time.sleep(0.01)")
    assert outcome["timed_out"] is True
    error = outcome["error"]
    assert isinstance(error, dict) and error["name"] == "TimeoutError"


def test_json_memory_limit_applies() -> None:
    outcome = run_json("--memory", "256", "-c", "x = bytearray(512 * 1024 * 1024)")
    error = outcome["error"]
    assert isinstance(error, dict) and error["name"] == "OutOfMemoryError"


def test_uploads_file_and_runs_a_script_file(tmp_path: Path) -> None:
    data = tmp_path / "numbers.csv"
    data.write_text("n\n1\n2\n3\n")
    script = tmp_path / "job.py"
    script.write_text("import pandas as pd\nprint(pd.read_csv('in/numbers.csv').n.sum())\n")
    outcome = run_json(str(script), "--file", f"{data}:in/numbers.csv")
    assert outcome["error"] is None, outcome
    assert outcome["stdout"] == "6\n"


def test_text_mode_saves_images_and_exits_one_on_error(tmp_path: Path) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nprint('drawn')"
    result = sandlot("run", "-c", code, "--out", str(tmp_path / "charts"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "drawn" in result.stdout
    images = list((tmp_path / "charts").glob("*.png"))
    assert len(images) == 1
    assert images[0].read_bytes().startswith(PNG_MAGIC)
    failed = sandlot("run", "-c", "raise ValueError('boom')", cwd=tmp_path)
    assert failed.returncode == 1
    assert "ValueError: boom" in failed.stderr


def test_json_png_result_is_base64_png() -> None:
    outcome = run_json("-c", "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])")
    results = outcome["results"]
    assert isinstance(results, list)
    pngs = [r["png"] for r in results if isinstance(r, dict) and "png" in r]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)


def test_stdin_code() -> None:
    result = sandlot("run", "--json", "-", stdin="print(2 + 3)")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stdout"] == "5\n"


def test_usage_errors_exit_two() -> None:
    result = sandlot("run")
    assert result.returncode == 2
    assert "exactly one of FILE or -c CODE" in result.stderr


def test_doctor_reports_layers() -> None:
    result = sandlot("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # bwrap first (the strongest); container engines follow where they answer. "auto"
    # starts bwrap's sandboxes through its fast path, the zygote.
    assert report["backends_available"][0] == "bwrap"
    assert report["auto"] == "zygote"
    names = {check["name"] for check in report["checks"]}
    assert {"backend bwrap", "backend docker", "backend podman", "cgroups", "seccomp"} <= names
    assert report["cgroup_version"] in ("v1", "v2", "hybrid", "none")
    status = {check["name"]: check["status"] for check in report["checks"]}
    assert status["cgroups"] == "ok" and status["seccomp"] == "ok", report
    text = sandlot("doctor")
    assert text.returncode == 0
    assert "usable backends: bwrap" in text.stdout


def test_template_list() -> None:
    result = sandlot("template", "list")
    assert result.returncode == 0
    assert "python-data" in result.stdout and "built" in result.stdout
