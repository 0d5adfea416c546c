"""``run_code(code, language="bash")``: a persistent bash context, on every backend.

Variables, exports, arrays, functions, aliases and the working directory carry over from
cell to cell; per-call ``envs`` do not; a failing, exiting or timed-out cell ends only
that cell (a timeout that has to replace the kernel starts its state afresh); Python
cells of the same sandbox are untouched.
"""

from __future__ import annotations

import pytest

import sandlot
from sandlot import Sandbox

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template, pytest.mark.all_backends]


def _out(execution: sandlot.Execution) -> str:
    assert execution.error is None, execution.error
    return "".join(execution.logs.stdout)


def test_state_carries_from_cell_to_cell(sandbox: Sandbox) -> None:
    _out(
        sandbox.run_code(
            "B_X=5; export B_Y='two words'; b_f() { echo \"fn $1\"; }; "
            "alias b_ll='echo aliased'; mkdir -p b_dir && cd b_dir; b_arr=(a 'b c')",
            language="bash",
        )
    )
    out = _out(
        sandbox.run_code(
            'echo "$B_X|$B_Y"; b_f 1; b_ll; basename "$PWD"; echo "${b_arr[1]}"; '
            "printenv B_Y; printenv B_X || echo not-exported",
            language="bash",
        )
    )
    expected = ["5|two words", "fn 1", "aliased", "b_dir", "b c", "two words", "not-exported"]
    assert out.splitlines() == expected
    # The Python kernel is another context: its state and working directory are its own.
    assert sandbox.run_code("import os; os.path.basename(os.getcwd())").text != "'b_dir'"


def test_per_call_envs_apply_to_that_cell_only(sandbox: Sandbox) -> None:
    _out(sandbox.run_code("B_KEEP=kept", language="bash"))
    once = sandbox.run_code(
        'echo "$B_ONCE $B_KEEP"', language="bash", envs={"B_ONCE": "once", "B_KEEP": "over"}
    )
    assert _out(once) == "once over\n"
    assert _out(sandbox.run_code('echo "[$B_ONCE] $B_KEEP"', language="bash")) == "[] kept\n"


def test_failure_exit_and_timeout_end_only_the_cell(sandbox: Sandbox) -> None:
    _out(sandbox.run_code("B_LIVE=yes", language="bash"))
    failed = sandbox.run_code("echo before; false", language="bash")
    assert failed.status == "error" and failed.error is not None
    assert failed.error.name == "ExitCodeError" and "status 1" in failed.error.value
    assert failed.logs.stdout == ["before\n"]
    exited = sandbox.run_code("B_LIVE=changed; exit 3", language="bash")
    assert exited.error is not None and "status 3" in exited.error.value
    # The exit saved its state.
    assert _out(sandbox.run_code('echo "$B_LIVE"', language="bash")) == "changed\n"
    slow = sandbox.run_code("echo started; sleep 60", language="bash", timeout=2)
    assert slow.status == "timeout" and slow.error is not None
    assert slow.error.name == "TimeoutError"
    assert slow.logs.stdout == ["started\n"]
    # The context works on. (If the timeout had to replace the context's kernel, as
    # under gVisor, its state starts afresh, as a Python context's variables do.)
    assert _out(sandbox.run_code("echo alive", language="bash")) == "alive\n"


def test_bash_contexts_are_separate_and_the_default_is_shared(sandbox: Sandbox) -> None:
    context = sandbox.create_code_context(language="bash")
    assert context.language == "bash"
    try:
        _out(sandbox.run_code("B_WHERE=mine", context=context))
        _out(sandbox.run_code("B_WHERE=default", language="bash"))
        assert _out(sandbox.run_code('echo "$B_WHERE"', context=context)) == "mine\n"
        assert _out(sandbox.run_code('echo "$B_WHERE"', language="bash")) == "default\n"
    finally:
        sandbox.remove_code_context(context)


def test_unsupported_languages_and_ambiguous_calls_are_refused(sandbox: Sandbox) -> None:
    for language in ("js", "ts", "r", "java"):
        with pytest.raises(sandlot.InvalidArgumentError, match="not supported"):
            sandbox.run_code("1", language=language)
        with pytest.raises(sandlot.InvalidArgumentError, match="not supported"):
            sandbox.create_code_context(language=language)
    with pytest.raises(sandlot.InvalidArgumentError, match="either language or context"):
        sandbox.run_code("echo", language="bash", context="default")


def test_bash_cells_get_no_python_precheck(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("for i in 1 2; do echo $i; done", language="bash")
    assert _out(execution) == "1\n2\n"
    assert execution.precheck is None
