"""MIME bundles from Python objects (``sandlot.runner._display``), on the host interpreter.

pandas and matplotlib are optional here (``pytest.importorskip``); the integration
suite runs the same code inside a real sandbox with the python-data template.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
from typing import Any

import pytest

from sandlot.runner._display import (
    CHART_MIME,
    DATA_MIME,
    DATA_ROWS,
    TEXT_LIMIT,
    _jsonable,
    mimebundle,
)

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


class Rich:
    """Every ``_repr_*_`` method IPython knows."""

    def _repr_html_(self) -> str:
        return "<b>rich</b>"

    def _repr_markdown_(self) -> str:
        return "**rich**"

    def _repr_svg_(self) -> bytes:
        return b"<svg/>"  # text formats given as bytes are decoded

    def _repr_png_(self) -> bytes:
        return PNG

    def _repr_jpeg_(self) -> bytearray:
        return bytearray(b"\xff\xd8\xff")

    def _repr_pdf_(self) -> bytes:
        return b"%PDF-1.4"

    def _repr_latex_(self) -> tuple[str, dict[str, Any]]:
        return ("$x^2$", {"metadata": True})  # the (data, metadata) form

    def _repr_json_(self) -> dict[str, Any]:
        return {"a": [1, 2.5, None]}

    def _repr_javascript_(self) -> str:
        return "console.log(1)"

    def __repr__(self) -> str:
        return "Rich()"


def test_every_repr_method() -> None:
    bundle = mimebundle(Rich())
    assert bundle == {
        "text/html": "<b>rich</b>",
        "text/markdown": "**rich**",
        "image/svg+xml": "<svg/>",
        "image/png": base64.b64encode(PNG).decode(),
        "image/jpeg": base64.b64encode(b"\xff\xd8\xff").decode(),
        "application/pdf": base64.b64encode(b"%PDF-1.4").decode(),
        "text/latex": "$x^2$",
        "application/json": {"a": [1, 2.5, None]},
        "application/javascript": "console.log(1)",
        "text/plain": "Rich()",
    }
    json.dumps(bundle, allow_nan=False)  # travels as JSON


def test_png_given_as_base64_text_is_kept() -> None:
    class AlreadyEncoded:
        def _repr_png_(self) -> str:
            return "iVBORw0KGgo="

    assert mimebundle(AlreadyEncoded())["image/png"] == "iVBORw0KGgo="


def test_plain_objects_get_text_plain_only() -> None:
    assert mimebundle(42) == {"text/plain": "42"}
    assert mimebundle("s") == {"text/plain": "'s'"}
    assert mimebundle(None) == {"text/plain": "None"}
    assert mimebundle({1, 2}) == {"text/plain": "{1, 2}"}


def test_classes_are_not_asked_for_reprs() -> None:
    # Rich._repr_html_ is an unbound function on the class: calling it would fail.
    assert mimebundle(Rich) == {"text/plain": repr(Rich)}


def test_repr_mimebundle_comes_first() -> None:
    class Bundled:
        def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
            return (
                {
                    "text/html": "<i>from bundle</i>",
                    "image/png": PNG,
                    "text/plain": "B",
                    "x/skip": None,
                },
                {"metadata": 1},
            )

        def _repr_html_(self) -> str:
            return "<b>not used</b>"

        def _repr_markdown_(self) -> str:
            return "*still used*"

    bundle = mimebundle(Bundled())
    assert bundle == {
        "text/html": "<i>from bundle</i>",
        "image/png": base64.b64encode(PNG).decode(),
        "text/plain": "B",
        "text/markdown": "*still used*",
    }


def test_failing_repr_methods_are_skipped() -> None:
    class Flaky:
        def _repr_mimebundle_(self, **kwargs: Any) -> Any:
            raise RuntimeError("no bundle")

        def _repr_html_(self) -> str:
            raise ValueError("no html")

        def _repr_markdown_(self) -> None:
            return None

        def _repr_svg_(self) -> str:
            return "<svg/>"

        def __repr__(self) -> str:
            return "Flaky()"

    assert mimebundle(Flaky()) == {"image/svg+xml": "<svg/>", "text/plain": "Flaky()"}


def test_non_callable_repr_attributes_are_ignored() -> None:
    class Odd:
        _repr_html_ = "<b>not a method</b>"
        _repr_mimebundle_ = None

    assert set(mimebundle(Odd())) == {"text/plain"}


def test_broken_repr() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise ValueError("nope")

    assert mimebundle(Broken()) == {"text/plain": "<repr failed: ValueError: nope>"}


def test_repr_returning_non_string() -> None:
    class NotStr:
        def __repr__(self) -> Any:
            return 42

    assert mimebundle(NotStr())["text/plain"].startswith("<repr failed: TypeError")


def test_broken_repr_raising_an_exception_with_a_broken_str() -> None:
    class Nasty(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str of the exception is broken too")

    class Broken:
        def __repr__(self) -> str:
            raise Nasty()

    assert mimebundle(Broken())["text/plain"].startswith("<repr failed: Nasty")


def test_huge_repr_is_truncated() -> None:
    class Huge:
        def __repr__(self) -> str:
            return "x" * (TEXT_LIMIT * 3)

    text = mimebundle(Huge())["text/plain"]
    assert text.startswith("x" * TEXT_LIMIT)
    assert text[TEXT_LIMIT:] == f"\n[sandlot: repr truncated, {TEXT_LIMIT * 3} characters in all]"


def test_repr_at_the_limit_is_kept() -> None:
    class Exact:
        def __repr__(self) -> str:
            return "y" * TEXT_LIMIT

    assert mimebundle(Exact())["text/plain"] == "y" * TEXT_LIMIT


def test_formats_that_are_not_json_are_dropped() -> None:
    class Unsendable:
        def _repr_json_(self) -> Any:
            return {"nan": float("nan")}  # JSON has no NaN

        def _repr_html_(self) -> Any:
            return {1, 2}  # not a string at all

        def _repr_markdown_(self) -> str:
            return "fine"

        def __repr__(self) -> str:
            return "U"

    assert mimebundle(Unsendable()) == {"text/markdown": "fine", "text/plain": "U"}


# --- _jsonable ----------------------------------------------------------------------


class FakeScalar:
    """Looks like a numpy scalar: ``.item()`` returns the Python value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def item(self) -> Any:
        return self.value

    def __repr__(self) -> str:  # test ids: the same in every process (pytest-xdist)
        return f"FakeScalar({self.value!r})"


