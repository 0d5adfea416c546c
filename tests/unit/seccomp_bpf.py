"""Read a compiled seccomp program the way the kernel does, for tests.

:func:`run` executes a classic-BPF seccomp program on one ``seccomp_data`` (the syscall
number, architecture and arguments), as the kernel would for one call. :func:`reach`
runs it for every syscall number at once: it follows every path, keeping the set of
numbers that can take it (an argument it cannot know takes both branches), and returns
which numbers can end in which action. That turns "every number outside the reviewed
table is refused" from a sample into a statement about all 2**32 numbers.

Only what seccomp programs use is implemented (loads from ``seccomp_data``, the scratch
memory, ALU, jumps, returns); anything else raises, so a test cannot pass on an
instruction this reader ignored.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

Intervals = tuple[tuple[int, int], ...]
"""Disjoint, sorted, inclusive (low, high) ranges of syscall numbers."""

ALL_NUMBERS: Intervals = ((0, 0xFFFFFFFF),)

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_TRACE = 0x7FF00000
RET_ALLOW = 0x7FFF0000
_MASK32 = 0xFFFFFFFF


def instructions(program: bytes) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) for each ``struct sock_filter`` of ``program``."""
    assert len(program) % 8 == 0, "not a whole number of BPF instructions"
    return [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]


def _data(nr: int, arch: int, args: Sequence[int]) -> bytes:
    words = [*args, *[0] * (6 - len(args))]
    return struct.pack("=IIQ6Q", nr & _MASK32, arch, 0, *(a & (1 << 64) - 1 for a in words))


def run(program: bytes, nr: int, arch: int, args: Sequence[int] = ()) -> int:
    """The action (``SECCOMP_RET_*`` with its data) the program returns for one call."""
    code_list = instructions(program)
    data = _data(nr, arch, args)
    a = x = 0
    memory = [0] * 16
    pc = 0
    while True:
        code, jt, jf, k = code_list[pc]
        pc += 1
        cls = code & 0x07
        if cls == 0x00:  # LD
            mode = code & 0xE0
            if mode == 0x20:
                a = struct.unpack_from("=I", data, k)[0]
            elif mode == 0x00:
                a = k
            elif mode == 0x60:
                a = memory[k]
            else:
                raise NotImplementedError(f"load mode {code:#x}")
        elif cls == 0x01:  # LDX
            mode = code & 0xE0
            if mode == 0x00:
                x = k
            elif mode == 0x60:
                x = memory[k]
            else:
                raise NotImplementedError(f"ldx mode {code:#x}")
        elif cls == 0x02:
            memory[k] = a
        elif cls == 0x03:
            memory[k] = x
        elif cls == 0x04:
            a = _alu(code, a, x if code & 0x08 else k)
        elif cls == 0x05:
            operand = x if code & 0x08 else k
            op = code & 0xF0
            if op == 0x00:
                pc += k
                continue
            taken = {
                0x10: a == operand,
                0x20: a > operand,
                0x30: a >= operand,
                0x40: bool(a & operand),
            }[op]
            pc += jt if taken else jf
        elif cls == 0x06:
            return a if code & 0x18 == 0x10 else k
        elif cls == 0x07:
            if code & 0xF8 == 0x00:
                x = a
            elif code & 0xF8 == 0x80:
                a = x
            else:
                raise NotImplementedError(f"misc {code:#x}")
        else:  # pragma: no cover - all eight classes are handled above
            raise NotImplementedError(f"class {cls}")


def _alu(code: int, a: int, operand: int) -> int:
    op = code & 0xF0
    result = {
        0x00: lambda: a + operand,
        0x10: lambda: a - operand,
        0x20: lambda: a * operand,
        0x30: lambda: a // operand,
        0x40: lambda: a | operand,
        0x50: lambda: a & operand,
        0x60: lambda: a << operand,
        0x70: lambda: a >> operand,
        0x80: lambda: -a,
        0x90: lambda: a % operand,
        0xA0: lambda: a ^ operand,
    }[op]()
    return result & _MASK32


