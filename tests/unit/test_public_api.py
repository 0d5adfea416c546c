"""The public surface: ``sandlot.__all__`` and the exception tree."""

from __future__ import annotations

import inspect
import re

import sandlot
import sandlot._exceptions as exceptions_module
import sandlot._models as models_module
import sandlot.testing
from sandlot import SandlotError


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in sandlot._exceptions, plus ExecutionFailed.

    ExecutionFailed carries an Execution, so it is defined in sandlot._models (the tree
    imports nothing of sandlot's); the tree in _exceptions' docstring still draws it."""
    classes: dict[str, type[BaseException]] = {
        name: obj
        for name, obj in vars(exceptions_module).items()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ != "builtins"
    }
    classes["ExecutionFailed"] = models_module.ExecutionFailed
    return classes


def _docstring_tree() -> dict[str, str | None]:
    """``{class name: parent name}`` from the tree drawn in _exceptions' docstring."""
    doc = exceptions_module.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []  # (column of the name, name)
    for line in doc.splitlines():
        match = re.match(r"^(\s*(?:[│ ]*[├└]── )?)([A-Z]\w+)\s", line + " ")
        if not match or (not match.group(1).strip() and match.group(2) != "SandlotError"):
            continue
        column = len(match.group(1))
        name = match.group(2)
        while stack and stack[-1][0] >= column:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((column, name))
    return parents


def test_all_is_sorted_and_unique() -> None:
    names = [n for n in sandlot.__all__ if n != "__version__"]
    assert names == sorted(names)
    assert len(set(sandlot.__all__)) == len(sandlot.__all__)


def test_every_name_in_all_exists() -> None:
    for name in sandlot.__all__:
        assert hasattr(sandlot, name), name


def test_public_classes_claim_the_sandlot_module() -> None:
    for name in sandlot.__all__:
        obj = getattr(sandlot, name)
        if isinstance(obj, type):
            assert obj.__module__ == "sandlot", name
            assert obj.__name__ == name


def test_star_import() -> None:
    namespace: dict[str, object] = {}
    exec("from sandlot import *", namespace)
    assert set(sandlot.__all__) <= set(namespace)


def test_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", sandlot.__version__)


def test_every_exception_is_a_sandlot_error_and_exported() -> None:
    classes = _exception_classes()
    assert "SandlotError" in classes and len(classes) > 5
    for name, cls in classes.items():
        assert issubclass(cls, SandlotError), name
        assert name in sandlot.__all__, f"{name} is not exported from sandlot"
        assert getattr(sandlot, name) is cls


def test_every_exported_exception_comes_from_the_tree() -> None:
    classes = _exception_classes()
    for name in sandlot.__all__:
        obj = getattr(sandlot, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert name in classes, name


def test_docstring_tree_names_every_class() -> None:
    tree = _docstring_tree()
    classes = _exception_classes()
    assert set(tree) == set(classes), (
        f"missing from the tree: {sorted(set(classes) - set(tree))}; "
        f"not classes: {sorted(set(tree) - set(classes))}"
    )


def test_docstring_tree_matches_inheritance() -> None:
    classes = _exception_classes()
    for name, parent in _docstring_tree().items():
        cls = classes[name]
        if parent is None:
            assert cls is SandlotError
            continue
        # The drawn parent is the nearest sandlot base (builtins like ValueError are
        # extra bases the tree does not draw).
        sandlot_bases = [b for b in cls.__bases__ if issubclass(b, SandlotError)]
        assert sandlot_bases == [classes[parent]], (name, parent, cls.__bases__)


def test_exit_codes_in_the_tree_match_the_classes() -> None:
    doc = exceptions_module.__doc__ or ""
    for match in re.finditer(r"([A-Z]\w+)\s.*\[exit (\d+)\]", doc):
        name, code = match.group(1), int(match.group(2))
        assert _exception_classes()[name].exit_code == code, name  # type: ignore[attr-defined]


def test_exceptions_that_are_also_builtin_errors() -> None:
    # So that `except ValueError` / `except FileNotFoundError` keep working.
    assert issubclass(sandlot.InvalidArgumentError, ValueError)
    assert issubclass(sandlot.PolicyError, ValueError)
    assert issubclass(sandlot.NotFoundError, FileNotFoundError)
    assert issubclass(sandlot.NotFoundError, sandlot.FileOperationError)
    assert issubclass(sandlot.ContextNotFoundError, KeyError)
    assert str(sandlot.ContextNotFoundError("no context c1")) == "no context c1"


def test_testing_module_surface() -> None:
    for name in sandlot.testing.__all__:
        assert hasattr(sandlot.testing, name), name
    assert sandlot.testing.__doc__ and "FakeBackend(handler)" in sandlot.testing.__doc__
    assert inspect.isclass(sandlot.testing.FakeBackend)
    assert not inspect.isabstract(sandlot.testing.FakeBackend)
    assert not inspect.isabstract(sandlot.testing.FakeHandle)
    assert not inspect.isabstract(sandlot.testing.FakeStream)
