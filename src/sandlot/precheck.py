"""Advisory static checks of a cell before it runs: advice and audit, never the boundary.

::

    from sandlot.precheck import check

    report = check("import subprocess; subprocess.run(['id'])")
    report.flagged                      # True
    [f.rule for f in report.findings]   # ['import-not-allowed', 'shell-exec']
    report.to_dict()                    # JSON-ready, for an audit trail or an approval UI

:func:`check` parses the code with :mod:`ast` (it never runs or imports anything) and
reports what a reviewer would want to look at: a syntax error, imports outside an
allowlist, and patterns that code trying to leave a Python-level jail uses (dunder
walks, ``ctypes``, shelling out, ``eval``/``exec`` of computed or decoded strings,
imports by computed name). It is pure and cheap: one parse and one walk, about 1.5 to
2.5 times a bare ``ast.parse`` of the cell (``bench/precheck.py``: 0.6 ms for a typical
20-line pandas cell on a quiet 2-core machine), so the SDK runs it on every ``run_code``.

It is trivially bypassable and is not a security boundary: Python can reach any
capability without naming it. The operating-system sandbox is what holds; see
SECURITY.md. Use the report to route code to a human, to refuse obviously hostile
cells early, or to keep a record.

Rule ids (stable; match on these, not on messages):

=====================  =========  ===========================================================
rule                   severity   what
=====================  =========  ===========================================================
``syntax-error``       warning    the code does not parse, even as an IPython cell
                                  (nothing else could be checked)
``ipython-magic``      info       an IPython ``%magic`` or ``%%magic`` that runs no shell
``import-not-allowed`` warning    a module outside the allowlist (``danger`` for ``ctypes``,
                                  ``subprocess``, ``pty`` and other escape tooling)
``dunder-access``      danger     ``__subclasses__``, ``__globals__``, ``__builtins__``,
                                  ``__mro__``, ``__bases__``, ``__code__``... as an attribute,
                                  a name or a string (``getattr(x, "__globals__")``)
``frame-access``       danger     ``sys._getframe``, ``inspect.currentframe``, ``f_globals``...
``shell-exec``         danger     ``os.system``/``popen``/``exec*``/``spawn*``,
                                  ``subprocess.*``, ``pty.spawn``; IPython's ``!cmd``,
                                  ``%pip``, ``%sx``, ``%%bash`` and other shell magics
``dynamic-exec``       danger     ``eval``/``exec``/``compile`` of a non-literal string
``decoded-exec``       danger     ``eval``/``exec``/``compile`` fed from base64, codecs,
                                  zlib, ``bytes.fromhex``, ``marshal``...
``obfuscated-import``  danger     ``__import__``/``importlib.import_module`` of a computed name
``dynamic-getattr``    warning    ``getattr``/``setattr``/``delattr`` with a computed name
                                  (it may be a dunder)
``code-object``        danger     building code or functions by hand (``types.CodeType``,
                                  ``types.FunctionType``, ``marshal.loads``)
=====================  =========  ===========================================================
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

__all__ = [
    "DEFAULT_ALLOWED_IMPORTS",
    "RISKY_MODULES",
    "Finding",
    "PrecheckReport",
    "Severity",
    "check",
]

Severity = Literal["info", "warning", "danger"]
_FLAGGING: frozenset[str] = frozenset({"warning", "danger"})

RISKY_MODULES: frozenset[str] = frozenset(
    {
        "ctypes",
        "_ctypes",
        "cffi",
        "subprocess",
        "_posixsubprocess",
        "pty",
        "pexpect",
        "sh",
        "plumbum",
        "posix",
        "builtins",
        "__builtin__",
        "importlib",
        "imp",
        "gc",
        "inspect",
        "marshal",
        "runpy",
        "code",
        "codeop",
        "socket",
        "_socket",
        "mmap",
    }
)
"""Modules whose import is reported as ``danger``: the usual tools for reaching native
code, processes, the interpreter's internals, or the network."""

_DATA_LIBRARIES = frozenset(
    {
        # The python-data template, plus what its users import from it by name.
        "pandas",
        "numpy",
        "matplotlib",
        "mpl_toolkits",
        "seaborn",
        "scipy",
        "sklearn",
        "openpyxl",
        "IPython",
        "dateutil",
        "pytz",
        "PIL",
        "joblib",
        "threadpoolctl",
    }
)

