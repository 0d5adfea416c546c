"""One code context's interpreter: runs cells in a persistent namespace.

Started by the supervisor as ``python -I -c <bootstrap> kernel --fd N``. It reads
``execute`` requests from its socket (fd N) and answers with ``stdout``,
``stderr``, ``result``, ``error`` and a final ``exit`` event per cell.

The kernel's fd 1 and fd 2 are pipes that the *supervisor* reads, so output from
subprocesses and C extensions is captured too, and nothing a cell prints can be
mistaken for a protocol message. Python-level ``sys.stdout``/``sys.stderr`` are
replaced by writers that send events on the socket directly, which keeps prints and
displays in the order the cell produced them.

The cells' namespace is the ``__main__`` module. A cell that is not Python (``!cmd``,
``%magic``, indented as a whole) is rewritten by IPython when the template has it
(:mod:`sandlot.runner._shell`); without IPython, cells are plain Python.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import errno
import gc
import importlib
import importlib.abc
import importlib.machinery
import io
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from typing import Any, Dict, List, Optional, Set

from sandlot.protocol import encode, loads
from sandlot.runner import _bash, _display, _limits, _shell
from sandlot.runner._processes import libc

FLUSH_INTERVAL = 0.05
"""Seconds a partial line may wait in the buffer before it is streamed anyway."""
CO_COROUTINE = 0x0080


class Channel:
    """The kernel's end of its socket to the supervisor; sends are thread-safe."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.reader = self.sock.makefile("rb")
        self.lock = threading.Lock()
        self.held = b""
        """An encoded message that waits to go out with the next one."""

    def send(self, message: Dict[str, Any], hold: bool = False) -> None:
        """Send ``message`` (with anything held before it, in order). ``hold``: keep it
        back until the next send instead: a cell's main result then travels with its
        ``exit`` in one write, so the supervisor (and the host) wake once, not twice."""
        data = encode(message)
        with self.lock:
            if self.held:
                data, self.held = self.held + data, b""
            if hold:
                self.held = data
                return
            self.sock.sendall(data)

    def receive(self) -> Optional[Dict[str, Any]]:
        line = self.reader.readline()
        if not line:
            return None
        message = loads(line)
        return message if isinstance(message, dict) else None


class EventStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` replacement that streams text as events."""

    def __init__(self, kernel: "Kernel", name: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.name = name
        self.buffer_parts: List[str] = []
        self.size = 0
        self.since = 0.0
        self.lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        # Code that asks for a real fd (subprocess, faulthandler) gets the pipe the
        # supervisor reads, so its output is still captured.
        return 1 if self.name == "stdout" else 2

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        if not text:
            return 0
        with self.lock:
            if not self.buffer_parts:
                self.since = time.monotonic()
            self.buffer_parts.append(text)
            self.size += len(text)
            urgent = "\n" in text or self.size >= 8192
        if urgent:
            self.flush()
        elif not self.kernel.flusher_started:
            self.kernel.start_flusher()
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if not self.buffer_parts:
                return
            text = "".join(self.buffer_parts)
            self.buffer_parts = []
            self.size = 0
        self.kernel.emit({"type": self.name, "text": text})

    def flush_if_stale(self) -> None:
        if self.buffer_parts and time.monotonic() - self.since >= FLUSH_INTERVAL:
            self.flush()


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs a patch right after selected modules are imported by user code.

    Used to make ``plt.show()`` emit figures in order and ``IPython.display.display``
    reach sandlot, without importing matplotlib or IPython before the user does.
    """

    def __init__(self, patches: Dict[str, Any]) -> None:
        self.patches = patches
        self.busy: Set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.patches or name in self.busy:
            return None
        self.busy.add(name)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        patch = self.patches[name]
        original_exec = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original_exec(module)
            with contextlib.suppress(Exception):
                patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


class Kernel:
    def __init__(
        self, channel: Channel, config: Dict[str, Any], main: Optional[types.ModuleType] = None
    ) -> None:
        self.channel = channel
        self.in_cell = False
        self.config = config
        self.count = 0
        self.current_id: Optional[str] = None
        # The cells' namespace is the ``__main__`` module's, as in a notebook: what a
        # cell defines pickles by reference (``multiprocessing`` workers find it).
        # (In a kernel forked from a zygote, the one of the shell made there.)
        self.main = main or _shell.prestarted_main() or types.ModuleType("__main__")
        self.namespace: Dict[str, Any] = self.main.__dict__
        self.namespace["__builtins__"] = builtins
        self.shell: Optional[Any] = None
        """IPython's shell for cell syntax beyond Python, once started."""
        self.ipython = False
        """Whether the template has IPython and the shell was not started yet."""
        self.stdout = EventStream(self, "stdout")
        self.stderr = EventStream(self, "stderr")
        self.figures_shown: Set[int] = set()
        self.bash = _bash.BashSession() if config.get("language") == "bash" else None
        """A bash context's session (None: a Python context)."""
        self.cell_envs: Dict[str, str] = {}
        self.flusher_lock = threading.Lock()
        self.flusher_started = False

    # --- events -----------------------------------------------------------------------
    def emit(self, message: Dict[str, Any], hold: bool = False) -> None:
        """Send an event of the running cell (``hold``: see :meth:`Channel.send`; the
        cell's ``exit``, always sent, takes a held event with it)."""
        if self.current_id is None:
            return  # output from a background thread between cells has no owner
        message["id"] = self.current_id
        self.channel.send(message, hold)

    def flush_streams(self) -> None:
        self.stdout.flush()
        self.stderr.flush()
        # C-level stdio of extensions writes to fd 1/2; push it into the pipes now.
        with contextlib.suppress(Exception):
            _c_fflush()

    def display(self, *objs: Any, is_main_result: bool = False) -> None:
        """The ``display()`` builtin: send each object as a rich result."""
        for obj in objs:
            data = self.bundle(obj)
            self.flush_streams()
            self.emit({"type": "result", "data": data, "is_main_result": is_main_result})

    def display_main(self, value: Any) -> None:
        """Send the cell's main result (its last expression's value). Held: it goes out
        in the same write as the cell's exit, which comes next (or with whatever the
        cell's end still prints first)."""
        data = self.bundle(value)
        # Python's streams only: C-level stdio goes to the pipes, which the supervisor
        # reads apart from these events; the cell's end flushes it before the exit.
        self.stdout.flush()
        self.stderr.flush()
        self.emit({"type": "result", "data": data, "is_main_result": True}, hold=True)

    def bundle(self, obj: Any) -> Dict[str, Any]:
        """The MIME bundle of an object being displayed (a figure is then not sent again
        when the cell ends)."""
        if _is_figure(obj):
            self.figures_shown.add(id(obj))
        return _display.mimebundle(obj)

    def emit_bundle(self, bundle: Dict[str, Any]) -> None:
        """Send a MIME bundle someone else built (IPython's publish) as a result."""
        bundle = _display.json_safe_bundle(bundle)
        if not bundle:
            return
        self.flush_streams()
        self.emit({"type": "result", "data": bundle, "is_main_result": False})

    def flush_figures(self) -> None:
        """Send every open matplotlib figure as a PNG result, then close them."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            numbers = list(pyplot.get_fignums())
        except Exception:
            return
        for number in numbers:
            figure = pyplot.figure(number)
            if id(figure) not in self.figures_shown:
                self.flush_streams()
                self.emit(
                    {"type": "result", "data": _display.mimebundle(figure), "is_main_result": False}
                )
            pyplot.close(figure)
        self.figures_shown.clear()

    # --- setup ------------------------------------------------------------------------
    def install(self) -> None:
        sys.stdout = self.stdout
        sys.stderr = self.stderr
        sys.modules["__main__"] = self.main
        builtins.display = self.display  # type: ignore[attr-defined]
        # Like Jupyter: modules uploaded next to the notebook are importable.
        if "" not in sys.path:
            sys.path.insert(0, "")
        self.ipython = _shell.available()
        hooks = {
            "matplotlib.pyplot": self._patch_pyplot,
            "IPython.core.display_functions": self._patch_ipython,
            "IPython.display": self._patch_ipython,
            "PIL.Image": self._patch_pil,
            # Whatever imports IPython can see its shell: start it then, if not before.
            "IPython": self._start_shell,
        }
        sys.meta_path.insert(0, _PostImportHook(hooks))
        # A kernel forked from a zygote has some of them imported already (IPython's
        # shell then starts now, in a few milliseconds).
        for name, patch in hooks.items():
            module = sys.modules.get(name)
            if module is not None:
                patch(module)
        if self.ipython:
            # Not imported yet (a cold kernel): importing IPython would cost every
            # sandbox's first cell tens of milliseconds, so the shell starts when a cell
            # needs it (IPython syntax, get_ipython(), an import of IPython).
            self.namespace["get_ipython"] = self._get_ipython
            builtins.get_ipython = self._get_ipython  # type: ignore[attr-defined]

    def start_flusher(self) -> None:
        """Start the thread that streams a partial line once it is stale: when the first
        one is buffered, not at start-up, so a sandbox whose output ends in newlines
        never starts it (a thread's start, and its wake-ups every FLUSH_INTERVAL while
        the sandbox idles, are CPU every sandbox paid)."""
        with self.flusher_lock:
            if self.flusher_started:
                return
            flusher = threading.Thread(target=self._flush_loop, name="sandlot-flush", daemon=True)
            try:
                flusher.start()
            except RuntimeError:
                return  # no thread to be had (user code used them up): the cell's end flushes
            self.flusher_started = True

    def _flush_loop(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL)
            try:
                self.stdout.flush_if_stale()
                self.stderr.flush_if_stale()
            except Exception:
                pass

    def ensure_shell(self) -> Optional[Any]:
        """IPython's shell, started on first need; None if the template has no IPython."""
        if self.shell is None and self.ipython:
            self.ipython = False  # one attempt: a shell that failed to start stays off
            try:
                self.shell = _shell.start(self, self.main)
            except BaseException:
                self.ipython = True  # interrupted (a timeout): the next cell tries again
                raise
            finally:
                # Creating it set the display builtin to IPython's; the kernel's first.
                builtins.display = self.display  # type: ignore[attr-defined]
            stub = self.namespace.get("get_ipython") == self._get_ipython
            if self.shell is None:
                if stub:
                    del self.namespace["get_ipython"]
                with contextlib.suppress(AttributeError):
                    del builtins.get_ipython  # type: ignore[attr-defined]
            elif stub:
                self.namespace["get_ipython"] = self.shell.get_ipython
        return self.shell

    def _get_ipython(self) -> Optional[Any]:
        """``get_ipython()`` before the shell started (it replaces this one)."""
        return self.ensure_shell()

    def _start_shell(self, module: Any) -> None:
        self.ensure_shell()

    def _patch_pyplot(self, pyplot: Any) -> None:
        kernel = self

        def show(*args: Any, **kwargs: Any) -> None:
            kernel.flush_figures()

        pyplot.show = show
        _accept_boxplot_labels(pyplot)

    def _patch_pil(self, image_module: Any) -> None:
        # As in E2B's code-interpreter template: an image saved to a file is also shown,
        # so an agent that writes `img.save("out.png")` gets the picture back. Only saves
        # to a path: PIL's own PNG rendering saves into an in-memory buffer.
        kernel = self
        image_class = image_module.Image
        original = image_class.save

        def save(image: Any, fp: Any, *args: Any, **kwargs: Any) -> Any:
            saved = original(image, fp, *args, **kwargs)
            if isinstance(fp, (str, os.PathLike)) and kernel.in_cell:
                kernel.display(image)
            return saved

        save.__wrapped__ = original  # type: ignore[attr-defined]
        save.__doc__ = original.__doc__
        image_class.save = save

    def _patch_ipython(self, module: Any) -> None:
        kernel = self

        def display(*objs: Any, **kwargs: Any) -> None:
            if kwargs.get("raw"):
                # raw=True: each object is already a MIME bundle ({mime type: data}).
                for obj in objs:
                    if isinstance(obj, dict):
                        kernel.emit_bundle(obj)
                return
            kernel.display(*objs)

        module.display = display

    # --- cells ------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            request = self.channel.receive()
            if request is None or request.get("type") == "shutdown":
                return
            if request.get("type") == "execute":
                self.execute(request)

    def execute(self, request: Dict[str, Any]) -> None:
        # A silent cell (a warm pool's imports) leaves the cell counter alone.
        if request.get("silent") is not True:
            self.count += 1
        self.current_id = str(request.get("id"))
        envs = request.get("envs") or {}
        saved_env = {key: os.environ.get(key) for key in envs}
        if envs or self.cell_envs:
            self.cell_envs = {str(k): str(v) for k, v in envs.items()}
            os.environ.update(self.cell_envs)
        status = "ok"
        try:
            self.in_cell = True
            try:
                status = self._run_cell(str(request.get("code", "")))
            except KeyboardInterrupt:
                # Landed in _run_cell's own bookkeeping, after the user's code.
                status = "interrupted"
            finally:
                self.in_cell = False
            if status == "interrupted":
                with contextlib.suppress(KeyboardInterrupt, OSError):
                    _reap_killed_children()
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            try:
                self.flush_streams()
            finally:
                exit_event = {"type": "exit", "status": status, "execution_count": self.count}
                if status == "oom-kept":
                    # Out of memory in a system call: the interpreter is sound, so the
                    # kernel and its variables stay (the supervisor must not wait for
                    # a fresh kernel).
                    exit_event.update(status="oom", kept=True)
                self.emit(exit_event)
                self.current_id = None
        if status == "oom":
            # The interpreter may be in a bad state after MemoryError; the supervisor
            # starts a fresh kernel for this context.
            os._exit(0)

    def _parse(self, code: str, filename: str) -> "tuple[ast.Module, str]":
        """The cell's syntax tree, and the source it was parsed from.

        Plain Python is parsed as it is. Anything else goes through IPython's input
        transformers when there is a shell (whole-cell indentation, ``!cmd``,
        ``%magic``, ``%%magic``...); a SyntaxError is that of the source that ran."""
        try:
            return ast.parse(code, filename=filename, mode="exec"), code
        except SyntaxError:
            shell = self.ensure_shell()
            if shell is None:
                raise
            source = _shell.transform(shell, code)
            if source is None or source.rstrip() == code.rstrip():
                raise
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        return ast.parse(source, filename=filename, mode="exec"), source

    def _run_cell(self, code: str) -> str:
        if self.bash is not None:
            return self._run_bash(code)
        filename = "<cell-%d>" % self.count
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        try:
            # Inside the handlers below: IPython's transformers run Python code on the
            # cell, which a timeout may interrupt or a huge cell may run out of memory in.
            tree, source = self._parse(code, filename)  # a SyntaxError is reported below
            last: Optional[ast.expr] = None
            silent = code.rstrip().endswith(";") or source.rstrip().endswith(";")
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = tree.body[-1].value
                tree.body.pop()
            if tree.body:  # (a cell that is one expression has nothing else to run)
                self._run(compile(tree, filename, "exec", flags=flags))
            if last is not None:
                expr = compile(ast.Expression(body=last), filename, "eval", flags=flags)
                value = self._run(expr)
                if value is not None and not silent:
                    self.namespace["_"] = value
                    if not _is_figure(value):
                        self.display_main(value)
            self.flush_figures()
            if self.shell is not None:
                _shell.record(self.shell, self.count, code, source)
        except MemoryError:
            self.namespace.clear()
            gc.collect()
            self.flush_streams()
            limit = self.config.get("memory_mb")
            self.emit(
                {
                    "type": "error",
                    "name": "OutOfMemoryError",
                    "value": "the cell ran out of memory (limit %s MiB per process); the kernel "
                    "was restarted and its variables were lost" % (limit or "?"),
                    "traceback": "MemoryError",
                }
            )
            return "oom"
        except KeyboardInterrupt as exc:
            self._report(exc)
            return "interrupted"
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                self._report(exc)
                return "error"
            # A system call found no memory: the sandbox's cgroup is full (other
            # processes of the cell filled it) or the address-space limit was reached.
            # The same outcome as MemoryError, but Python's own state is intact.
            limit = self.config.get("memory_mb")
            self._report(
                exc,
                name="OutOfMemoryError",
                value="the cell ran out of memory (%s; the limit is %s MiB per process and "
                "for the sandbox as a whole); variables from earlier cells are kept"
                % (exc, limit or "?"),
            )
            return "oom-kept"
        except BaseException as exc:  # user code may raise anything, SystemExit included
            self._report(exc)
            return "error"
        return "ok"

    def _run_bash(self, code: str) -> str:
        assert self.bash is not None
        self.flush_streams()
        try:
            status = self.bash.run(code, self.cell_envs)
        except KeyboardInterrupt as exc:
            self._report(exc)
            return "interrupted"
        except OSError as exc:
            self._report(exc)
            return "error"
        if status == 0:
            return "ok"
        if status in (-signal.SIGKILL, -signal.SIGINT):
            # Killed by the supervisor (an interrupt or a timeout, whose SIGINT to this
            # process may land later): reported as the interrupt it was.
            self._report(KeyboardInterrupt())
            return "interrupted"
        self.emit(
            {
                "type": "error",
                "name": "ExitCodeError",
                "value": "bash exited with status %d" % (status if status > 0 else 128 - status),
                "traceback": "",
            }
        )
        return "error"

    def _run(self, code: types.CodeType) -> Any:
        if code.co_flags & CO_COROUTINE:
            import asyncio

            return asyncio.run(eval(code, self.namespace))
        return eval(code, self.namespace)

    def _report(
        self, exc: BaseException, name: Optional[str] = None, value: Optional[str] = None
    ) -> None:
        with contextlib.suppress(Exception):
            self.flush_figures()
        self.flush_streams()
        tb = exc.__traceback__
        # Drop the kernel's own frames so the traceback starts in the user's cell.
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
            tb = tb.tb_next
        lines = traceback.format_exception(type(exc), exc, tb)
        self.emit(
            {
                "type": "error",
                "name": name or type(exc).__name__,
                "value": str(exc) if value is None else value,
                "traceback": "".join(lines),
            }
        )


_fflush: Any = None


def _c_fflush() -> None:
    """``fflush(NULL)``: C stdio buffers of extensions out into the pipes. Through the
    runner's one C library handle, looked up once (a kernel forked from a zygote finds
    it looked up there: making a ``CDLL`` of its own cost its first cell ~0.4 ms)."""
    global _fflush
    if _fflush is None:
        _fflush = libc().fflush
    _fflush(None)


_BOXPLOT_CHECKED: List[Any] = []
"""The pyplot module :func:`_accept_boxplot_labels` has done, once a process (a zygote
does it before it forks: reading the signature cost each forked kernel ~0.3 ms)."""


def _accept_boxplot_labels(pyplot: Any) -> None:
    """``boxplot(labels=...)``, the spelling matplotlib used until 3.9 (and most code
    written for E2B and by models still uses), works on a matplotlib that removed it:
    it is passed on as ``tick_labels`` (``plt.boxplot`` and ``Axes.boxplot``). A
    matplotlib that still has ``labels`` is left alone. Once per pyplot module."""
    if any(done is pyplot for done in _BOXPLOT_CHECKED):
        return
    _BOXPLOT_CHECKED.append(pyplot)
    with contextlib.suppress(Exception):
        import inspect

        from matplotlib.axes import Axes

        parameters = inspect.signature(Axes.boxplot).parameters
        if "labels" in parameters or "tick_labels" not in parameters:
            return
        Axes.boxplot = _renaming_labels(Axes.boxplot)  # type: ignore[method-assign]
        pyplot.boxplot = _renaming_labels(pyplot.boxplot)


def _renaming_labels(original: Any) -> Any:
    def boxplot(*args: Any, **kwargs: Any) -> Any:
        if "labels" in kwargs and "tick_labels" not in kwargs:
            kwargs["tick_labels"] = kwargs.pop("labels")
        return original(*args, **kwargs)

    boxplot.__wrapped__ = original  # type: ignore[attr-defined]
    boxplot.__doc__ = original.__doc__
    boxplot.__name__ = "boxplot"
    return boxplot


def _is_figure(obj: Any) -> bool:
    return type(obj).__name__ == "Figure" and type(obj).__module__.startswith("matplotlib.")


def main(argv: List[str]) -> int:
    fd = int(argv[argv.index("--fd") + 1])
    config = json.loads(argv[argv.index("--config") + 1]) if "--config" in argv else {}
    try:  # before any user code: everything the cells start inherits these
        _limits.apply(config.get("rlimits") or {})
    except (OSError, ValueError) as exc:
        sys.stderr.write("sandlot kernel: cannot apply resource limits: %s\n" % exc)
        return 70
    kernel = Kernel(Channel(fd), config)

    def on_sigint(signum: int, frame: Any) -> None:
        # An interrupt is for the running cell. One that arrives between cells (the
        # host asked just as the cell ended) must not kill the kernel's read loop.
        if kernel.in_cell:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    kernel.install()
    preload = config.get("preload") or []
    if preload:
        # After install(), so the import hooks patch pyplot exactly as for user imports.
        _preload(preload)
        kernel.channel.send({"type": "preloaded"})
    kernel.run()
    return 0


def _preload(names: List[str]) -> None:
    """Import modules for the user (a warm pool's data stack), leaving no trace in the
    cell namespace: they land in ``sys.modules`` only, as after any ``import``.

    A module that fails to import is skipped; the user's own import then fails the
    usual way. ``gc.freeze()`` afterwards moves everything imported out of the
    collector's reach, so later collections do not touch (and un-share) those pages.
    """
    if any(name == "matplotlib" or name.startswith("matplotlib.") for name in names):
        with contextlib.suppress(Exception):
            import matplotlib

            matplotlib.use("Agg")  # headless, whatever the environment says
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # ImportError, or anything a module raises
            message = "sandlot kernel: preload %s failed: %r\n" % (name, exc)
            os.write(2, message.encode("utf-8", "replace"))
    gc.collect()
    gc.freeze()


def _reap_killed_children() -> None:
    """Reap this kernel's dead children that no ``subprocess.Popen`` owns.

    On a timeout or interrupt the supervisor SIGKILLs everything the cell started.
    Children the cell forked itself (``os.fork``) stay zombies of this kernel until it
    waits for them, and each still counts against the sandbox's pids limit: a fork
    bomb's first generation would keep the sandbox from starting any command. A
    ``Popen``'s own zombie is left to its ``wait()``, which reports how it ended.
    """
    module = sys.modules.get("subprocess")
    popen = getattr(module, "Popen", None)
    owned = {o.pid for o in gc.get_objects() if popen is not None and isinstance(o, popen)}
    me = str(os.getpid()).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in owned:
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] == b"Z" and fields[1] == me:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(name), os.WNOHANG)
