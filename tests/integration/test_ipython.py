"""Cells accept what a Jupyter (IPython) kernel accepts, in real sandboxes.

With IPython in the template (python-data has it), a cell indented as a whole,
``!cmd``, ``%magic``, ``%%magic`` and ``x = !cmd`` run as in a notebook; top-level
``await`` works; and the cells' namespace is ``__main__``, so what a cell defines
pickles by reference (``multiprocessing.Pool().map`` over a cell's function). The
last test builds a template without IPython and checks the plain-Python fallback.
"""

from __future__ import annotations

import base64
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot import Sandbox

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ok(execution: sandlot.Execution) -> sandlot.Execution:
    assert execution.error is None, execution.error
    assert execution.status == "ok"
    return execution


@pytest.mark.all_backends
def test_a_cell_indented_as_a_whole_runs(sandbox: Sandbox) -> None:
    execution = _ok(
        sandbox.run_code("    ind_a = 20\n    if ind_a:\n        ind_a += 1\n    ind_a * 2")
    )
    assert execution.text == "42"
    assert execution.results[0].is_main_result


@pytest.mark.all_backends
def test_shell_commands_output_and_exit_status(sandbox: Sandbox) -> None:
    _ok(sandbox.run_code("shell_word = 'from-python'"))
    execution = _ok(
        sandbox.run_code("print('before')\n!echo out {shell_word}; echo err >&2; exit 3")
    )
    assert execution.logs.stdout == ["before\n", "out from-python\n"]
    assert execution.logs.stderr == ["err\n"]
    assert execution.results == []
    # The exit status is IPython's _exit_code; a failing command does not fail the cell.
    assert _ok(sandbox.run_code("_exit_code")).text == "3"
    listing = _ok(sandbox.run_code("shell_lines = !printf 'a\\nb\\n'; exit 1\nlist(shell_lines)"))
    assert listing.text == "['a', 'b']"
    assert _ok(sandbox.run_code("_exit_code")).text == "1"


@pytest.mark.all_backends
def test_pip_magic_fails_like_pip(sandbox: Sandbox) -> None:
    execution = _ok(sandbox.run_code("%pip install --no-index sandlot-no-such-package-xyz"))
    # pip's own failure on stderr (a template without pip fails as "No module named pip").
    stderr = "".join(execution.logs.stderr)
    assert "sandlot-no-such-package-xyz" in stderr or "No module named pip" in stderr
    assert _ok(sandbox.run_code("_exit_code")).text == "1"


@pytest.mark.all_backends
def test_matplotlib_inline_keeps_figures_coming_back_as_png(sandbox: Sandbox) -> None:
    execution = _ok(
        sandbox.run_code(
            "%matplotlib inline\n"
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [3, 1, 2], label='l')\n"
            "plt.title('inline');"
        )
    )
    [figure] = execution.results
    assert not figure.is_main_result
    assert base64.b64decode(figure.png or "")[:8] == PNG_MAGIC
    assert figure.chart is not None and figure.chart["title"] == "inline"
    assert execution.logs.stdout == [] and execution.logs.stderr == []
    backend = _ok(sandbox.run_code("import matplotlib\nmatplotlib.get_backend().lower()"))
    assert backend.text == "'agg'"


@pytest.mark.all_backends
def test_time_and_timeit_magics(sandbox: Sandbox) -> None:
    timed = _ok(sandbox.run_code("%%time\ntimed_x = sum(range(100))\ntimed_x * 2"))
    assert timed.text == "9900"
    assert timed.results[0].is_main_result
    assert any(line.startswith("CPU times:") for line in timed.logs.stdout)
    assert any(line.startswith("Wall time:") for line in timed.logs.stdout)
    assert _ok(sandbox.run_code("timed_x")).text == "4950"
    line = _ok(sandbox.run_code("%time timed_y = 5\ntimed_y"))
    assert line.text == "5"
    timeit = _ok(sandbox.run_code("%timeit -n 2 -r 1 sum(range(10))"))
    assert "per loop" in "".join(timeit.logs.stdout)
    assert timeit.results == []


@pytest.mark.all_backends
def test_errors_in_magics_are_the_cells_error(sandbox: Sandbox) -> None:
    failed = sandbox.run_code("%%time\n1 / 0")
    assert failed.status == "error"
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("ZeroDivisionError", "division by zero")
    unknown = sandbox.run_code("%sandlot_no_such_magic")
    assert unknown.status == "error" and unknown.error is not None
    assert unknown.error.name == "UsageError"
    assert "sandlot_no_such_magic" in unknown.error.value
    # A genuine syntax error is still a SyntaxError, whatever IPython tried.
    broken = sandbox.run_code("    x = (1,\n    %time 1")
    assert broken.error is not None and broken.error.name == "SyntaxError"