class BrokenItem:
    def item(self) -> Any:
        raise ValueError("can only convert an array of size 1")

    def __str__(self) -> str:
        return "BrokenItem"

    def __repr__(self) -> str:
        return "BrokenItem()"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (True, True),
        (3, 3),
        (2**70, 2**70),
        ("s", "s"),
        (1.5, 1.5),
        (float("nan"), None),
        (float("inf"), None),
        (float("-inf"), None),
        (FakeScalar(7), 7),
        (FakeScalar(float("nan")), None),
        (FakeScalar(FakeScalar(2.5)), 2.5),
        (BrokenItem(), "BrokenItem"),
        (datetime.date(2024, 1, 2), "2024-01-02"),
        (datetime.datetime(2024, 1, 2, 3, 4, 5), "2024-01-02T03:04:05"),
        (complex(1, 2), "(1+2j)"),
        (b"ab", "b'ab'"),
    ],
    ids=repr,
)
def test_jsonable(value: Any, expected: Any) -> None:
    assert _jsonable(value) == expected
    json.dumps(_jsonable(value), allow_nan=False)


def test_jsonable_item_returning_a_date() -> None:
    assert _jsonable(FakeScalar(datetime.date(2024, 5, 6))) == "2024-05-06"


def test_jsonable_numpy() -> None:
    np = pytest.importorskip("numpy")
    assert _jsonable(np.int64(3)) == 3 and type(_jsonable(np.int64(3))) is int
    assert _jsonable(np.float32(1.5)) == 1.5
    assert _jsonable(np.float64("nan")) is None
    assert _jsonable(np.bool_(True)) is True
    assert _jsonable(np.datetime64("2024-01-02")) == "2024-01-02"
    assert _jsonable(np.array([1, 2])) == "[1 2]"  # .item() fails: falls back to str


