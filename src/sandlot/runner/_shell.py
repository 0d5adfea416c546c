"""IPython cell syntax for a kernel, when the template has IPython.

A cell that is plain Python runs exactly as before (the kernel compiles it itself).
A cell that is not, such as one indented as a whole, ``!cmd``, ``%magic``,
``%%cell_magic``, ``x = !cmd`` or ``obj?``, is rewritten by IPython's input
transformers into Python that calls ``get_ipython()``, and then runs the same way.
The shell behind ``get_ipython()`` is an :class:`InteractiveShell` whose user
namespace is the kernel's ``__main__``, with the parts that would leave the sandbox's
model changed:

* shell commands (``!cmd``, ``%pip``, ``%sx``) run with ``subprocess`` on the kernel's
  own stdout/stderr pipes, so their output is the cell's output, and a timeout or an
  interrupt ends them like any other child of the cell (IPython's defaults read them
  through a pty and swallow Ctrl-C); the exit status is in ``_exit_code`` as in IPython;
* an error that IPython would print (inside ``%%time``, ``%run``) is raised instead,
  so the kernel reports it as the cell's ``ExecutionError``;
* ``display()`` and anything IPython publishes becomes a result event built by
  :mod:`sandlot.runner._display`, the same bundle as sandlot's own ``display()``;
* ``%matplotlib`` keeps the headless backend: figures come back as PNG results when
  the cell ends or at ``plt.show()``, as without it;
* no history database, no profile or config directory written, no terminal; the
  namespace gains only ``get_ipython`` (no ``In``/``Out``: they would keep every result
  alive in a memory-limited sandbox).

When the shell starts: a zygote makes one before it forks, and the default kernel
forked from it takes it (no cost in the first cell). A kernel started as a new
interpreter starts it on first need (IPython syntax, ``get_ipython()``, an import of
IPython), so plain Python cells never pay for importing IPython.

IPython is imported only here and only dynamically: the runner stays stdlib-only, and
a template without IPython gets :func:`start` returning None (plain Python cells).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
from typing import Any, Dict, List, Optional, Protocol, Tuple


class Kernel(Protocol):
    """What the shell needs from the kernel it serves."""

    def flush_streams(self) -> None: ...

    def bundle(self, obj: Any) -> Dict[str, Any]: ...

    def emit_bundle(self, bundle: Dict[str, Any]) -> None: ...


SHELL_MODULE = "IPython.core.interactiveshell"
PRELOAD = (
    SHELL_MODULE,
    # What creating a shell imports besides (most of the remaining start-up cost).
    "IPython.core.application",
    "IPython.core.completer",
    "IPython.core.completerlib",
    "IPython.core.magics",
    "IPython.core.oinspect",
)


_SERVING: List[Kernel] = []
"""The kernel this process's shell works for (a process has one)."""
_PRESTARTED: List[Any] = []
"""A shell made before the fork that made this process (in a zygote), not yet taken."""


def preload() -> None:
    """Import IPython and make a shell now (a zygote, before it forks kernels), if the
    template has IPython: the default kernel forked from it then takes it as its own
    (each fork has a copy), instead of spending milliseconds on it in the first cell."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            return  # no IPython (or a broken one): kernels run plain Python cells
    with contextlib.suppress(Exception):
        _PRESTARTED[:] = [_start(types.ModuleType("__main__"))]
    if _PRESTARTED:
        _warm_up(_PRESTARTED[0])


def _warm_up(shell: Any, rounds: int = 16) -> None:
    """Do what :func:`record` does to the shell at every cell, and undo it. Its first
    run in each sandbox cost the first cell ~0.3 ms of copy-on-write faults, most of
    it traitlets making the input history's lists (their defaults are made on first
    access) and its first calls into traitlets' validation. The shell is left as it
    was, but with those lists made (each fork has its own copy of them): the same
    execution count, the same (empty) history."""
    with contextlib.suppress(Exception):
        history = shell.history_manager
        history.input_hist_raw  # noqa: B018 - made on first access
        history.input_hist_parsed  # noqa: B018
        count = shell.execution_count
        try:
            for value in range(count + 1, count + 1 + rounds):
                shell.execution_count = value
        finally:
            shell.execution_count = count


def prestarted_main() -> Optional[types.ModuleType]:
    """The ``__main__`` of the shell made before the fork, for the kernel to run in."""
    return _PRESTARTED[0].user_module if _PRESTARTED else None


def available() -> bool:
    """Whether IPython can be imported (found without importing it)."""
    if "IPython" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("IPython") is not None
    except (ImportError, ValueError):
        return False


def start(kernel: Kernel, main: types.ModuleType) -> Optional[Any]:
    """Create the kernel's IPython shell on ``main``, or None without (a working) IPython.

    Must run after the kernel's import hooks are installed, so that IPython's display
    functions are sandlot's from their first import."""
    _SERVING[:] = [kernel]
    if _PRESTARTED and _PRESTARTED[0].user_module is main:
        return _PRESTARTED.pop()
    try:
        return _start(main)
    except Exception:  # a broken IPython leaves the kernel with plain Python cells
        return None


def _kernel() -> Kernel:
    return _SERVING[0]


