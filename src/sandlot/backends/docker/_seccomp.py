"""sandlot's syscall policy (:mod:`sandlot.seccomp`) as a Docker/OCI seccomp profile (pure).

The profile is the allowlist the bubblewrap backend compiles to BPF, from the same
rules (:func:`sandlot.seccomp.filter_rules`): ``defaultAction`` refuses every call with
``ENOSYS``, one rule allows each reviewed call by name, and the denials keep their own
errors. Names, not numbers: the engine resolves them with its own libseccomp and skips
a name it does not know, which here can only leave a call refused, never allowed (a
denial the engine cannot name falls to the default, so it fails with ENOSYS instead of
its own error). So a kernel (or an engine) newer than the policy adds nothing a
container can call. Calls
only one of the policy's architectures has are allowed only there (``includes``, which
Docker and Podman match against their own architecture). The profile *replaces* the
engine's default, so it must be complete on its own: Docker's default blocks namespace
creation and mounts only for processes without ``CAP_SYS_ADMIN``, Podman's allows user
namespaces outright; this profile denies both whatever the capabilities.

Argument tests map to OCI comparisons: ``eq`` and ``ge`` directly; ``masked_eq`` as
``SCMP_CMP_MASKED_EQ`` with ``value`` = mask and ``valueTwo`` = the expected bits.
All tests of one rule must hold (one rule, several ``args``, never two on one argument:
runc would split those into separate rules that any may match); separate rules of the
same syscall are alternatives. A call denied for some arguments is allowed by rules
for exactly the others (one action per syscall and argument values in libseccomp).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Sequence
from typing import Any

from sandlot.seccomp import DENIED, SYSCALL_NUMBERS, ArgTest, Denial, Rule
from sandlot.seccomp import filter_rules as _filter_rules

_OPS = {"eq": "SCMP_CMP_EQ", "ge": "SCMP_CMP_GE", "masked_eq": "SCMP_CMP_MASKED_EQ"}
ENGINE_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
"""The policy's architectures as Docker and Podman name theirs (Go's GOARCH)."""


def _arg(test: ArgTest) -> dict[str, Any]:
    if test.op == "masked_eq":
        return {
            "index": test.index,
            "value": test.mask,
            "valueTwo": test.value,
            "op": _OPS["masked_eq"],
        }
    return {"index": test.index, "value": test.value, "op": _OPS[test.op]}


def _action(err: int | None) -> dict[str, Any]:
    if err is None:
        return {"action": "SCMP_ACT_ALLOW"}
    if err == errno.ENOSYS:
        return {"action": _ENOSYS}
    return {"action": "SCMP_ACT_ERRNO", "errnoRet": err}


# SECCOMP_RET_TRACE with no tracer attached fails the call with ENOSYS, on every
# runtime. "errnoRet" and "defaultErrnoRet" are not: gVisor's runsc (2022) ignores the
# first and Docker 20.10 the second, so both would answer EPERM, and glibc falls back
# from clone3 to clone (or faccessat2 to faccessat...) only on ENOSYS: threads would not
# start. No process in the sandbox can become a tracer (ptrace is denied); a host-side
# tracer only sees these calls if it asked for seccomp events (PTRACE_O_TRACESECCOMP).
_ENOSYS = "SCMP_ACT_TRACE"


def build_profile(denied: Sequence[Denial] = DENIED) -> dict[str, Any]:
    """The seccomp profile (as the engine's JSON document) of the policy with ``denied``
    (raises :class:`~sandlot._exceptions.PolicyError` if they cannot be compiled)."""
    rules = _filter_rules(denied)
    syscalls: list[dict[str, Any]] = []
    # Calls allowed outright: those every architecture has, then each one's own.
    allowed = [r.syscall for r in rules if r.errno is None and not r.when]
    everywhere = [n for n in allowed if all(n in table for table in SYSCALL_NUMBERS.values())]
    if everywhere:
        syscalls.append({"names": everywhere, **_action(None)})
    for arch, table in SYSCALL_NUMBERS.items():
        own = [n for n in allowed if n in table and n not in everywhere]
        if own:
            includes = {"arches": [ENGINE_ARCH[arch]]}
            syscalls.append({"names": own, **_action(None), "includes": includes})
    # Unconditional denials with the same errno share one rule, in policy order (the
    # default would refuse them too, but with ENOSYS, not the policy's error).
    by_errno: dict[int, list[str]] = {}
    for rule in rules:
        if rule.errno is not None and not rule.when:
            by_errno.setdefault(rule.errno, []).append(rule.syscall)
    syscalls.extend({"names": names, **_action(err)} for err, names in by_errno.items())
    syscalls.extend(_conditional(r) for r in rules if r.when)
    # No "architectures": the filter covers the native ABI only, and the engine's
    # runtime rejects syscalls of other ABIs (int 0x80, x32) instead of letting them
    # slip past rules written for the native numbers.
    # The default is the policy's UNREVIEWED_ERRNO, ENOSYS (tests/docker checks).
    return {"defaultAction": _ENOSYS, "syscalls": syscalls}


def _conditional(rule: Rule) -> dict[str, Any]:
    return {"names": [rule.syscall], **_action(rule.errno), "args": [_arg(t) for t in rule.when]}


def profile_json(denied: Sequence[Denial] = DENIED) -> str:
    """:func:`build_profile` as compact, stable JSON (what ``seccomp=`` takes)."""
    return json.dumps(build_profile(denied), sort_keys=True, separators=(",", ":"))