def reach(program: bytes, arch: int) -> dict[int, Intervals]:
    """For every action the program can return on ``arch``: the syscall numbers that can
    end there (for some arguments). The syscall number is followed exactly while it sits
    in the accumulator; any other value the program loads (an argument, or the number
    after arithmetic) is unknown and both branches are taken."""
    code_list = instructions(program)
    found: dict[int, list[tuple[int, int]]] = {}
    seen: set[tuple[int, Intervals, str, int]] = set()
    # State: pc, numbers still possible, what A holds ("nr", "const" with its value, or
    # "unknown"), and the value for "const".
    stack: list[tuple[int, Intervals, str, int]] = [(0, ALL_NUMBERS, "unknown", 0)]
    while stack:
        state = stack.pop()
        if state in seen or not state[1]:
            continue
        seen.add(state)
        pc, numbers, kind, value = state
        code, jt, jf, k = code_list[pc]
        cls = code & 0x07
        nxt = pc + 1
        if cls == 0x00:
            mode = code & 0xE0
            if mode == 0x20 and k == 0:
                stack.append((nxt, numbers, "nr", 0))
            elif mode == 0x20 and k == 4:
                stack.append((nxt, numbers, "const", arch))
            elif mode == 0x00:
                stack.append((nxt, numbers, "const", k))
            else:
                stack.append((nxt, numbers, "unknown", 0))
        elif cls in (0x01, 0x02, 0x03, 0x04, 0x07):
            # Scratch memory and X never hold the number in libseccomp's programs; an
            # ALU result or a value moved through X is unknown (a sound over-estimate).
            stack.append((nxt, numbers, "unknown" if cls in (0x04, 0x07) else kind, value))
        elif cls == 0x05:
            op = code & 0xF0
            if op == 0x00:
                stack.append((nxt + k, numbers, kind, value))
                continue
            if code & 0x08:
                raise NotImplementedError("jump on X")
            if kind == "const":
                taken = {
                    0x10: value == k,
                    0x20: value > k,
                    0x30: value >= k,
                    0x40: bool(value & k),
                }[op]
                stack.append((nxt + (jt if taken else jf), numbers, kind, value))
            elif kind == "nr" and op != 0x40:
                low, high = {0x10: (k, k), 0x20: (k + 1, _MASK32), 0x30: (k, _MASK32)}[op]
                stack.append((nxt + jt, _intersect(numbers, ((low, high),)), kind, value))
                stack.append((nxt + jf, _subtract(numbers, low, high), kind, value))
            else:
                stack.append((nxt + jt, numbers, kind, value))
                stack.append((nxt + jf, numbers, kind, value))
        elif cls == 0x06:
            if code & 0x18 != 0x00:
                raise NotImplementedError("return A")
            found.setdefault(k, []).extend(numbers)
    return {action: _normal(ranges) for action, ranges in found.items()}


def _normal(ranges: Sequence[tuple[int, int]]) -> Intervals:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def _intersect(numbers: Intervals, other: Intervals) -> Intervals:
    out = []
    for low, high in numbers:
        for olow, ohigh in other:
            if max(low, olow) <= min(high, ohigh):
                out.append((max(low, olow), min(high, ohigh)))
    return _normal(out)


def _subtract(numbers: Intervals, low: int, high: int) -> Intervals:
    out = []
    for a, b in numbers:
        if b < low or a > high:
            out.append((a, b))
            continue
        if a < low:
            out.append((a, low - 1))
        if b > high:
            out.append((high + 1, b))
    return tuple(out)


def members(numbers: Intervals) -> Iterator[int]:
    """Every number in ``numbers`` (only for small sets)."""
    for low, high in numbers:
        yield from range(low, high + 1)


def complement(numbers: set[int]) -> Intervals:
    """Every 32-bit syscall number not in ``numbers``."""
    return _subtract_all(ALL_NUMBERS, numbers)


def _subtract_all(numbers: Intervals, points: set[int]) -> Intervals:
    for point in sorted(points):
        numbers = _subtract(numbers, point, point)
    return numbers


def overlap(a: Intervals, b: Intervals) -> Intervals:
    """The numbers in both."""
    return _intersect(a, b)