def _start(main: types.ModuleType) -> Any:
    interactiveshell = importlib.import_module(SHELL_MODULE)
    profiledir = importlib.import_module("IPython.core.profiledir")
    displaypub = importlib.import_module("IPython.core.displaypub")
    config_module = importlib.import_module("traitlets.config")
    shell_class = _shell_class(interactiveshell.InteractiveShell)
    config = config_module.Config()
    config.HistoryManager.enabled = False  # no sqlite file, no saving thread
    config.InteractiveShell.colors = "nocolor"
    config.InteractiveShell.autocall = 0
    home = os.path.expanduser("~")
    before = dict(main.__dict__)
    shell = shell_class.instance(
        config=config,
        # An existing directory, so IPython creates none; ProfileDir() without a
        # location creates no profile (startup, security, log, pid) directories.
        ipython_dir=home if os.path.isdir(home) else tempfile.gettempdir(),
        profile_dir=profiledir.ProfileDir(),
        user_module=main,
    )
    # The namespace is as it was, plus get_ipython: a cell's own names (``_``, even
    # ``In``) are not replaced when the shell starts after some cells, and it looks the
    # same whether or not the shell has started (In, Out, _ih, _oh, _dh: IPython's
    # history, which the kernel does not keep; exit, quit and open: the builtins stay,
    # SystemExit is reported as an error).
    for name in list(main.__dict__):
        if name in before:
            main.__dict__[name] = before[name]
        elif name != "get_ipython":
            del main.__dict__[name]
    shell.display_pub = _publisher_class(displaypub.DisplayPublisher)(shell=shell, parent=shell)

    def formatter(
        obj: Any, include: Any = None, exclude: Any = None
    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        # What IPython's own display() formats (modules that bound it before the
        # kernel patched it, in a zygote): sandlot's bundle, as the kernel's display().
        return _kernel().bundle(obj), {}

    shell.display_formatter.format = formatter
    import builtins

    builtins.get_ipython = shell.get_ipython  # type: ignore[attr-defined]
    return shell


def transform(shell: Any, code: str) -> Optional[str]:
    """The cell rewritten by IPython's input transformers, or None if that fails."""
    try:
        source = shell.transform_cell(code)
    except Exception:
        return None
    return source if isinstance(source, str) else None


def record(shell: Any, count: int, raw: str, source: str) -> None:
    """Keep the shell's input history (``%history``) and execution count.

    No output history: it would keep every main result alive after the cell's own
    names are deleted, and a sandbox's memory is limited (``_`` holds the last one)."""
    with contextlib.suppress(Exception):
        shell.execution_count = count
        history = shell.history_manager
        history.input_hist_raw.append(raw)
        history.input_hist_parsed.append(source)


def _shell_class(base: Any) -> Any:
    class SandlotShell(base):  # type: ignore[misc]
        """IPython's shell for a sandlot kernel (see the module docstring)."""

        def system(self, cmd: str) -> None:
            # depth=1: variables are expanded from the frame that called system().
            self._run_system(self.var_expand(cmd, depth=1))

        system_raw = system
        system_piped = system

        def _run_system(self, cmd: str) -> None:
            _kernel().flush_streams()  # what the cell printed before comes first
            status = subprocess.call(cmd, shell=True, executable=_shell_path())
            if status > 128:  # IPython's convention: killed by signal N is -N
                status = -(status - 128)
            self.user_ns["_exit_code"] = status
            if getattr(self, "system_raise_on_error", False) and status != 0:
                raise subprocess.CalledProcessError(status, cmd)

        def getoutput(self, cmd: str, split: bool = True, depth: int = 0) -> Any:
            expanded = self.var_expand(cmd, depth=depth + 1)
            _kernel().flush_streams()
            done = subprocess.run(
                expanded,
                shell=True,
                executable=_shell_path(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                check=False,
            )
            self.user_ns["_exit_code"] = done.returncode
            if getattr(self, "system_raise_on_error", False) and done.returncode != 0:
                raise subprocess.CalledProcessError(done.returncode, cmd)
            text_module = importlib.import_module("IPython.utils.text")
            output = done.stdout.decode("utf-8", "replace")
            if split:
                return text_module.SList(output.splitlines())
            return text_module.LSString(output)

        def showtraceback(self, exc_tuple: Any = None, *args: Any, **kwargs: Any) -> None:
            # Where IPython would print a traceback and carry on, the cell fails
            # with the exception, so the caller gets it as the cell's error.
            error = exc_tuple[1] if exc_tuple else sys.exc_info()[1]
            if isinstance(error, BaseException):
                raise error

        def enable_matplotlib(self, gui: Optional[str] = None) -> Tuple[Any, Any]:
            # Figures already come back inline (the kernel sends open figures as
            # PNG results): keep the headless backend and the kernel's plt.show().
            pyplot = importlib.import_module("matplotlib.pyplot")
            return gui, pyplot.get_backend()

        def enable_gui(self, gui: Any = None) -> None:
            """No GUI event loop in a sandbox; accepted and ignored."""

    return SandlotShell


def _publisher_class(base: Any) -> Any:
    class SandlotPublisher(base):  # type: ignore[misc]
        """Sends what IPython publishes (``publish_display_data``) as a result."""

        def publish(self, data: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
            if not isinstance(data, dict):
                return
            bundle = {str(mime): value for mime, value in data.items() if value is not None}
            _kernel().emit_bundle(bundle)

        def clear_output(self, wait: bool = False) -> None:
            """Results already sent stay sent; accepted and ignored."""

    return SandlotPublisher


def _shell_path() -> Optional[str]:
    # Like IPython: the user's $SHELL if set, else /bin/sh.
    return os.environ.get("SHELL") or None
