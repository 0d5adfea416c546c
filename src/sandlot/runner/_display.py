"""Turning Python objects into MIME bundles (Jupyter's display model), stdlib-only.

Order of preference for an object:
1. ``_repr_mimebundle_()`` if it has one;
2. every ``_repr_*_`` method it has (html, markdown, svg, png, jpeg, pdf, latex, json,
   javascript), binary formats base64-encoded;
3. special cases: a pandas DataFrame/Series also gets structured ``data``; a
   matplotlib Figure is rendered to PNG plus its chart data;
4. ``text/plain`` is always present (``repr``, capped).

Nothing here imports pandas or matplotlib: they are recognised by module name, so
a cell that never uses them never pays for their import.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any, Dict, Optional

from sandlot.runner import _charts

DATA_MIME = "application/vnd.sandlot.data+json"
CHART_MIME = "application/vnd.sandlot.chart+json"

_REPR_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_pdf_", "application/pdf"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
    ("_repr_javascript_", "application/javascript"),
)
_BINARY = frozenset({"image/png", "image/jpeg", "application/pdf"})

TEXT_LIMIT = 20_000
"""Longest text/plain repr kept; longer ones are cut with a marker."""
DATA_ROWS = 1_000
"""Rows of a DataFrame kept in the structured ``data`` format."""


def _module_of(obj: Any) -> str:
    return type(obj).__module__ or ""


def _from(module: str, package: str) -> bool:
    # pandas >= 3 reports public classes as defined in "pandas" itself.
    return module == package or module.startswith(package + ".")


def _safe_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception as exc:  # a broken __repr__ must not break the cell
        try:
            detail = str(exc)
        except Exception:  # nor may an exception whose __str__ is broken too
            detail = "?"
        text = "<repr failed: %s: %s>" % (type(exc).__name__, detail)
    if len(text) > TEXT_LIMIT:
        text = text[:TEXT_LIMIT] + "\n[sandlot: repr truncated, %d characters in all]" % len(text)
    return text


def _encode(mime: str, value: Any) -> Any:
    if mime in _BINARY and isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if mime == "application/json":
        return value  # must already be JSON-able; checked by the caller's json.dumps
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return value


_PLAIN = frozenset({int, float, bool, complex, str, bytes, list, tuple, dict, set, frozenset})
"""Built-in types (exactly these, not subclasses) that have no rich representation: their
bundle is their repr, made without looking for a dozen ``_repr_*_`` methods first (the
common ``1 + 1`` result; attributes cannot be added to built-in types)."""


def mimebundle(obj: Any) -> Dict[str, Any]:
    """Return the MIME bundle for ``obj`` (always has ``text/plain``)."""
    if type(obj) in _PLAIN:
        return {"text/plain": _safe_repr(obj)}
    bundle: Dict[str, Any] = {}
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method) and not isinstance(obj, type):
        try:
            produced = method()
            if isinstance(produced, tuple):
                produced = produced[0]
            if isinstance(produced, dict):
                for mime, value in produced.items():
                    if value is not None:
                        bundle[str(mime)] = _encode(str(mime), value)
        except Exception:
            pass
    if not isinstance(obj, type):
        for name, mime in _REPR_METHODS:
            if mime in bundle:
                continue
            method = getattr(obj, name, None)
            if not callable(method):
                continue
            try:
                value = method()
            except Exception:
                continue
            if isinstance(value, tuple):  # (data, metadata) form
                value = value[0]
            if value is not None:
                bundle[mime] = _encode(mime, value)
    module = _module_of(obj)
    if _from(module, "pandas"):
        data = _pandas_data(obj)
        if data is not None:
            bundle[DATA_MIME] = data
    elif _from(module, "matplotlib") and type(obj).__name__ == "Figure":
        bundle.update(figure_bundle(obj))
    bundle.setdefault("text/plain", _safe_repr(obj))
    return json_safe_bundle(bundle)


def json_safe_bundle(bundle: Dict[str, Any]) -> Dict[str, Any]:
    """Drop formats that cannot travel as JSON rather than failing the whole display."""
    safe: Dict[str, Any] = {}
    for mime, value in bundle.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            if mime == "text/plain":
                safe[mime] = str(value)
            continue
        safe[mime] = value
    return safe


# --- pandas ---------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Convert one cell value to something JSON can carry (NaN -> None, numpy -> python)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _jsonable(item())
        except Exception:
            pass
    iso = getattr(value, "isoformat", None)  # datetime, Timestamp
    if callable(iso):
        try:
            return iso()
        except Exception:
            pass
    return str(value)


def _pandas_data(obj: Any) -> Optional[Dict[str, Any]]:
    """A DataFrame/Series as ``{columns, index, data, dtypes, shape, truncated}``."""
    kind = type(obj).__name__
    if kind == "Series":
        try:
            obj = obj.to_frame()
        except Exception:
            return None
    elif kind != "DataFrame":
        return None
    try:
        shape = list(obj.shape)
        head = obj.head(DATA_ROWS)
        return {
            "type": "dataframe",
            "columns": [
                _jsonable(c) if not isinstance(c, tuple) else [_jsonable(x) for x in c]
                for c in head.columns.tolist()
            ],
            "index": [
                _jsonable(i) if not isinstance(i, tuple) else [_jsonable(x) for x in i]
                for i in head.index.tolist()
            ],
            "data": [
                [_jsonable(v) for v in row] for row in head.itertuples(index=False, name=None)
            ],
            "dtypes": [str(t) for t in head.dtypes.tolist()],
            "shape": shape,
            "truncated": shape[0] > DATA_ROWS,
        }
    except Exception:
        return None


# --- matplotlib -----------------------------------------------------------------------


def figure_bundle(figure: Any) -> Dict[str, Any]:
    """Render a matplotlib Figure to PNG, plus its chart data and a text description.

    The chart is read after rendering: tick labels exist only once the figure is drawn.
    """
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    bundle: Dict[str, Any] = {
        "image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
        "text/plain": _safe_repr(figure),
    }
    try:
        chart = chart_data(figure)
    except Exception:
        chart = None
    if chart is not None:
        bundle[CHART_MIME] = chart
    return bundle


def chart_data(figure: Any) -> Optional[Dict[str, Any]]:
    """Chart data for a figure, as E2B's code interpreter extracts it (see ``_charts``)."""
    return _charts.chart_data(figure)
