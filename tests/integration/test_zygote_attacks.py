"""Attacks on what a zygote-made sandbox shares that a cold bubblewrap sandbox does not.

Every sandbox the zygote forks inherits the zygote's process (memory, descriptors,
working directory, session), its user namespace and whatever of its mount namespace
the fork does not replace. Each test here attacks one such inheritance from inside a
sandbox (or, where only the host can see it, from the host) and has a positive control
showing the attack works where it should, so a pass cannot come from a broken probe.
``tests/integration/test_zygote.py`` covers the rest (processes, files, IPC, network).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import Resources, Sandbox, SandboxStartError
from sandlot.backends.bwrap import _zygote
from sandlot.backends.bwrap._zygote import ZygoteBackend

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

TIMEOUT = 600


@pytest.fixture
def make() -> Iterator[Callable[..., Sandbox]]:
    started: list[Sandbox] = []

    def start(backend: str = "zygote", **kwargs: Any) -> Sandbox:
        sbx = Sandbox(backend=backend, timeout=TIMEOUT, **kwargs)
        started.append(sbx)
        return sbx

    try:
        yield start
    finally:
        for sbx in started:
            sbx.kill()


def _json(sbx: Sandbox, code: str) -> Any:
    execution = sbx.run_code(textwrap.dedent(code), timeout=60)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


def test_a_sibling_cannot_open_another_sandboxs_terminal(make: Callable[..., Sandbox]) -> None:
    """bubblewrap gives each sandbox its own devpts instance; a zygote-made sandbox
    inherited the zygote's, so every sibling saw (and, same uid, could open) every
    other's pseudo-terminals: read what was typed into them, write to their screens."""
    victim, attacker = make(), make()
    planted = _json(
        victim,
        """
        import json, os
        MASTER, SLAVE = os.openpty()
        os.write(MASTER, b"typed-secret\\n")  # input waiting for the program on the slave
        print(json.dumps({"tty": os.ttyname(SLAVE)}))
        """,
    )
    seen = _json(
        attacker,
        f"""
        import json, os
        out = {{"listing": sorted(os.listdir("/dev/pts")), "opened": {{}}}}
        for name in {{*out["listing"], {planted["tty"].rsplit("/", 1)[1]!r}}} - {{"ptmx"}}:
            try:
                fd = os.open("/dev/pts/" + name, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
            except OSError as exc:
                out["opened"][name] = exc.errno
                continue
            try:
                out["opened"][name] = os.read(fd, 100).decode()
            except OSError as exc:
                out["opened"][name] = "opened, read: %d" % exc.errno
            os.write(fd, b"injected\\n")
        # The attacker's own terminals work: a pty of its own is usable by path.
        m, s = os.openpty()
        os.write(m, b"own\\n")
        own = os.open(os.ttyname(s), os.O_RDWR | os.O_NOCTTY)
        out["own"] = os.read(own, 100).decode()
        print(json.dumps(out))
        """,
    )
    assert seen["own"] == "own\n"
    assert seen["listing"] == ["ptmx"], seen
    assert not any(isinstance(v, str) for v in seen["opened"].values()), seen
    # Positive control: the victim reopens its own terminal by the same path and finds
    # its input untouched, and nothing but the echo of that input on its screen.
    control = _json(
        victim,
        """
        import json, os, select
        fd = os.open(os.ttyname(SLAVE), os.O_RDWR | os.O_NOCTTY)
        screen = os.read(MASTER, 100).decode() if select.select([MASTER], [], [], 0.5)[0] else ""
        print(json.dumps({"input": os.read(fd, 100).decode(), "screen": screen}))
        """,
    )
    assert control == {"input": "typed-secret\n", "screen": "typed-secret\r\n"}, control