@pytest.mark.all_backends
def test_top_level_await(sandbox: Sandbox) -> None:
    execution = _ok(
        sandbox.run_code(
            "import asyncio\n"
            "async def twice(x):\n"
            "    await asyncio.sleep(0.01)\n"
            "    return 2 * x\n"
            "awaited = await asyncio.gather(twice(1), twice(2))\n"
            "awaited"
        )
    )
    assert execution.text == "[2, 4]"


@pytest.mark.all_backends
def test_cell_functions_pickle_by_reference_and_multiprocessing_works(sandbox: Sandbox) -> None:
    _ok(sandbox.run_code("def square(x):\n    return x * x\nclass Point:\n    pass"))
    execution = _ok(
        sandbox.run_code(
            "import multiprocessing, pickle, sys\n"
            "assert sys.modules['__main__'].square is square\n"
            "assert pickle.loads(pickle.dumps(square)) is square\n"
            "assert type(pickle.loads(pickle.dumps(Point()))) is Point\n"
            "with multiprocessing.Pool(2) as pool:\n"
            "    squares = pool.map(square, range(6))\n"
            "squares"
        )
    )
    assert execution.text == "[0, 1, 4, 9, 16, 25]"


@pytest.mark.all_backends
def test_get_ipython_and_what_ipython_publishes(sandbox: Sandbox) -> None:
    execution = _ok(
        sandbox.run_code(
            "from IPython import get_ipython\n"
            "from IPython.display import HTML, display, publish_display_data\n"
            "assert get_ipython() is globals()['get_ipython']()\n"
            "display(HTML('<b>shown</b>'))\n"
            "publish_display_data({'text/plain': 'raw', 'text/html': '<i>raw</i>'})\n"
            "type(get_ipython()).__name__"
        )
    )
    shown, raw, main = execution.results
    assert shown.html == "<b>shown</b>" and raw.html == "<i>raw</i>" and raw.text == "raw"
    assert [r.is_main_result for r in execution.results] == [False, False, True]
    assert main.text is not None and "Shell" in main.text


@pytest.mark.all_backends
def test_a_displayed_figure_is_sent_once(sandbox: Sandbox) -> None:
    """Through the display builtin, and through the display function IPython's own modules
    bound when they were imported (in a zygote, before the kernel could patch it)."""
    execution = _ok(
        sandbox.run_code(
            "import matplotlib.pyplot as plt\n"
            "from IPython.core import interactiveshell\n"
            "one = plt.figure()\n"
            "plt.plot([1, 2])\n"
            "display(one)\n"
            "two = plt.figure()\n"
            "plt.plot([2, 1])\n"
            "interactiveshell.display(two)\n"
        )
    )
    assert [r.png is not None for r in execution.results] == [True, True]
    assert not any(r.is_main_result for r in execution.results)


@pytest.mark.all_backends
def test_every_context_and_a_restarted_one_has_its_own_shell(fresh_sandbox: Sandbox) -> None:
    """The default kernel (forked from a zygote's, there), another context's and a
    restarted one's (fresh interpreters) each run IPython syntax in their own __main__."""
    sbx = fresh_sandbox
    ctx = sbx.create_code_context()
    _ok(sbx.run_code("where = 'default'"))
    _ok(sbx.run_code("where = 'other'", context=ctx))
    for context, name in ((None, "default"), (ctx, "other")):
        execution = _ok(sbx.run_code("!echo {where}\n%time where", context=context))
        assert execution.logs.stdout[0] == name + "\n"
        assert execution.text == repr(name)
    sbx.restart_code_context("default")
    execution = _ok(
        sbx.run_code("    import sys\n    %time sys.modules['__main__'].__dict__ is globals()")
    )
    assert execution.text == "True"


@pytest.mark.all_backends
def test_the_namespace_is_the_same_with_or_without_the_shell(fresh_sandbox: Sandbox) -> None:
    """Whether the shell started with the kernel (zygote) or at this cell's ``!true``
    (a cold kernel), a cell's names stay and IPython adds only get_ipython."""
    sbx = fresh_sandbox
    _ok(sbx.run_code("In = 'mine'\nOut = 'also mine'\n41 + 1"))
    _ok(sbx.run_code("!true"))
    execution = _ok(
        sbx.run_code("(In, Out, _, sorted(n for n in globals() if not n.startswith('__')))")
    )
    names = "['In', 'Out', '_', '_exit_code', 'get_ipython']"  # _exit_code: from !true
    assert execution.text == "('mine', 'also mine', 42, " + names + ")"


