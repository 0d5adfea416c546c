"""Benign controls: what ordinary data-analysis code does must keep working.

A sandbox that refused everything (no processes, no sockets, no files, no native code)
would pass every escape test; these make the suite fail for it. Each control mirrors an
escape category: loopback networking inside (network), workspace files and symlinks
(filesystem), subprocesses and threads (privilege/resources), native calls through
ctypes (Python tricks), and the data stack itself.
"""

from __future__ import annotations

import pytest
from escape_helpers import cell_json, xfail_under_gvisor

from sandlot import Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]


def test_pandas_numpy_and_a_csv_upload(sandbox: Sandbox) -> None:
    sandbox.files.write("controls/sales.csv", "region,revenue\nnorth,10\nsouth,5\nnorth,7\n")
    execution = sandbox.run_code(
        "import numpy as np, pandas as pd\n"
        "df = pd.read_csv('controls/sales.csv')\n"
        "totals = df.groupby('region').revenue.sum()\n"
        "int(totals['north']), float(np.mean(df.revenue))"
    )
    assert execution.error is None, execution.error
    assert execution.text == "(17, 7.333333333333333)"
    table = sandbox.run_code("df")
    assert table.results[0].html and table.results[0].data is not None


def test_matplotlib_chart(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\n"
        "ax.bar(['a', 'b'], [3, 5])\n"
        "ax.set_title('控制 control')\n"
    )
    assert execution.error is None, execution.error
    charts = [r for r in execution.results if r.png]
    assert charts and charts[0].png.startswith("iVBOR")  # base64 of the PNG signature
    assert charts[0].chart is not None


def test_file_io_in_the_workspace(sandbox: Sandbox) -> None:
    outcome = cell_json(
        sandbox,
        """
import json, os, tempfile
os.makedirs("/home/user/controls/nested", exist_ok=True)
with open("/home/user/controls/nested/a.txt", "w") as handle:
    handle.write("workspace")
with tempfile.NamedTemporaryFile("w", dir="/tmp", delete=False) as handle:
    handle.write("tmp")
os.symlink("nested/a.txt", "/home/user/controls/link.txt")
print(json.dumps({"tmp": open(handle.name).read(),
                  "link": open("/home/user/controls/link.txt").read(),
                  "shm": os.access("/dev/shm", os.W_OK)}))
""",
    )
    assert outcome == {"tmp": "tmp", "link": "workspace", "shm": True}
    # The files API sees the same files, follows the in-workspace link, and writes.
    assert sandbox.files.read("controls/link.txt") == "workspace"
    assert [e.name for e in sandbox.files.list("controls/nested")] == ["a.txt"]
    sandbox.files.write("/tmp/controls-api.txt", b"\x00\x01")
    assert sandbox.files.read("/tmp/controls-api.txt", format="bytes") == b"\x00\x01"
    sandbox.files.rename("/tmp/controls-api.txt", "/tmp/controls-moved.bin")
    assert sandbox.files.exists("/tmp/controls-moved.bin")


def test_subprocesses_and_shell_commands(sandbox: Sandbox, request: pytest.FixtureRequest) -> None:
    xfail_under_gvisor(
        sandbox,
        request,
        "coreutils 9 (ls, stat, cp) fails under gVisor (runsc 20221219): it stats "
        "with AT_NO_AUTOMOUNT, which gVisor's statx and fstatat refuse with EINVAL. "
        "See docs/docker.md",
    )
    execution = sandbox.run_code(
        "import subprocess, sys\n"
        "subprocess.run(['ls', '/home/user'], capture_output=True, check=True).returncode, "
        "subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, "
        "text=True).stdout.strip()"
    )
    assert execution.error is None, execution.error
    assert execution.text == "(0, '42')"
    command = sandbox.commands.run("echo hello | tr a-z A-Z && python3 -c 'print(1 + 1)'")
    assert (command.stdout, command.exit_code) == ("HELLO\n2\n", 0)


def test_threads_and_process_pools(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "from concurrent.futures import ThreadPoolExecutor, ProcessPoolExecutor\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    threads = sum(pool.map(lambda n: n * n, range(100)))\n"
        "with ProcessPoolExecutor(2) as pool:\n"
        "    processes = sum(pool.map(abs, range(-10, 0)))\n"
        "threads, processes"
    )
    assert execution.error is None, execution.error
    assert execution.text == "(328350, 55)"


def test_loopback_networking_inside_the_sandbox(sandbox: Sandbox) -> None:
    # The network tests refuse everything outside; the sandbox's own loopback works.
    outcome = cell_json(
        sandbox,
        """
import json, socket, threading
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
def serve():
    connection, _ = server.accept()
    connection.sendall(connection.recv(100).upper())
    connection.close()
threading.Thread(target=serve).start()
client = socket.create_connection(server.getsockname(), timeout=5)
client.sendall(b"ping")
print(json.dumps(client.recv(100).decode()))
""",
    )
    assert outcome == "PING"


def test_ctypes_for_harmless_native_calls(sandbox: Sandbox) -> None:
    outcome = cell_json(
        sandbox,
        "import ctypes, json, os\n"
        "libc = ctypes.CDLL(None)\n"
        "print(json.dumps([libc.getpid() == os.getpid(), libc.abs(-5)]))",
    )
    assert outcome == [True, 5]
