"""The zygote-made sandbox's own check that its privileges are gone (runner/_zygote.py),
on /proc/self/status as the kernel writes it: anything left, or missing, refuses."""

from __future__ import annotations

from sandlot.runner._zygote import _unprivileged

DROPPED = (
    b"Name:\tpython\nUmask:\t0022\nState:\tR (running)\nUid:\t1000\t1000\t1000\t1000\n"
    b"CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n"
    b"CapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\n"
    b"Seccomp:\t2\nSeccomp_filters:\t2\nSpeculation_Store_Bypass:\tthread vulnerable\n"
)


def test_a_process_with_nothing_left_passes() -> None:
    assert _unprivileged(DROPPED) is None


def test_any_capability_left_refuses() -> None:
    for key in (b"CapInh", b"CapPrm", b"CapEff", b"CapBnd", b"CapAmb"):
        status = DROPPED.replace(key + b":\t0000000000000000", key + b":\t0000000000200000")
        assert status != DROPPED
        assert _unprivileged(status) == f"{key.decode()} is not empty after dropping capabilities"


def test_a_missing_or_garbled_line_refuses() -> None:
    for line in (b"CapBnd:\t0000000000000000\n", b"NoNewPrivs:\t1\n", b"Seccomp:\t2\n"):
        assert _unprivileged(DROPPED.replace(line, b"")) is not None
    assert _unprivileged(DROPPED.replace(b"CapAmb:\t0000000000000000", b"CapAmb:\tzz")) is not None
    assert _unprivileged(b"") is not None


def test_no_seccomp_filter_or_no_new_privs_refuses() -> None:
    assert _unprivileged(DROPPED.replace(b"Seccomp:\t2\n", b"Seccomp:\t0\n")) is not None
    assert _unprivileged(DROPPED.replace(b"NoNewPrivs:\t1", b"NoNewPrivs:\t0")) is not None
    # Seccomp_filters is another line: it must not stand in for Seccomp.
    assert _unprivileged(DROPPED.replace(b"Seccomp:\t2\n", b"")) is not None