@pytest.mark.all_backends
def test_ipython_writes_no_history_and_no_config(sandbox: Sandbox) -> None:
    execution = _ok(
        sandbox.run_code(
            "import os, threading\n"
            "shell = get_ipython()\n"
            "(shell.history_manager.enabled, os.path.exists(os.path.expanduser('~/.ipython')),"
            " [t.name for t in threading.enumerate() if 'hist' in t.name.lower()])"
        )
    )
    assert execution.text == "(False, False, [])"


def test_a_cold_kernel_starts_ipython_only_when_a_cell_needs_it(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """Plain Python cells do not pay for importing IPython; get_ipython(), an import of
    IPython or IPython syntax start the shell (which then is the one every way)."""
    for first in (
        "get_ipython().run_line_magic('env', 'FIRST=1')",
        "import IPython\nIPython.get_ipython().run_line_magic('env', 'FIRST=1')",
        "%env FIRST=1",
    ):
        sbx = make_sandbox()
        plain = _ok(sbx.run_code("import sys\n'IPython' in sys.modules"))
        assert plain.text == "False"
        _ok(sbx.run_code(first))
        execution = _ok(
            sbx.run_code(
                "import os, IPython\n"
                "shell = get_ipython()\n"
                "(os.environ['FIRST'], shell is IPython.get_ipython(), type(shell).__name__)"
            )
        )
        assert execution.text == "('1', True, 'SandlotShell')", first


def test_the_precheck_reads_ipython_cells(make_sandbox: Callable[..., Sandbox]) -> None:
    """The advisory precheck reads a cell as the kernel runs it: a shell command is a
    shell-exec finding (so "refuse" refuses it), a harmless magic and an indented cell
    are not flagged and run."""
    sbx = make_sandbox(precheck="refuse")
    execution = sbx.run_code("!echo should-not-run")
    assert execution.error is not None and execution.error.name == "PrecheckRefused"
    assert execution.logs.stdout == []
    assert execution.precheck is not None and execution.precheck.syntax_ok
    assert [f.rule for f in execution.precheck.findings] == ["shell-exec"]
    harmless = _ok(sbx.run_code("    %matplotlib inline\n    x = 40\n    x + 2"))
    assert harmless.text == "42"
    assert harmless.precheck is not None and not harmless.precheck.flagged


def test_a_shell_command_stops_at_the_cells_timeout(fresh_sandbox: Sandbox) -> None:
    """The timeout kills the command; the cell is a timeout even if its code after the
    command ran before the interrupt reached the kernel."""
    _ok(fresh_sandbox.run_code("kept = 1"))
    started = time.monotonic()
    execution = fresh_sandbox.run_code("!sleep 60\nprint('after')", timeout=2)
    assert time.monotonic() - started < 30
    assert execution.status == "timeout"
    assert execution.error is not None and execution.error.name == "TimeoutError"
    assert _ok(fresh_sandbox.run_code("kept + 1")).text == "2"


@pytest.fixture
def readable_cache() -> Iterator[Path]:
    """A template cache the sandboxes' uid can read (pytest's tmp_path is private)."""
    cache = Path(tempfile.mkdtemp(prefix="ipython-test-cache-"))
    cache.chmod(0o755)
    try:
        yield cache
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_without_ipython_cells_are_plain_python(
    readable_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template without IPython: plain Python cells work as before (``__main__``
    included), IPython syntax is the SyntaxError Python gives."""
    from sandlot.templates import TEMPLATES, TemplateSpec

    monkeypatch.setenv("SANDLOT_CACHE_DIR", str(readable_cache))
    bare = TemplateSpec(name="bare", packages=(), description="test: no IPython", seed=False)
    monkeypatch.setitem(TEMPLATES, bare.name, bare)
    with Sandbox("bare", backend="bwrap", timeout=120) as sbx:
        execution = _ok(
            sbx.run_code(
                "import multiprocessing, pickle\n"
                "def cube(x):\n"
                "    return x ** 3\n"
                "assert pickle.loads(pickle.dumps(cube)) is cube\n"
                "with multiprocessing.Pool(2) as pool:\n"
                "    cubes = pool.map(cube, range(4))\n"
                "cubes"
            )
        )
        assert execution.text == "[0, 1, 8, 27]"
        assert execution.results[0].is_main_result
        assert _ok(sbx.run_code("import asyncio\nawait asyncio.sleep(0)\n'ok'")).text == "'ok'"
        for cell, name in (
            ("!echo hi", "SyntaxError"),
            ("%time 1", "SyntaxError"),
            ("    x = 1\n    x", "IndentationError"),
        ):
            failed = sbx.run_code(cell)
            assert failed.error is not None and failed.error.name == name, cell
        names = _ok(sbx.run_code("'get_ipython' in globals(), 'display' in dir(__builtins__)"))
        assert names.text == "(False, True)"