_STDLIB_NOT_ALLOWED = RISKY_MODULES | {
    # Network clients and servers (the sandbox has no network; code that tries is suspect).
    "ssl",
    "http",
    "urllib",
    "ftplib",
    "smtplib",
    "smtpd",
    "poplib",
    "imaplib",
    "nntplib",
    "telnetlib",
    "xmlrpc",
    "socketserver",
    "asyncore",
    "asynchat",
    "webbrowser",
    "wsgiref",
    # Interpreter internals, debuggers and loaders.
    "pickle",
    "shelve",
    "dis",
    "pdb",
    "bdb",
    "trace",
    "pkgutil",
    "zipimport",
    "modulefinder",
    "site",
    "sysconfig",
    "faulthandler",
    "tracemalloc",
    "symtable",
    "pydoc",
    # OS-level and terminal plumbing.
    "fcntl",
    "resource",
    "termios",
    "tty",
    "pwd",
    "grp",
    "spwd",
    "crypt",
    "syslog",
    "nis",
    "pipes",
    "multiprocessing",
    # Installers, GUIs and jokes.
    "ensurepip",
    "venv",
    "distutils",
    "lib2to3",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "antigravity",
    "this",
    # Other platforms.
    "msvcrt",
    "winreg",
    "winsound",
    "nt",
    "msilib",
}

DEFAULT_ALLOWED_IMPORTS: frozenset[str] = (
    _DATA_LIBRARIES
    | frozenset(
        name
        for name in sys.stdlib_module_names
        if not name.startswith("_") and name not in _STDLIB_NOT_ALLOWED
    )
    | {"__future__"}
)
"""Top-level module names :func:`check` accepts by default: the python-data template's
libraries and the standard library minus network, interpreter-internal, OS-plumbing and
:data:`RISKY_MODULES` (``os``, ``sys``, ``pathlib``, ``threading`` are allowed: cells use
them all the time; their risky calls have rules of their own)."""

# Attribute names used to walk from any object to modules, builtins or code.
_DUNDERS = frozenset(
    {
        "__subclasses__",
        "__globals__",
        "__builtins__",
        "__mro__",
        "__bases__",
        "__base__",
        "__code__",
        "__closure__",
        "__func__",
        "__self__",
        "__getattribute__",
        "__dict__",
        "__class__",
        "__import__",
        "__loader__",
        "__spec__",
        "__reduce__",
        "__reduce_ex__",
        "__init_subclass__",
        "__set_name__",
        "__kwdefaults__",
        "__defaults__",
    }
)
# Common and harmless on their own (type(x).__name__ is everywhere); they count only as a
# step of a chain that goes on to another dunder: ().__class__.__bases__[0]...
_BENIGN_ALONE = frozenset({"__class__", "__dict__", "__func__", "__spec__"})
_FRAME_ATTRS = frozenset(
    {
        "f_globals",
        "f_locals",
        "f_builtins",
        "f_back",
        "f_code",
        "gi_frame",
        "cr_frame",
        "ag_frame",
        "tb_frame",
        "tb_next",
        "co_code",
        "co_consts",
    }
)
_FRAME_CALLS = frozenset(
    {"sys._getframe", "inspect.currentframe", "inspect.stack", "inspect.getouterframes"}
)
_SHELL_PREFIXES = ("os.exec", "os.spawn", "os.posix_spawn", "subprocess.", "pty.")
_SHELL_CALLS = frozenset(
    {"os.system", "os.popen", "os.fork", "os.forkpty", "os.startfile", "posix.system"}
)
_CODE_CALLS = frozenset(
    {"types.CodeType", "types.FunctionType", "marshal.loads", "marshal.load", "pickle.loads"}
)
_DECODERS = frozenset(
    {
        "base64.b64decode",
        "base64.b32decode",
        "base64.b16decode",
        "base64.b85decode",
        "base64.a85decode",
        "base64.urlsafe_b64decode",
        "base64.standard_b64decode",
        "base64.decodebytes",
        "binascii.a2b_base64",
        "binascii.unhexlify",
        "binascii.a2b_hex",
        "codecs.decode",
        "zlib.decompress",
        "bz2.decompress",
        "lzma.decompress",
        "gzip.decompress",
        "bytes.fromhex",
        "bytearray.fromhex",
        "marshal.loads",
    }
)
_DECODER_METHODS = frozenset({"decode", "fromhex", "b64decode", "decompress", "translate"})
_EXEC_BUILTINS = frozenset({"eval", "exec", "compile"})
_IMPORTERS = frozenset({"__import__", "importlib.import_module", "importlib.__import__"})
_ATTR_BUILTINS = frozenset({"getattr", "setattr", "delattr"})


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing :func:`check` wants a reviewer to look at."""

    rule: str
    """Stable rule id, e.g. ``"shell-exec"`` (see the module docstring)."""
    severity: Severity
    message: str
    line: int
    """1-based line in the cell (0 when unknown)."""
    col: int
    """0-based column, as :mod:`ast` counts."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "message": self.message,
            "line": self.line,
            "col": self.col,
        }