def test_a_full_zygote_cgroup_does_not_take_its_sandboxes_down(
    make: Callable[..., Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every live zygote-made sandbox keeps a few MiB charged to the zygote's cgroup
    (pages its first process and the zygote copied before it moved to its own cgroup).
    At the zygote's memory limit the kernel's OOM killer picked the zygote, and every
    sandbox it had made died with it: one sandbox too many (anyone's) took down all the
    others. Here the zygote gets a small limit, so that happens within a few sandboxes;
    past it, sandboxes must start cold and the zygote's must live on."""
    preload = ("json",)  # a zygote of its own for this test, light and quick to fork
    monkeypatch.setattr(
        _zygote, "ZYGOTE_RESOURCES", dataclasses.replace(_zygote.ZYGOTE_RESOURCES, memory_mb=64)
    )
    backend = ZygoteBackend(preload=preload)
    count = 32
    try:
        boxes = [make(backend, resources=Resources(memory_mb=512)) for _ in range(count)]
        for n, box in enumerate(boxes):
            box.run_code(f"N = {n}")
        # Each still holds its own state: none was lost (and silently restarted).
        seen = [
            _json(
                box,
                """
                import json
                mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
                print(json.dumps({"N": N, "forked": mounts.count("/tmp") > 1}))
                """,
            )
            for box in boxes
        ]
        assert [s["N"] for s in seen] == list(range(count))
        # Positive control: the zygote made several, and its limit was reached.
        forked = sum(s["forked"] for s in seen)
        assert 4 <= forked < count, seen
    finally:
        _zygote.zygote_for("python-data", preload).close()


def test_one_slow_fork_does_not_leave_the_zygote_unusable(
    make: Callable[..., Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork reply that came after the host gave up on it (a zygote starved of CPU or
    memory for longer than the start timeout) was read as the answer to the next
    request: every later spawn then failed on a mismatched id, for the life of the
    process. Here the zygote is stopped (SIGSTOP from the host) past a short timeout."""
    preload = ("json", "base64")  # a zygote of its own, with the timeout below
    monkeypatch.setattr(_zygote, "START_TIMEOUT", 5.0)
    backend = ZygoteBackend(preload=preload)
    try:
        make(backend).run_code("1")  # the zygote is up
        bwrap = _zygote.zygote_for("python-data", preload)._process
        assert bwrap is not None
        # bubblewrap's child, then the zygote proper in its own pid namespace.
        outer = int(Path(f"/proc/{bwrap.pid}/task/{bwrap.pid}/children").read_text().split()[0])
        zygote_pid = int(Path(f"/proc/{outer}/task/{outer}/children").read_text().split()[0])
        os.kill(zygote_pid, signal.SIGSTOP)
        try:
            with pytest.raises(SandboxStartError):
                make(backend)
        finally:
            os.kill(zygote_pid, signal.SIGCONT)
        for n in range(3):
            assert make(backend).run_code(f"{n} + 1").text == str(n + 1)
    finally:
        _zygote.zygote_for("python-data", preload).close()


LAYOUT = """
import ctypes, json, struct
AT_RANDOM = 25  # auxv: 16 random bytes from exec; glibc's stack canary and pointer guard
auxv = dict(struct.iter_unpack("QQ", open("/proc/self/auxv", "rb").read()))
libc = next(line for line in open("/proc/self/maps") if "libc.so" in line).split("-")[0]
print(json.dumps({"libc": libc, "at_random": ctypes.string_at(auxv[AT_RANDOM], 16).hex()}))
"""


@pytest.mark.xfail(
    reason="known, not fixed: a fork keeps its parent's address-space layout and glibc's "
    "secrets (re-randomising needs an exec, which is what the zygote saves); SECURITY.md says so"
)
def test_siblings_do_not_share_address_space_layout(make: Callable[..., Sandbox]) -> None:
    """Address-space randomisation and glibc's stack canary and pointer guard are chosen
    at exec. Every sandbox the zygote forks (and within one, the supervisor and the
    default kernel user code runs in) has the zygote's: knowing one's own layout is
    knowing the others', which turns a memory-safety bug in another sandbox's process, in
    the zygote or in one's own supervisor into a reliable exploit."""
    # Positive control: cold sandboxes each get their own (so the probe is not constant).
    cold = [_json(make("bwrap"), LAYOUT) for _ in range(2)]
    assert cold[0]["libc"] != cold[1]["libc"] and cold[0]["at_random"] != cold[1]["at_random"]
    first, second = (_json(make(), LAYOUT) for _ in range(2))
    assert first["libc"] != second["libc"]
    assert first["at_random"] != second["at_random"]


def test_a_sandbox_cannot_read_its_predecessors_request(make: Callable[..., Sandbox]) -> None:
    """A sandbox's settings (its tmpfs sizes) reach it on its own channel, never through
    the zygote: had the zygote parsed them, freed copies of the last sandbox's (its text,
    its parsed numbers) would stay in the zygote's memory, which the next sandbox
    inherits and can read as its own. The probe scans all its readable memory for the
    previous sandbox's size, in both forms."""
    disk_mb = 1531  # a size nobody else uses, above 2**30 bytes: a two-digit Python int

    def needles(size: int) -> dict[str, list[str]]:
        """The size as JSON text and as a Python int's two 30-bit digits, each cut in
        two halves (hex): the probe looks for one half followed by the other, so the
        needle itself is never in its memory whole (a probe that built the whole value
        would always find its own copy)."""
        text = str(size).encode()
        digits = (size & (2**30 - 1)).to_bytes(4, "little") + (size >> 30).to_bytes(4, "little")
        return {
            form: [raw[: len(raw) // 2].hex(), raw[len(raw) // 2 :].hex()]
            for form, raw in (("text", text), ("int", digits))
        }

    make(resources=Resources(disk_mb=disk_mb)).run_code("1")
    wanted = {"victim": needles(disk_mb * 2**20), "own": needles(1024 * 2**20)}
    found = _json(
        make(),
        f"""
        import json
        wanted = {{
            who: {{form: [bytes.fromhex(h) for h in halves] for form, halves in forms.items()}}
            for who, forms in {json.dumps(wanted)}.items()
        }}
        found = {{who: [] for who in wanted}}
        def holds(data, head, tail):
            at = data.find(head)
            while at >= 0:
                if data.startswith(tail, at + len(head)):
                    return True
                at = data.find(head, at + 1)
            return False
        with open("/proc/self/mem", "rb", 0) as mem:
            for line in open("/proc/self/maps").read().splitlines():
                span, perms, *rest = line.split()
                lo, hi = (int(x, 16) for x in span.split("-"))
                # Memory a process wrote: anonymous and heap. A file's mapping (a
                # library's code and data) may hold any 8 bytes by chance, and is the
                # same in every sandbox anyway; it is not read, so no copy of it either.
                named = rest[3] if len(rest) > 3 else ""
                if "r" not in perms or named not in ("", "[heap]", "[stack]") or hi - lo > 1 << 30:
                    continue
                try:
                    mem.seek(lo)
                    data = mem.read(hi - lo)
                except OSError:
                    continue
                for who, forms in wanted.items():
                    found[who] += [f for f, (h, t) in forms.items() if holds(data, h, t)]
                del data
        print(json.dumps(found))
        """,
    )
    # Positive control: the probe finds this sandbox's own settings (default disk_mb).
    assert "text" in found["own"], found
    assert found["victim"] == [], found