# --- pandas -------------------------------------------------------------------------


def test_dataframe_bundle() -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"x": [1, 2], "y": [0.5, math.nan], "s": ["a", None]})
    bundle = mimebundle(frame)
    assert "text/html" in bundle and "text/plain" in bundle
    assert bundle[DATA_MIME] == {
        "type": "dataframe",
        "columns": ["x", "y", "s"],
        "index": [0, 1],
        "data": [[1, 0.5, "a"], [2, None, None]],
        "dtypes": [str(t) for t in frame.dtypes.tolist()],
        "shape": [2, 3],
        "truncated": False,
    }
    json.dumps(bundle, allow_nan=False)


def test_series_and_timestamps() -> None:
    pd = pytest.importorskip("pandas")
    series = pd.Series([1.0, 2.0], index=pd.to_datetime(["2024-01-01", "2024-01-02"]), name="v")
    data = mimebundle(series)[DATA_MIME]
    assert data["columns"] == ["v"]
    assert data["index"] == ["2024-01-01T00:00:00", "2024-01-02T00:00:00"]
    assert data["data"] == [[1.0], [2.0]]


def test_big_dataframe_is_truncated() -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"x": range(DATA_ROWS + 5)})
    data = mimebundle(frame)[DATA_MIME]
    assert len(data["data"]) == DATA_ROWS
    assert data["shape"] == [DATA_ROWS + 5, 1]
    assert data["truncated"] is True


def test_multiindex_columns_become_lists() -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame([[1, 2]], columns=pd.MultiIndex.from_tuples([("a", 1), ("a", 2)]))
    assert mimebundle(frame)[DATA_MIME]["columns"] == [["a", 1], ["a", 2]]


def test_other_pandas_objects_get_no_data() -> None:
    pd = pytest.importorskip("pandas")
    assert DATA_MIME not in mimebundle(pd.Index([1, 2]))


# --- matplotlib ---------------------------------------------------------------------


def test_figure_bundle() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots()
    ax.plot([1, 2, 3], [4, 5, 6], label="up")
    ax.set_title("T")
    try:
        bundle = mimebundle(figure)
    finally:
        plt.close(figure)
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    chart = bundle[CHART_MIME]
    assert chart["type"] == "line" and chart["title"] == "T"
    assert chart["elements"][0]["points"] == [[1, 4], [2, 5], [3, 6]]


PLAIN_VALUES = [2, 2.5, True, 1j, "x\udcff", b"\x00", [1, "a"], (1,), {"a": {1}}, {1}, frozenset()]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=range(len(PLAIN_VALUES)))
def test_plain_builtin_values_are_their_repr(value: Any) -> None:
    assert mimebundle(value) == {"text/plain": repr(value)}


def test_plain_values_keep_the_repr_limit() -> None:
    text = mimebundle("a" * (TEXT_LIMIT + 10))["text/plain"]
    assert text.startswith("'aaa") and "repr truncated" in text


def test_subclasses_of_builtins_still_get_their_rich_forms() -> None:
    """The shortcut is for the built-in types themselves, never for a subclass."""

    class Html(int):
        def _repr_html_(self) -> str:
            return "<i>3</i>"

    class Bundle(list):  # type: ignore[type-arg]
        def _repr_mimebundle_(self) -> dict[str, Any]:
            return {"text/markdown": "*x*"}

    assert mimebundle(Html(3)) == {"text/html": "<i>3</i>", "text/plain": "3"}
    assert mimebundle(Bundle())["text/markdown"] == "*x*"
