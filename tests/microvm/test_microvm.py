"""The microvm backend against real QEMU guests (TCG here; KVM where it boots).

One VM serves the module (restored from the backend's snapshot, the default; one test
boots cold); tests that kill a sandbox start their own. What is checked inside the VM
is what makes sense for a VM: no network device (a connect fails), a read-only root
file system, none of the host's files, and
processes that are the guest's, not the host's. Without QEMU or the guest image the
backend refuses to start, naming scripts/setup-vm.sh (no VM needed to check that).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import BackendUnavailable, IsolationUnavailable, Sandbox
from sandlot.backends.microvm import MicroVMBackend, MicroVMHandle
from sandlot.backends.microvm._qemu import default_machine, host_tsc_khz, qemu_argv
from sandlot.backends.microvm._snapshot import snapshot_key
from sandlot.policy import NetworkPolicy, Resources, SandboxSpec

GONE_WITHIN = 30.0


@pytest.fixture(scope="module")
def vm() -> Iterator[Sandbox]:
    sandbox = Sandbox(backend=MicroVMBackend(), timeout=900)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _handle(sandbox: Sandbox) -> MicroVMHandle:
    handle = sandbox._core._handle
    assert isinstance(handle, MicroVMHandle)
    return handle


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return False


# --- without a VM --------------------------------------------------------------------
def test_missing_image_fails_closed_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_MICROVM_DIR", str(tmp_path))
    probe = MicroVMBackend.probe()
    assert not probe.available
    with pytest.raises(BackendUnavailable, match=r"setup-vm\.sh"):
        MicroVMBackend().start(SandboxSpec())


def test_missing_qemu_fails_closed_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDLOT_QEMU", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    probe = MicroVMBackend.probe()
    assert not probe.available and "setup-vm.sh" in probe.fix
    with pytest.raises(BackendUnavailable, match="QEMU"):
        MicroVMBackend().start(SandboxSpec())


def test_network_policy_is_refused_when_booted_cold() -> None:
    # A cold VM's pid 1 is uid 1000 before it could open the egress port.
    spec = SandboxSpec(network=NetworkPolicy(allow_out=["example.com"]))
    with pytest.raises(IsolationUnavailable, match="network policy"):
        MicroVMBackend(snapshot=False).start(spec)


def test_command_line_has_no_network_device_and_a_read_only_root() -> None:
    spec = SandboxSpec(resources=Resources(memory_mb=512, cpus=1.0, disk_mb=100, tmp_mb=50))
    argv = qemu_argv(
        "qemu", spec, kernel=Path("k"), initrd=Path("i"), image=Path("img"),
        channel_fd=7, accel="tcg",
    )  # fmt: skip
    assert "-nodefaults" in argv and "-no-user-config" in argv
    assert not {"-net", "-netdev", "-nic"} & set(argv)
    # The egress port is always there (one snapshot for all) and leads nowhere by default.
    assert "null,id=egress" in argv
    assert not any("net" in a for a in argv if a.startswith(("virtio-net", "e1000")))
    assert "id=root,file=img,format=raw,if=none,readonly=on" in argv
    assert argv[argv.index("-m") + 1] == f"{512 + 256}M"
    assert argv[argv.index("-monitor") + 1] == "none"
    append = argv[argv.index("-append") + 1]
    assert "sandlot.disk_mb=100" in append and "sandlot.tmp_mb=50" in append


def test_restored_vms_use_the_microvm_machine_cold_boots_under_tcg_q35() -> None:
    # A restore does not boot: the microvm machine loads its state about twice as fast
    # under TCG (docs/microvm.md); a cold boot under TCG is faster on q35.
    assert default_machine("tcg", snapshot=True) == "microvm"
    assert default_machine("tcg", snapshot=False) == "q35"
    assert default_machine("kvm", snapshot=False) == "microvm"


def test_snapshot_key_ignores_the_clock_hint_only() -> None:
    # The host's cpu MHz can move with its frequency; a new key would mean a new
    # template boot (a minute under TCG) for the same VM.
    spec = SandboxSpec()
    argv = qemu_argv(
        "qemu", spec, kernel=Path("k"), initrd=Path("i"), image=Path("img"),
        channel_fd=7, accel="tcg", machine="microvm", template=True,
    )  # fmt: skip
    append = argv.index("-append") + 1
    assert "tsc_early_khz=" in argv[append] or host_tsc_khz() is None

    def with_append(text: str) -> list[str]:
        return [*argv[:append], text, *argv[append + 1 :]]

    key = snapshot_key(sys.executable, with_append("quiet tsc_early_khz=2596148 x=1"), ())
    assert key == snapshot_key(sys.executable, with_append("quiet tsc_early_khz=2600001 x=1"), ())
    assert key != snapshot_key(sys.executable, with_append("quiet tsc_early_khz=2596148 x=2"), ())


# --- in a VM ---------------------------------------------------------------------------
@pytest.mark.requires_microvm
@pytest.mark.slow
class TestInVM:
    def test_run_code_returns_results_and_state_persists(self, vm: Sandbox) -> None:
        first = vm.run_code("import pandas as pd\ntotal = int(pd.Series([1, 2, 3]).sum())\ntotal")
        assert first.error is None, first.error
        assert first.text == "6"
        again = vm.run_code("total * 7")
        assert again.error is None and again.text == "42"

    def test_cell_timeout_interrupts_and_the_vm_goes_on(self, vm: Sandbox) -> None:
        hung = vm.run_code("import time\ntime.sleep(600)", timeout=3)
        assert hung.error is not None
        assert vm.run_code("1 + 1").text == "2"

    def test_no_network_device_a_connect_fails(self, vm: Sandbox) -> None:
        result = vm.run_code(
            "import os, socket\n"
            "links = sorted(os.listdir('/sys/class/net'))\n"
            "try:\n"
            "    socket.create_connection(('10.0.2.2', 80), timeout=3)\n"
            "    outcome = 'connected'\n"
            "except OSError as exc:\n"
            "    outcome = type(exc).__name__ + ' ' + str(exc.errno)\n"
            "(links, outcome)"
        )
        assert result.error is None, result.error
        assert result.text is not None
        assert "['lo']" in result.text
        assert "connected" not in result.text.split(",")[-1]

    def test_root_file_system_is_read_only(self, vm: Sandbox) -> None:
        result = vm.run_code(
            "import errno, subprocess\n"
            "try:\n"
            "    open('/usr/sandlot-escape', 'w')\n"
            "    wrote = True\n"
            "except OSError as exc:\n"
            "    wrote = exc.errno\n"
            "remount = subprocess.run(['mount', '-o', 'remount,rw', '/'], capture_output=True)\n"
            "(wrote == errno.EROFS, remount.returncode != 0)"
        )
        assert result.error is None, result.error
        assert result.text == "(True, True)"

    def test_home_and_tmp_are_writable_and_sized(self, vm: Sandbox) -> None:
        result = vm.run_code(
            "import os\n"
            "open('/home/user/a', 'w').write('x'); open('/tmp/b', 'w').write('y')\n"
            "s = os.statvfs('/home/user')\n"
            "s.f_blocks * s.f_frsize // 2**20"
        )
        assert result.error is None, result.error
        assert result.text == str(Resources().disk_mb)

    def test_host_files_are_not_visible(self, vm: Sandbox, tmp_path: Path) -> None:
        marker = tmp_path / f"host-secret-{uuid.uuid4().hex}"
        marker.write_text("host only")
        here = str(Path(__file__).resolve())
        result = vm.run_code(
            f"import os\n[os.path.exists(p) for p in ({str(marker)!r}, {here!r}, '/work', '/root')]"
        )
        assert result.error is None, result.error
        assert result.text == "[False, False, False, False]"

    def test_processes_are_the_guests_not_the_hosts(self, vm: Sandbox) -> None:
        result = vm.run_code(
            "import os\n"
            "cmds = []\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            "        cmds.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
            "    except OSError:\n"
            "        pass\n"
            "(len(cmds), any(b'pytest' in c or b'qemu' in c for c in cmds), os.getuid())"
        )
        assert result.error is None, result.error
        assert result.text is not None
        count, host_seen, uid = result.text.strip("()").split(", ")
        # The guest kernel's threads and the sandbox's own processes only: the host's
        # pytest (and QEMU itself) run outside the VM.
        assert host_seen == "False"
        assert uid == "1000"
        assert int(count) < 200
        assert os.getpid() > 0

    def test_a_cold_boot_runs_code_as_uid_1000(self) -> None:
        # snapshot=False: the VM boots (no saved state), its init drops to uid 1000.
        with Sandbox(backend=MicroVMBackend(snapshot=False), timeout=600) as sandbox:
            result = sandbox.run_code("import os\n(os.getuid(), 6 * 7)")
            assert result.error is None, result.error
            assert result.text == "(1000, 42)"

    def test_killing_the_sandbox_kills_qemu(self) -> None:
        sandbox = Sandbox(backend=MicroVMBackend(), timeout=600)
        handle = _handle(sandbox)
        token = handle.recovery_token()
        assert token is not None
        pid = token["pid"]
        assert Path(f"/proc/{pid}").exists()
        sandbox.kill()
        assert _gone(pid)
        assert not MicroVMBackend.reap(token)  # nothing left to reap

    def test_sigkill_of_the_owner_ends_its_vm(self, tmp_path: Path) -> None:
        # The owner's end of the channel closes with it; the runner (pid 1 in the guest)
        # sees the end of its channel and exits, and with it the guest and QEMU.
        owner_code = textwrap.dedent(
            """
            from sandlot import Sandbox
            from sandlot.backends.microvm import MicroVMBackend
            sbx = Sandbox(backend=MicroVMBackend(), timeout=600)
            print("qemu", sbx._core._handle.recovery_token()["pid"], flush=True)
            import time
            time.sleep(600)
            """
        )
        with subprocess.Popen(
            [sys.executable, "-c", owner_code], stdout=subprocess.PIPE, cwd=tmp_path
        ) as owner:
            assert owner.stdout is not None
            line = owner.stdout.readline().decode()
            assert line.startswith("qemu "), line
            pid = int(line.split()[1])
            assert Path(f"/proc/{pid}").exists()
            owner.send_signal(signal.SIGKILL)
            owner.wait()
        assert _gone(pid), "QEMU outlived its owner"