@dataclass(frozen=True, slots=True)
class PrecheckReport:
    """What :func:`check` found in one cell. Advice only: an empty report proves nothing."""

    findings: tuple[Finding, ...] = ()
    syntax_ok: bool = True

    @property
    def flagged(self) -> bool:
        """True when any finding is a ``warning`` or ``danger`` (``info`` never flags)."""
        return any(f.severity in _FLAGGING for f in self.findings)

    def summary(self) -> str:
        """One line per flagging finding (``line:col rule: message``), for messages."""
        return "\n".join(
            f"{f.line}:{f.col} {f.rule}: {f.message}"
            for f in self.findings
            if f.severity in _FLAGGING
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "syntax_ok": self.syntax_ok,
            "flagged": self.flagged,
            "findings": [f.to_dict() for f in self.findings],
        }


def check(code: str, *, allowed_imports: frozenset[str] | None = None) -> PrecheckReport:
    """Statically inspect ``code`` (never run it) and report risky patterns.

    :param allowed_imports: top-level module names an import may name without a
        finding; None means :data:`DEFAULT_ALLOWED_IMPORTS`. Pass
        ``DEFAULT_ALLOWED_IMPORTS | {"requests"}`` to extend the default.
    :returns: a :class:`PrecheckReport`; a syntax error is a finding, never an exception.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be str, not {type(code).__name__}")
    extra: list[Finding] = []
    try:
        tree = _parse(code)
    except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes in the source
        # Maybe IPython cell syntax (the kernel runs it when the template has IPython):
        # check the Python that is left, and report the shell-outs and magics.
        view = _ipython_view(code)
        parsed = None
        if view is not None:
            try:
                parsed = _parse(view[0])
            except (SyntaxError, ValueError):
                parsed = None
        if parsed is None or view is None:
            return PrecheckReport(findings=(_syntax_finding(exc),), syntax_ok=False)
        tree, extra = parsed, view[1]
    allowed = DEFAULT_ALLOWED_IMPORTS if allowed_imports is None else allowed_imports
    checker = _Checker(allowed)
    checker.visit(tree)
    findings = sorted([*checker.findings.values(), *extra], key=lambda f: (f.line, f.col, f.rule))
    return PrecheckReport(findings=tuple(findings), syntax_ok=True)


_PARSE_LOCK = threading.Lock()


def _parse(code: str) -> ast.Module:
    """``ast.parse``, one thread at a time: CPython before 3.12 keeps the AST builder's
    recursion depth per interpreter, so two threads parsing at once can fail with
    ``SystemError: AST constructor recursion depth mismatch`` (CPython gh-106905)."""
    with _PARSE_LOCK:
        return ast.parse(code)


def _syntax_finding(exc: Exception) -> Finding:
    line = getattr(exc, "lineno", None) or 0
    col = max(0, (getattr(exc, "offset", None) or 1) - 1)
    detail = getattr(exc, "msg", None) or str(exc)
    return Finding(
        "syntax-error",
        "warning",
        f"{type(exc).__name__}: {detail}; the code could not be checked",
        line,
        col,
    )


# Magics that run a shell command (reported as shell-exec), and cell magics whose body
# is Python (checked as such); any other magic is reported as ipython-magic (info).
_SHELL_MAGICS = frozenset(
    {"sx", "system", "sc", "pip", "conda", "mamba", "bash", "sh", "script", "perl", "ruby"}
)
_PYTHON_CELL_MAGICS = frozenset({"time", "timeit", "capture", "prun", "debug"})
_ASSIGNED_MAGIC = re.compile(r"^([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*=\s*([!%])")


def _ipython_view(code: str) -> tuple[str, list[Finding]] | None:
    """The Python in an IPython cell, line for line, and findings for the rest.

    Whole-cell indentation is removed; a ``!cmd``, ``%magic``, ``x = !cmd`` or
    ``obj?`` line becomes ``pass`` (or ``x = None``) at its indentation; a cell magic's
    body is checked as Python where IPython runs it as Python (``%%time``). None when
    the cell has none of this (its syntax error stands). Line-based, as IPython's own
    transformers are: advice, never the boundary.
    """
    lines = textwrap.dedent(code).split("\n")
    findings: list[Finding] = []
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None and lines[first].lstrip().startswith("%%"):
        stripped = lines[first].strip()
        name = stripped[2:].split(None, 1)[0] if len(stripped) > 2 else ""
        findings.append(_magic_finding(name, stripped, first + 1, cell=True))
        if name not in _PYTHON_CELL_MAGICS:
            return "", findings  # the body is not Python (a shell script, a file...)
        lines[first] = ""
    changed = bool(findings) or textwrap.dedent(code) != code
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        assigned = _ASSIGNED_MAGIC.match(stripped)
        if assigned:
            target, rest = assigned.group(1), stripped[assigned.end(2) - 1 :]
            replacement = f"{indent}{target} = None"
        elif stripped.startswith(("!", "%")):
            rest, replacement = stripped, f"{indent}pass"
        elif stripped.endswith("?") and not stripped.startswith("#"):
            lines[number - 1] = f"{indent}pass"  # obj? / obj?? : IPython's help
            changed = True
            continue
        else:
            continue
        if rest.startswith("!"):
            findings.append(
                Finding(
                    "shell-exec",
                    "danger",
                    f"runs a shell command: {rest[:80]}",
                    number,
                    len(indent),
                )
            )
        else:
            name = rest.lstrip("%").split(None, 1)[0] if len(rest) > 1 else ""
            findings.append(_magic_finding(name, rest, number, cell=False, col=len(indent)))
        lines[number - 1] = replacement
        changed = True
    return ("\n".join(lines), findings) if changed else None


def _magic_finding(name: str, text: str, line: int, *, cell: bool, col: int = 0) -> Finding:
    if name in _SHELL_MAGICS:
        return Finding("shell-exec", "danger", f"runs a shell command: {text[:80]}", line, col)
    kind = "cell" if cell else "line"
    return Finding("ipython-magic", "info", f"IPython {kind} magic: {text[:80]}", line, col)


class _Checker(ast.NodeVisitor):
    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        self.findings: dict[tuple[str, int, int], Finding] = {}
        self.aliases: dict[str, str] = {}
        """Local name -> qualified name it was imported as (``sp`` -> ``subprocess``)."""
        self.decoded: set[str] = set()
        """Names assigned from a decoding expression (candidates for decoded-exec)."""

    # NodeVisitor's walk, in the same order with the same visit_* methods, but with the
    # method of each node type looked up once: it runs on every cell, and the generic
    # walk (a getattr by name per node) was most of the pre-check's cost.
    _methods: ClassVar[dict[type[ast.AST], Callable[[_Checker, Any], None] | None]] = {}

    def visit(self, node: ast.AST) -> None:
        kind = type(node)
        try:
            method = self._methods[kind]
        except KeyError:
            method = self._methods[kind] = getattr(_Checker, "visit_" + kind.__name__, None)
        if method is None:
            self.generic_visit(node)
        else:
            method(self, node)

    def generic_visit(self, node: ast.AST) -> None:
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def add(self, rule: str, severity: Severity, message: str, node: ast.AST) -> None:
        line = getattr(node, "lineno", 0)
        col = getattr(node, "col_offset", 0)
        # One finding per rule and position: a chain is reported once, not per link.
        self.findings.setdefault((rule, line, col), Finding(rule, severity, message, line, col))

    # --- names ------------------------------------------------------------------------
    def qualname(self, node: ast.AST) -> str | None:
        """``sp.run`` -> ``subprocess.run`` after ``import subprocess as sp``."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def module(self, name: str, node: ast.AST) -> None:
        top = name.split(".", 1)[0]
        if top in self.allowed:
            return
        risky = top in RISKY_MODULES
        self.add(
            "import-not-allowed",
            "danger" if risky else "warning",
            f"imports {name!r}, which is not in the allowed imports"
            + (" (a common tool for escaping a Python-level sandbox)" if risky else ""),
            node,
        )

    # --- imports ----------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.module(alias.name, node)
            local = alias.asname or alias.name.split(".", 1)[0]
            self.aliases[local] = alias.name if alias.asname else local

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return  # relative: nothing to import from in a cell
        self.module(node.module, node)
        for alias in node.names:
            qualified = f"{node.module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = qualified
            self.call_target(qualified, node)  # from os import system
            if alias.name in _DUNDERS:
                self.add("dunder-access", "danger", f"imports {alias.name}", node)

    # --- attribute and name access ----------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if attr in _DUNDERS:
            if attr not in _BENIGN_ALONE or _chain_has_dunder(node.value):
                self.add("dunder-access", "danger", f"accesses {attr} (object-graph walk)", node)
        elif attr in _FRAME_ATTRS:
            self.add("frame-access", "danger", f"accesses frame or code internals ({attr})", node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ("__builtins__", "__loader__", "__spec__"):
            self.add("dunder-access", "danger", f"uses {node.id}", node)

    def visit_Constant(self, node: ast.Constant) -> None:
        # getattr(x, "__globals__"), vars()["__builtins__"], ...
        if isinstance(node.value, str) and node.value in _DUNDERS - _BENIGN_ALONE:
            self.add("dunder-access", "danger", f"names {node.value} in a string", node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if _is_decoding(node.value, self):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.decoded.add(target.id)
        self.generic_visit(node)

    # --- calls ------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        name = self.qualname(node.func)
        if name is not None:
            self.call_target(name, node)
            self.call_arguments(name, node)
        self.generic_visit(node)

    def call_target(self, name: str, node: ast.AST) -> None:
        if name in _SHELL_CALLS or name.startswith(_SHELL_PREFIXES):
            self.add("shell-exec", "danger", f"starts a process or shell ({name})", node)
        elif name in _FRAME_CALLS:
            self.add("frame-access", "danger", f"reaches interpreter frames ({name})", node)
        elif name in _CODE_CALLS:
            self.add("code-object", "danger", f"builds code or functions by hand ({name})", node)

    def call_arguments(self, name: str, node: ast.Call) -> None:
        first = node.args[0] if node.args else None
        bare = name.removeprefix("builtins.")
        if bare in _EXEC_BUILTINS:
            if first is None or _is_literal_str(first):
                return
            if _is_decoding(first, self):
                self.add(
                    "decoded-exec",
                    "danger",
                    f"{bare}() of a decoded payload (base64/codecs/zlib...)",
                    node,
                )
            else:
                self.add("dynamic-exec", "danger", f"{bare}() of a computed string", node)
        elif name in _IMPORTERS:
            if first is not None and _is_literal_str(first):
                assert isinstance(first, ast.Constant)
                self.module(str(first.value), node)
            else:
                self.add("obfuscated-import", "danger", f"{name}() of a computed module name", node)
        elif bare in _ATTR_BUILTINS and len(node.args) >= 2 and not _is_literal_str(node.args[1]):
            self.add(
                "dynamic-getattr",
                "warning",
                f"{bare}() with a computed attribute name (it may be a dunder)",
                node,
            )


def _is_literal_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)


def _chain_has_dunder(node: ast.AST) -> bool:
    """True when ``node`` (the object an attribute is taken of) already walks a dunder."""
    while True:
        if isinstance(node, ast.Attribute):
            if node.attr in _DUNDERS:
                return True
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return False


def _is_decoding(node: ast.AST, checker: _Checker) -> bool:
    """Does the expression decode or decompress something (or use a name that did)?"""
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and child.id in checker.decoded:
            return True
        if isinstance(child, ast.Call):
            name = checker.qualname(child.func)
            if name in _DECODERS:
                return True
            if isinstance(child.func, ast.Attribute) and child.func.attr in _DECODER_METHODS:
                # payload.decode("rot13"), bytes.fromhex(...), mod.b64decode(...)
                target = child.func.value
                if not (isinstance(target, ast.Constant) and child.func.attr == "decode"):
                    return True
    return False
