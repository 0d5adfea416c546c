"""Folding protocol events into Execution / CommandResult (``sandlot._fold``)."""

from __future__ import annotations

from typing import Any

import pytest

from sandlot._fold import (
    _SLACK,
    TRUNCATION_MARKER,
    Callbacks,
    CommandBuilder,
    ExecutionBuilder,
)
from sandlot._models import ExecutionError, OutputMessage, Result
from sandlot.policy import Resources

RID = "r1"


def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "id": RID, **fields}


def out(text: str) -> dict[str, Any]:
    return ev("stdout", text=text)


def err(text: str) -> dict[str, Any]:
    return ev("stderr", text=text)


def result(data: dict[str, Any], main: bool = False) -> dict[str, Any]:
    return ev("result", data=data, is_main_result=main)


def exit_(status: str = "ok", **fields: Any) -> dict[str, Any]:
    return ev("exit", status=status, **fields)


class Recorder:
    """Callbacks that log what they were called with, in one shared order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def callbacks(self) -> Callbacks:
        return Callbacks(
            on_stdout=lambda m: self.calls.append(("stdout", m)),
            on_stderr=lambda m: self.calls.append(("stderr", m)),
            on_result=lambda r: self.calls.append(("result", r)),
            on_error=lambda e: self.calls.append(("error", e)),
        )


def fold(events: list[dict[str, Any]], resources: Resources | None = None) -> ExecutionBuilder:
    builder = ExecutionBuilder(resources or Resources())
    for event in events:
        builder.add(event)
    return builder


# --- ExecutionBuilder: output ----------------------------------------------------------


def test_stdout_and_stderr_chunks_are_kept_in_order() -> None:
    builder = fold([out("a"), err("b"), out("c\n"), exit_()])
    assert builder.finished
    execution = builder.execution
    assert execution.logs.stdout == ["a", "c\n"]
    assert execution.logs.stderr == ["b"]
    assert execution.status == "ok"
    assert execution.error is None
    assert not execution.truncated


def test_output_callbacks_get_output_messages() -> None:
    recorder = Recorder()
    builder = ExecutionBuilder(Resources(), recorder.callbacks())
    for event in (out("hi\n"), err("warn\n"), exit_()):
        builder.add(event)
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["stdout", "stderr"]
    stdout, stderr = recorder.calls[0][1], recorder.calls[1][1]
    assert isinstance(stdout, OutputMessage)
    assert (stdout.line, stdout.error) == ("hi\n", False)
    assert (stderr.line, stderr.error) == ("warn\n", True)
    assert str(stdout) == "hi\n"
    assert stdout.timestamp <= stderr.timestamp


def test_unknown_event_types_are_ignored() -> None:
    builder = fold([ev("data", data="x"), out("a"), exit_()])
    assert builder.execution.logs.stdout == ["a"]


def test_not_finished_until_exit() -> None:
    builder = fold([out("a"), result({"text/plain": "1"})])
    assert not builder.finished


# --- ExecutionBuilder: results --------------------------------------------------------


def test_results_from_bundles() -> None:
    recorder = Recorder()
    builder = ExecutionBuilder(Resources(), recorder.callbacks())
    events = [
        result({"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}),
        result({"text/plain": "2", "text/html": "<b>2</b>"}, main=True),
        exit_(execution_count=7),
    ]
    for event in events:
        builder.add(event)
    execution = builder.execution
    assert len(execution.results) == 2
    figure, main = execution.results
    assert figure.png == "iVBORw0KGgo=" and not figure.is_main_result
    assert figure.formats() == ["png"]
    assert main.is_main_result
    assert main.formats() == ["html"]
    assert execution.text == "2"
    assert execution.execution_count == 7
    assert [kind for kind, _ in recorder.calls] == ["result", "result"]
    assert recorder.calls[1][1] is main


def test_execution_count_must_be_an_int() -> None:
    assert fold([exit_(execution_count="7")]).execution.execution_count is None
    assert fold([exit_(execution_count=True)]).execution.execution_count is None


def test_max_results_drops_extra_results() -> None:
    recorder = Recorder()
    builder = ExecutionBuilder(Resources(max_results=2), recorder.callbacks())
    for i in range(5):
        builder.add(result({"text/plain": str(i)}))
    builder.add(exit_())
    assert [r.text for r in builder.execution.results] == ["0", "1"]
    assert builder.execution.truncated
    # Two results, then one marker on stderr (once, however many were dropped).
    assert len(recorder.calls) == 3
    marker = "[sandlot: more than 2 results in one cell; the rest were dropped]\n"
    assert builder.execution.logs.stderr == [marker]


def test_oversized_result_is_dropped() -> None:
    builder = fold(
        [
            result({"text/plain": "x" * (10_000 + _SLACK)}),
            result({"text/plain": "small"}),
            exit_(),
        ],
        Resources(result_bytes=10_000),
    )
    assert [r.text for r in builder.execution.results] == ["small"]
    assert builder.execution.truncated
    assert builder.execution.logs.stderr == [
        "[sandlot: a result larger than 10000 bytes was dropped]\n"
    ]


def test_no_result_limits_when_none() -> None:
    builder = fold(
        [result({"text/plain": "x" * 100_000}) for _ in range(100)] + [exit_()],
        Resources(max_results=None, result_bytes=None),
    )
    assert len(builder.execution.results) == 100
    assert not builder.execution.truncated


# --- ExecutionBuilder: errors and status ----------------------------------------------


def test_error_then_status() -> None:
    recorder = Recorder()
    builder = ExecutionBuilder(Resources(), recorder.callbacks())
    builder.add(out("before\n"))
    builder.add(ev("error", name="ZeroDivisionError", value="division by zero", traceback="tb"))
    builder.add(exit_("error"))
    execution = builder.execution
    assert execution.status == "error"
    assert execution.error == ExecutionError("ZeroDivisionError", "division by zero", "tb")
    assert [kind for kind, _ in recorder.calls] == ["stdout", "error"]


def test_only_the_first_error_is_kept() -> None:
    builder = fold(
        [
            ev("error", name="A", value="first", traceback=""),
            ev("error", name="B", value="second", traceback=""),
            exit_("error"),
        ]
    )
    assert builder.execution.error is not None
    assert builder.execution.error.name == "A"


@pytest.mark.parametrize("status", ["error", "timeout", "oom", "interrupted", "died"])
def test_failed_status_without_error_gets_one(status: str) -> None:
    # The runner always sends an error first; a hostile one might not.
    builder = fold([exit_(status)])
    assert builder.execution.status == status
    assert builder.execution.error is not None
    assert builder.execution.error.name == "SandboxError"
    assert status in builder.execution.error.value


def test_timeout_status_keeps_runner_error() -> None:
    builder = fold(
        [
            out("tick\n"),
            ev("error", name="TimeoutError", value="cell timed out after 1 s", traceback=""),
            exit_("timeout"),
        ]
    )
    assert builder.execution.status == "timeout"
    assert builder.execution.error is not None
    assert builder.execution.error.name == "TimeoutError"
    assert builder.execution.logs.stdout == ["tick\n"]


def test_exit_truncated_flag_from_runner() -> None:
    assert fold([exit_(truncated=True)]).execution.truncated
    assert not fold([exit_(truncated="yes")]).execution.truncated


# --- ExecutionBuilder: host-side truncation -------------------------------------------


def test_host_truncates_output_beyond_the_limit_even_if_runner_sends_more() -> None:
    limit = 1000
    recorder = Recorder()
    builder = ExecutionBuilder(Resources(output_bytes=limit), recorder.callbacks())
    chunk = "x" * 700 + "\n"
    for _ in range(50):  # 35 KB from a runner that ignores its limit
        builder.add(out(chunk))
        builder.add(err(chunk))
    builder.add(exit_())
    execution = builder.execution
    marker = TRUNCATION_MARKER.format(limit=limit)
    text = "".join(execution.logs.stdout) + "".join(execution.logs.stderr)
    assert execution.truncated
    assert len(text.encode()) <= limit + _SLACK + len(marker)
    assert text.count(marker) == 1
    assert execution.status == "ok"
    # Callbacks saw exactly what was kept, nothing that was dropped.
    seen = "".join(m.line for _, m in recorder.calls)
    assert sorted(seen) == sorted(text)


def test_truncation_marker_added_when_a_chunk_fills_the_budget_exactly() -> None:
    limit = 1000
    builder = ExecutionBuilder(Resources(output_bytes=limit))
    builder.add(out("x" * (limit + _SLACK)))  # exactly the budget: nothing cut yet
    assert not builder.execution.truncated
    builder.add(out("ZZZ"))
    builder.add(exit_())
    marker = TRUNCATION_MARKER.format(limit=limit)
    assert builder.execution.truncated
    assert "".join(builder.execution.logs.stdout).endswith(marker)
    assert "ZZZ" not in "".join(builder.execution.logs.stdout)


def test_truncation_does_not_split_utf8() -> None:
    limit = 100
    builder = fold([out("é" * (limit + _SLACK))], Resources(output_bytes=limit))
    text = builder.execution.logs.stdout[0]
    assert "\ufffd" not in text
    kept = text.split("\n[sandlot")[0]
    assert set(kept) == {"é"}
    assert len(kept.encode()) <= limit + _SLACK


def test_output_within_slack_is_not_truncated() -> None:
    # The runner cuts at the limit and adds its own marker; that must pass intact.
    limit = 1000
    builder = fold(
        [out("x" * limit), out("[runner marker]\n"), exit_()], Resources(output_bytes=limit)
    )
    assert not builder.execution.truncated
    assert builder.execution.logs.stdout == ["x" * limit, "[runner marker]\n"]


def test_no_output_limit_when_none() -> None:
    builder = fold([out("x" * 5_000_000), exit_()], Resources(output_bytes=None))
    assert builder.execution.logs.stdout == ["x" * 5_000_000]
    assert not builder.execution.truncated


# --- ExecutionBuilder.abort -----------------------------------------------------------


def test_abort_replaces_status_and_error_and_keeps_output() -> None:
    recorder = Recorder()
    builder = ExecutionBuilder(Resources(), recorder.callbacks())
    builder.add(out("partial\n"))
    builder.add(ev("error", name="ValueError", value="x", traceback=""))
    execution = builder.abort("died", "SandboxLostError", "the sandbox was killed")
    assert builder.finished
    assert execution is builder.execution
    assert execution.status == "died"
    assert execution.error == ExecutionError("SandboxLostError", "the sandbox was killed")
    assert execution.logs.stdout == ["partial\n"]
    assert recorder.calls[-1] == ("error", execution.error)


# --- CommandBuilder -------------------------------------------------------------------


def fold_command(
    events: list[dict[str, Any]], resources: Resources | None = None
) -> CommandBuilder:
    builder = CommandBuilder(resources or Resources())
    for event in events:
        builder.add(event)
    return builder


def test_command_success() -> None:
    builder = fold_command([out("a\n"), err("b\n"), out("c\n"), exit_("ok", exit_code=0)])
    assert builder.finished
    cmd = builder.result()
    assert (cmd.stdout, cmd.stderr, cmd.exit_code, cmd.error) == ("a\nc\n", "b\n", 0, None)


def test_command_nonzero_exit_is_data() -> None:
    cmd = fold_command([err("no such file\n"), exit_("error", exit_code=2)]).result()
    assert cmd.exit_code == 2
    assert cmd.error is None


def test_command_killed_by_signal() -> None:
    assert fold_command([exit_("error", exit_code=-9)]).result().exit_code == -9


@pytest.mark.parametrize("code", [None, "0", True, 1.5])
def test_command_exit_code_must_be_an_int(code: Any) -> None:
    events = [exit_("ok")] if code is None else [exit_("ok", exit_code=code)]
    assert fold_command(events).result().exit_code == -1


def test_command_timeout() -> None:
    cmd = fold_command([out("started\n"), exit_("timeout", exit_code=-9)]).result()
    assert cmd.error == "timeout"
    assert cmd.exit_code == -9
    assert cmd.stdout == "started\n"


@pytest.mark.parametrize("status", ["oom", "interrupted", "died"])
def test_command_other_failures(status: str) -> None:
    assert fold_command([exit_(status)]).result().error == status


def test_command_output_truncated() -> None:
    limit = 100
    builder = fold_command(
        [out("x" * 10_000), out("Q"), exit_("ok", exit_code=0)], Resources(output_bytes=limit)
    )
    cmd = builder.result()
    assert cmd.error == "output truncated"
    assert len(cmd.stdout.encode()) < limit + _SLACK + 200
    assert "Q" not in cmd.stdout
    assert fold_command([exit_("ok", exit_code=0, truncated=True)]).result().error == (
        "output truncated"
    )


def test_command_ignores_results_and_errors() -> None:
    builder = fold_command(
        [
            result({"text/plain": "1"}),
            ev("error", name="X", value="y", traceback=""),
            exit_("ok", exit_code=0),
        ]
    )
    assert builder.result().error is None


def test_command_callbacks() -> None:
    recorder = Recorder()
    builder = CommandBuilder(Resources(), recorder.callbacks())
    for event in (out("a"), err("b"), exit_("ok", exit_code=0)):
        builder.add(event)
    assert [(kind, m.line) for kind, m in recorder.calls] == [("stdout", "a"), ("stderr", "b")]


def test_command_abort() -> None:
    builder = fold_command([out("partial")])
    builder.abort("timeout")
    assert builder.finished
    cmd = builder.result()
    assert (cmd.stdout, cmd.exit_code, cmd.error) == ("partial", -1, "timeout")


def test_result_is_a_result() -> None:
    builder = fold([result({"text/plain": "1"}, main=True)])
    assert isinstance(builder.execution.results[0], Result)


def test_stream_only_callbacks_take_output_and_results_instead_of_the_execution() -> None:
    # The server forwards everything and needs only the outcome: what it streams must
    # not also pile up in the Execution it throws away.
    from sandlot._fold import stream_only

    seen: list[Any] = []
    builder = ExecutionBuilder(
        Resources(max_results=2),
        Callbacks(
            on_stdout=stream_only(seen.append),
            on_result=stream_only(seen.append),
        ),
    )
    for event in (out("a"), result({"text/plain": "1"}), result({"text/plain": "2"})):
        builder.add(event)
    builder.add(result({"text/plain": "3"}))  # over max_results: still counted
    builder.add(exit_())
    execution = builder.execution
    assert execution.logs.stdout == [] and execution.results == []
    assert len(seen) == 3 and execution.truncated


def test_a_limit_event_from_the_host_marks_the_cell_truncated_once() -> None:
    builder = ExecutionBuilder(Resources())
    builder.add(ev("limit", what="results", limit=16))
    builder.add(ev("limit", what="results", limit=16))
    builder.add(exit_())
    assert builder.execution.truncated
    markers = [t for t in builder.execution.logs.stderr if "host dropped" in t]
    assert len(markers) == 1 and "16 bytes" in markers[0]
