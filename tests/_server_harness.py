"""A real ``sandlot serve`` subprocess on loopback, for tests (no in-process fakes).

The server binds port 0 and the harness reads the port it got from its log, so
parallel runs never race for a port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT = 120.0
"""Generous: the machine is shared and may be busy."""


class ServerProcess:
    """``sandlot serve`` with its own state directory; start(), key(), stop()."""

    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.args = args
        self.extra_env = env or {}
        self.log_path = state_dir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOT_API_")}
        env["SANDLOT_SERVER_DIR"] = str(self.state_dir)
        env.update(self.extra_env)
        return env

    def start(self) -> ServerProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sandlot", "serve", "--port", "0", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sandlot serve exited early:\n{self.log()}")
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                match = re.search(rb"running on (http://127\.0\.0\.1:\d+)", handle.read())
            if match:
                self.url = match.group(1).decode()
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sandlot serve did not come up:\n{self.log()}")

    def e2b_opts(self, key: str) -> dict[str, str]:
        """The E2B SDK's arguments for this server in E2B's normal mode (what a user sets
        as ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``)."""
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": key}

    def e2b_create(self, key: str, timeout: int = 120) -> tuple[str, str]:
        """A sandbox through E2B's control plane, as the E2B SDK makes one over raw HTTP:
        (sandbox id, envd access token)."""
        made = httpx.post(
            f"{self.url}/sandboxes",
            json={"templateID": "base", "timeout": timeout},
            headers={"X-API-Key": key},
            timeout=120,
        )
        assert made.status_code == 201, made.text
        body = made.json()
        return body["sandboxID"], body["envdAccessToken"]

    def key(self, tenant: str, *args: str) -> str:
        """A new API key for ``tenant`` from ``sandlot keys create`` (last line of stdout)."""
        done = subprocess.run(
            [sys.executable, "-m", "sandlot", "keys", "create", "--tenant", tenant, *args],
            capture_output=True,
            text=True,
            env=self._env(),
            check=True,
            timeout=120,
        )
        return done.stdout.strip().splitlines()[-1]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sandlot", *args],
            capture_output=True,
            text=True,
            env=self._env(),
            check=True,
            timeout=120,
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        code = self.process.returncode
        self.process = None
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
