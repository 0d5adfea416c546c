"""Chart data from a matplotlib Figure, in the shape E2B's code interpreter uses.

stdlib-only, like the rest of the runner: matplotlib is never imported here. By the
time a Figure reaches :func:`chart_data` the cell has loaded matplotlib, so artists
are recognised by class name (their MRO, so subclasses count) and the one helper we
need from matplotlib (date conversion) is looked up in ``sys.modules``.

A chart is a dict, JSON-ready, with ``type`` one of ``line``, ``scatter``, ``bar``,
``pie``, ``box_and_whisker``, ``superchart`` or ``unknown``, ``title`` and
``elements``, plus per type:

* every type but pie, superchart and unknown: ``x_label``, ``y_label``, ``x_unit``,
  ``y_unit`` (a unit is the part of a label in ``(...)`` after a space, or in ``[...]``);
* line and scatter: ``x_ticks``/``y_ticks`` (floats, ISO strings on a date axis),
  ``x_tick_labels``/``y_tick_labels`` and ``x_scale``/``y_scale`` (``linear``,
  ``datetime``, ``categorical``, ``log``, ``symlog``, ``logit``, ``function``,
  ``functionlog``, ``asinh``); elements ``{label, points: [[x, y], ...]}``;
* bar: elements ``{label, group, value}`` (one per bar, group = the series; a stacked
  segment's own value, not its top);
* pie: elements ``{label, angle, radius}`` (angle in degrees);
* box_and_whisker: elements ``{label, min, first_quartile, median, third_quartile,
  max, outliers}``;
* superchart: a figure with several axes; its elements are the axes' charts.

For horizontal bars and boxes the labels are swapped so that ``x_label`` always names
the category axis and ``y_label`` the value axis.

An axes is given a type only when every artist on it fits that type (texts,
reference lines such as ``axhline``, error bars, a line's bands and artists that draw
nothing aside); anything else is ``unknown``, never a wrong type. A figure with no
data gives no chart at all.

Budget: a figure can hold millions of points, and the chart travels inside the cell's
result (``Resources.result_bytes``). So a series keeps at most :data:`MAX_POINTS`
points, evenly sampled over the whole series (first and last included); a figure at
most :data:`MAX_TOTAL_POINTS`; a chart at most :data:`MAX_ELEMENTS` elements; a
superchart at most :data:`MAX_CHARTS` charts; an axes with more than
:data:`MAX_ARTISTS` artists is not inspected (``unknown``). Whenever something was
left out the chart says ``"truncated": true``. The work is linear in the number of
artists, which the figure's own rendering (done before) already paid for.
"""

from __future__ import annotations

import datetime
import itertools
import math
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

MAX_POINTS = 2_000
"""Points kept per line or scatter series (evenly sampled beyond this)."""
MAX_TOTAL_POINTS = 50_000
"""Points (and box outliers) kept per figure."""
MAX_ELEMENTS = 200
"""Elements (series, bars, wedges, boxes) kept per chart, and ticks per axis."""
MAX_CHARTS = 32
"""Charts kept in a superchart."""
MAX_ARTISTS = 20_000
"""An axes with more artists than this is reported as ``unknown`` without a look."""

_UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")
_AUTO_LINE = re.compile(r"_child(\d+)$")
_AUTO_GROUP = re.compile(r"_container(\d+)$")
_SIGNIFICANT = 12
"""Digits kept of geometric values (box quartiles, pie angles): matplotlib's
float arithmetic leaves noise such as 324.00000000000006 behind."""


class _Budget:
    """Points left for the figure, and whether anything was left out."""

    def __init__(self) -> None:
        self.points = MAX_TOTAL_POINTS
        self.truncated = False

    def take(self, wanted: int, cap: int = MAX_POINTS) -> int:
        allowed = max(0, min(wanted, cap, self.points))
        if allowed < wanted:
            self.truncated = True
        self.points -= allowed
        return allowed

    def elements(self, items: List[Any], cap: int = MAX_ELEMENTS) -> List[Any]:
        if len(items) > cap:
            self.truncated = True
            return items[:cap]
        return items


# --- matplotlib objects, by class name -----------------------------------------------


def _is(obj: Any, *names: str) -> bool:
    """Whether ``obj`` is an instance of a matplotlib class called one of ``names``."""
    for cls in type(obj).__mro__:
        if cls.__name__ in names and (cls.__module__ or "").startswith("matplotlib"):
            return True
    return False


def _children(ax: Any) -> List[Any]:
    children = getattr(ax, "_children", None)
    if isinstance(children, list):
        return list(children)
    found: List[Any] = []  # matplotlib < 3.5 kept the artists in separate lists
    for name in ("lines", "patches", "collections", "images", "artists", "tables", "texts"):
        found.extend(getattr(ax, name, None) or [])
    return found


def _converter(axis: Any) -> Any:
    getter = getattr(axis, "get_converter", None)  # matplotlib >= 3.10
    if callable(getter):
        return getter()
    return getattr(axis, "converter", None)


def _class_names(obj: Any) -> List[str]:
    return [cls.__name__ for cls in type(obj).__mro__]


def _date_kind(ax: Any, axis: Any) -> Optional[str]:
    """``"date"`` for matplotlib's date axis, ``"period"`` for pandas' period axis."""
    names = _class_names(_converter(axis))
    if "PeriodConverter" in names:  # a DateConverter subclass, but counts in periods
        return "period" if getattr(ax, "freq", None) is not None else None
    if any("DateConverter" in name for name in names):
        return "date"
    return None


def _to_date(ax: Any, kind: Optional[str], value: Any) -> Any:
    """A position on a date axis as ISO text; ``value`` unchanged if that fails."""
    try:
        number = float(value)
        if not math.isfinite(number):
            return None
        if kind == "period":
            pandas = sys.modules["pandas"]
            return pandas.Period(ordinal=round(number), freq=ax.freq).to_timestamp().isoformat()
        dates = sys.modules.get("matplotlib.dates")
        if dates is not None:
            return dates.num2date(number).isoformat()
        epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
        return (epoch + datetime.timedelta(days=number)).isoformat()
    except Exception:
        return _number(value)


def _text(artist: Any) -> str:
    try:
        return str(artist.get_text())
    except Exception:
        return ""


def _label_or_none(text: Any) -> Optional[str]:
    text = str(text) if text is not None else ""
    return text or None


def _unit(label: Optional[str]) -> Optional[str]:
    if not label:
        return None
    match = _UNIT.search(label)
    if match is None:
        return None
    return match.group(1) or match.group(2) or None


# --- values ---------------------------------------------------------------------------


def _number(value: Any) -> Optional[float]:
    """A finite float, or None."""
    try:
        number = float(value)
    except Exception:
        return None
    return number if math.isfinite(number) else None


def _rounded(value: Any) -> Optional[float]:
    number = _number(value)
    if number is None:
        return None
    return float("%.*g" % (_SIGNIFICANT, number))


def _point(value: Any) -> Any:
    """One coordinate as the user gave it: number -> float, date -> ISO text, text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return _number(value)
    iso = getattr(value, "isoformat", None)  # date, datetime, pandas Timestamp
    if callable(iso):
        try:
            return str(iso())
        except Exception:  # NaT
            return None
    kind = type(value).__name__
    if kind == "datetime64":
        try:
            text = str(value.astype("datetime64[s]"))
        except Exception:
            return None
        return None if text == "NaT" else text
    item = getattr(value, "item", None)  # other numpy scalars
    if callable(item):
        try:
            return _point(item())
        except Exception:
            pass
    return str(value)


def _sample(count: int, keep: int) -> Sequence[int]:
    """``keep`` indices spread evenly over ``range(count)``, first and last included."""
    if keep >= count:
        return range(count)
    if keep <= 0:
        return []
    if keep == 1:
        return [0]
    return [round(i * (count - 1) / (keep - 1)) for i in range(keep)]


def _array(values: Any) -> Any:
    """Positional indexing for whatever matplotlib kept (pandas objects included)."""
    to_numpy = getattr(values, "to_numpy", None)
    if callable(to_numpy):
        try:
            return to_numpy()
        except Exception:
            pass
    return values


def _coordinate(ax: Any, kind: Optional[str], value: Any) -> Any:
    """A coordinate; a number on a date axis (pandas' periods, date2num) as a date."""
    point = _point(value)
    if kind and isinstance(point, float):
        return _to_date(ax, kind, point)
    return point


def _column(ax: Any, values: Any, picks: Sequence[int], kind: Optional[str]) -> List[Any]:
    """The coordinates at ``picks``; a numeric numpy array in one step (``tolist``)."""
    dtype = getattr(values, "dtype", None)
    if not kind and getattr(dtype, "kind", "") in ("i", "u", "f", "b"):
        try:
            picked = values[list(picks)].tolist()
            return [float(v) if v is not None and math.isfinite(float(v)) else None for v in picked]
        except Exception:
            pass
    return [_coordinate(ax, kind, values[i]) for i in picks]


def _series(
    ax: Any, xs: Any, ys: Any, budget: _Budget, kinds: Tuple[Optional[str], Optional[str]]
) -> List[List[Any]]:
    xs, ys = _array(xs), _array(ys)
    count = min(len(xs), len(ys))
    picks = _sample(count, budget.take(count))
    return [
        [x, y]
        for x, y in zip(
            _column(ax, xs, picks, kinds[0]), _column(ax, ys, picks, kinds[1]), strict=True
        )
    ]


# --- axes -----------------------------------------------------------------------------


def _is_reference_line(ax: Any, artist: Any) -> bool:
    """A line not drawn in data coordinates (``axhline``, ``axvline``): decoration."""
    try:
        return _is(artist, "Line2D") and artist.get_transform() is not ax.transData
    except Exception:
        return False


def _is_empty(artist: Any) -> bool:
    """An artist that draws nothing: seaborn adds such lines and patches as legend
    handles, and an empty confidence band to a line of single values."""
    try:
        if _is(artist, "Line2D"):
            return len(artist.get_xdata()) == 0
        if _is(artist, "Rectangle"):
            return bool(artist.get_width() == 0 and artist.get_height() == 0)
        if _is(artist, "PathCollection"):
            return len(artist.get_offsets()) == 0
        if _is(artist, "PolyCollection"):
            return all(len(path.vertices) == 0 for path in artist.get_paths())
    except Exception:
        pass
    return False


def _has_data(ax: Any) -> bool:
    try:
        return bool(ax.has_data())
    except Exception:
        return bool(_children(ax))


def _base(ax: Any, kind: str) -> Dict[str, Any]:
    return {"type": kind, "title": _label_or_none(ax.get_title()), "elements": []}


def _with_axes_labels(chart: Dict[str, Any], ax: Any, swap: bool = False) -> Dict[str, Any]:
    x_label, y_label = _label_or_none(ax.get_xlabel()), _label_or_none(ax.get_ylabel())
    if swap:
        x_label, y_label = y_label, x_label
    chart.update(
        {"x_label": x_label, "y_label": y_label, "x_unit": _unit(x_label), "y_unit": _unit(y_label)}
    )
    return chart


def _ticks(ax: Any, axis: Any, budget: _Budget) -> Tuple[List[Any], List[str], Optional[str]]:
    kind = _date_kind(ax, axis)
    try:
        raw = list(axis.get_ticklocs())
    except Exception:
        raw = []
    raw = budget.elements(raw, cap=MAX_ELEMENTS)
    ticks = [_to_date(ax, kind, t) if kind else _number(t) for t in raw]
    try:
        labels = [_text(t) for t in axis.get_ticklabels()]
    except Exception:
        labels = []
    return ticks, budget.elements(labels, cap=MAX_ELEMENTS), kind


def _is_number(text: str) -> bool:
    try:
        float(text.replace("\u2212", "-"))
    except ValueError:
        return False
    return True


def _scale(ax: Any, axis: Any, ticks: List[Any], labels: List[str], kind: Optional[str]) -> str:
    if kind:
        return "datetime"
    try:
        scale = str(axis.get_scale())
    except Exception:
        scale = "linear"
    if scale != "linear":
        return scale
    if "StrCategoryConverter" in _class_names(_converter(axis)):
        return "categorical"
    # Positions 0..n-1 labelled with words (set_xticks(range(n), names)): categories.
    if (
        ticks
        and len(ticks) == len(labels)
        and all(t == i for i, t in enumerate(ticks))
        and all(label and not _is_number(label) for label in labels)
    ):
        return "categorical"
    return "linear"


def _point_chart(ax: Any, kind: str, budget: _Budget) -> Dict[str, Any]:
    chart = _with_axes_labels(_base(ax, kind), ax)
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        ticks, labels, date_kind = _ticks(ax, axis, budget)
        chart[name + "_ticks"] = ticks
        chart[name + "_tick_labels"] = labels
        chart[name + "_scale"] = _scale(ax, axis, ticks, labels, date_kind)
    return chart


def _line_label(artist: Any, names: Dict[int, str]) -> str:
    label = names.get(id(artist)) or str(artist.get_label())
    auto = _AUTO_LINE.match(label)
    if auto:
        return "Line %s" % auto.group(1)
    return "" if label.startswith("_") else label


def _line_chart(
    ax: Any, lines: List[Any], budget: _Budget, names: Optional[Dict[int, str]] = None
) -> Dict[str, Any]:
    chart = _point_chart(ax, "line", budget)
    kinds = (_date_kind(ax, ax.xaxis), _date_kind(ax, ax.yaxis))
    chart["elements"] = [
        {
            "label": _line_label(line, names or {}),
            "points": _series(ax, line.get_xdata(), line.get_ydata(), budget, kinds),
        }
        for line in budget.elements(lines)
    ]
    return chart


def _scatter_chart(ax: Any, collections: List[Any], budget: _Budget) -> Dict[str, Any]:
    chart = _point_chart(ax, "scatter", budget)
    kinds = (_date_kind(ax, ax.xaxis), _date_kind(ax, ax.yaxis))
    for collection in budget.elements(collections):
        offsets = collection.get_offsets()
        chart["elements"].append(
            {
                "label": str(collection.get_label()),
                "points": _series(ax, offsets[:, 0], offsets[:, 1], budget, kinds),
            }
        )
    return chart


def _pie_chart(ax: Any, wedges: List[Any], budget: _Budget) -> Dict[str, Any]:
    chart = _base(ax, "pie")
    chart["elements"] = [
        {
            "label": str(wedge.get_label()),
            "angle": _rounded(abs(float(wedge.theta2) - float(wedge.theta1))),
            "radius": _number(wedge.r),
        }
        for wedge in budget.elements(wedges)
    ]
    return chart


def _category(ax: Any, axis: Any, position: float) -> str:
    """What to call the category at ``position`` on ``axis`` (a bar's or box's centre):
    the name of the nearest tick on a categorical or hand-labelled axis, the date on a
    date axis, else the position itself."""
    kind = _date_kind(ax, axis)
    if kind:
        return str(_to_date(ax, kind, position))
    if _named_ticks(axis):
        try:
            ticks = [float(t) for t in axis.get_ticklocs()]
            labels = [_text(t) for t in axis.get_ticklabels()]
        except Exception:
            ticks, labels = [], []
        if ticks and len(ticks) == len(labels):
            best = min(range(len(ticks)), key=lambda i: abs(ticks[i] - position))
            # Grouped bars sit beside their tick, at most half way to the next one.
            ordered = sorted(ticks)
            gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
            reach = min(gaps) / 2.0 if gaps else math.inf
            if labels[best] and abs(ticks[best] - position) <= reach:
                return labels[best]
    number = _rounded(position)
    return "%g" % number if number is not None else ""


def _named_ticks(axis: Any) -> bool:
    """Whether the ticks of ``axis`` name categories rather than show positions."""
    if "StrCategoryConverter" in _class_names(_converter(axis)):
        return True
    formatter = _class_names(axis.get_major_formatter())
    if "StrCategoryFormatter" in formatter or "FixedFormatter" in formatter:
        return True
    # set_xticks(positions, labels) in matplotlib >= 3.10: a function of the position.
    return "FuncFormatter" in formatter and "FixedLocator" in _class_names(axis.get_major_locator())


def _bar_chart(ax: Any, containers: List[Any], budget: _Budget) -> Dict[str, Any]:
    horizontal = all(getattr(c, "orientation", None) == "horizontal" for c in containers)
    chart = _with_axes_labels(_base(ax, "bar"), ax, swap=horizontal)
    elements: List[Dict[str, Any]] = []
    for container in containers:
        patches = list(container.patches)
        group = str(container.get_label())
        if group.startswith("_") and patches:  # hist() labels the first bar instead
            first = str(patches[0].get_label())
            group = group if first.startswith("_") else first
        auto = _AUTO_GROUP.match(group)
        group = "Group %s" % auto.group(1) if auto else ("" if group.startswith("_") else group)
        across = getattr(container, "orientation", None) == "horizontal"
        axis = ax.yaxis if across else ax.xaxis
        values = getattr(container, "datavalues", None)
        if values is None or len(values) != len(patches):
            values = [p.get_width() if across else p.get_height() for p in patches]
        for patch, value in zip(patches, values, strict=False):
            if len(elements) >= MAX_ELEMENTS:
                budget.truncated = True
                break
            if across:
                centre = patch.get_y() + patch.get_height() / 2.0
            else:
                centre = patch.get_x() + patch.get_width() / 2.0
            elements.append(
                {"label": _category(ax, axis, centre), "group": group, "value": _number(value)}
            )
    chart["elements"] = elements
    return chart


# --- box and whisker --------------------------------------------------------------------


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


Outline = Tuple[List[float], List[float]]


def _box_outline(artist: Any) -> Optional[Outline]:
    """The vertices of a boxplot box: a PathPatch, or a closed line (no patch_artist)."""
    try:
        if _is(artist, "PathPatch"):
            vertices = artist.get_path().vertices
            if len(vertices) > 12:  # a box has 6 vertices, a notched one 12
                return None
            xs = [float(v[0]) for v in vertices]
            ys = [float(v[1]) for v in vertices]
        else:
            # A rectangle (5 points) or a notched box (11), drawn closed. The length
            # first: a line chart's long series must not be converted here.
            if len(artist.get_xdata()) not in (5, 11):
                return None
            xs = [float(v) for v in artist.get_xdata()]
            ys = [float(v) for v in artist.get_ydata()]
            if not (xs[0] == xs[-1] and ys[0] == ys[-1]):
                return None
    except Exception:
        return None
    if len(xs) < 5 or not all(math.isfinite(v) for v in xs + ys):
        return None
    return xs, ys


class _Box:
    def __init__(self, outline: Outline, vertical: bool) -> None:
        # "pos" runs along the category axis, "val" along the value axis.
        pos, val = outline if vertical else (outline[1], outline[0])
        self.p0, self.p1 = min(pos), max(pos)
        if len(val) >= 11:
            # Notched: q1, q1, notch, median, notch, q3, q3, ... and the notch may
            # reach past the quartiles ("notch goes outside hinges").
            self.q1, self.q3 = min(val[0], val[5]), max(val[0], val[5])
        else:
            self.q1, self.q3 = min(val), max(val)
        self.low: Optional[float] = None
        self.high: Optional[float] = None
        self.median: Optional[Tuple[float, bool, float]] = None  # (width, solid, value)
        self.markers: List[float] = []

    def holds(self, positions: List[float]) -> bool:
        slack = 1e-9 * max(1.0, abs(self.p0), abs(self.p1))
        return all(self.p0 - slack <= p <= self.p1 + slack for p in positions)


def _box_chart(ax: Any, artists: List[Any], budget: _Budget) -> Optional[Dict[str, Any]]:
    """The boxplot on an axes of PathPatches and Line2Ds, or None if it is not one."""
    outlines: List[Outline] = []
    lines: List[Any] = []
    for artist in artists:
        outline = _box_outline(artist)
        if outline is not None:
            outlines.append(outline)
        elif _is(artist, "Line2D"):
            lines.append(artist)
        else:
            return None
    # About six lines a box (two whiskers, two caps, a median, fliers; a mean):
    # anything much busier is no boxplot, and is not worth matching line by line.
    if not outlines or len(outlines) > MAX_ELEMENTS or len(lines) > 8 * len(outlines):
        return None
    for vertical in (True, False):
        boxes = [_Box(outline, vertical) for outline in outlines]
        if _fit_lines(boxes, lines, vertical):
            break
    else:
        return None
    chart = _with_axes_labels(_base(ax, "box_and_whisker"), ax, swap=not vertical)
    axis = ax.xaxis if vertical else ax.yaxis
    for box in boxes:
        low = box.low if box.low is not None else box.q1
        high = box.high if box.high is not None else box.q3
        outliers = [v for v in box.markers if v < low or v > high]
        outliers = outliers[: budget.take(len(outliers), cap=MAX_ELEMENTS)]
        chart["elements"].append(
            {
                "label": _category(ax, axis, (box.p0 + box.p1) / 2.0),
                "min": _rounded(low),
                "first_quartile": _rounded(box.q1),
                "median": _rounded(box.median[2] if box.median else None),
                "third_quartile": _rounded(box.q3),
                "max": _rounded(high),
                "outliers": [_rounded(v) for v in outliers],
            }
        )
    return chart


def _fit_lines(boxes: List[_Box], lines: List[Any], vertical: bool) -> bool:
    """Give each line its part of a box (whisker, cap, median, fliers, mean); False if
    a line fits no box, or a box has no median: then this is no boxplot (this way up)."""
    for line in lines:
        try:
            if len(line.get_xdata()) > MAX_POINTS:  # no part of a boxplot is this long
                return False
            xs = [float(v) for v in line.get_xdata()]
            ys = [float(v) for v in line.get_ydata()]
        except Exception:
            return False
        pos, val = (xs, ys) if vertical else (ys, xs)
        if not pos:
            continue  # an empty flier line: a box without outliers
        owners = [box for box in boxes if box.holds(pos)]
        if not owners:
            return False
        box = min(owners, key=lambda b: abs((b.p0 + b.p1) / 2.0 - sum(pos) / len(pos)))
        style = str(line.get_linestyle())
        if style in ("None", "none", "", " "):  # markers only: fliers or a mean
            box.markers.extend(v for v in val if math.isfinite(v))
            continue
        if len(pos) != 2:
            return False
        if _close(pos[0], pos[1]):  # along the value axis: a whisker
            if _close(max(val), box.q1):
                box.low = min(val)
            elif _close(min(val), box.q3):
                box.high = max(val)
            else:
                return False
        elif _close(val[0], val[1]):  # across: the median, a cap or a mean line
            if box.q1 <= val[0] <= box.q3 or _close(val[0], box.q1) or _close(val[0], box.q3):
                # The median spans the box; a cap (at a zero-length whisker) is
                # narrower, and a mean line (meanline=True) is dashed.
                candidate = (abs(pos[1] - pos[0]), style in ("-", "solid"), val[0])
                if box.median is None or candidate[:2] > box.median[:2]:
                    box.median = candidate
        else:
            return False
    return all(box.median is not None for box in boxes)


# --- classification -------------------------------------------------------------------


def _axes_chart(ax: Any, budget: _Budget) -> Dict[str, Any]:
    """One axes as a chart of the one type all its artists fit, else ``unknown``."""
    children = _children(ax)
    if len(children) > MAX_ARTISTS:
        budget.truncated = True
        return _base(ax, "unknown")
    artists = [c for c in children if not _is(c, "Text")]
    if not artists:
        return _base(ax, "unknown")
    error_bars, names = _error_bars(ax)
    data = [
        a
        for a in artists
        if not _is_reference_line(ax, a) and id(a) not in error_bars and not _is_empty(a)
    ]
    if not data:  # only reference lines (or error bars without their data)
        kind = "line" if all(_is(a, "Line2D") for a in artists) else "unknown"
        return _line_chart(ax, [], budget) if kind == "line" else _base(ax, kind)
    if all(_is(a, "Line2D") for a in data):
        boxes = _box_chart(ax, data, budget)
        return boxes if boxes is not None else _line_chart(ax, data, budget, names)
    # Lines with bands (fill_between: seaborn's confidence intervals) are a line chart;
    # bands alone (an area chart) are not.
    lines = [a for a in data if _is(a, "Line2D")]
    if lines and all(_is(a, "Line2D", "FillBetweenPolyCollection") for a in data):
        return _line_chart(ax, lines, budget, names)
    if all(_is(a, "PathPatch", "Line2D") for a in data):
        boxes = _box_chart(ax, data, budget)
        return boxes if boxes is not None else _base(ax, "unknown")
    if all(_is(a, "PathCollection") for a in data):
        return _scatter_chart(ax, data, budget)
    wedges = [a for a in data if _is(a, "Wedge")]
    if wedges and all(_is(a, "Wedge", "Shadow") for a in data):
        return _pie_chart(ax, wedges, budget)
    bars = _bar_containers(ax, data)
    if bars:
        return _bar_chart(ax, bars, budget)
    return _base(ax, "unknown")


def _error_bars(ax: Any) -> Tuple[Set[int], Dict[int, str]]:
    """Ids of the caps and bars of ``errorbar()`` / ``bar(yerr=...)``: they qualify the
    data they belong to, which is typed on its own; and the names of the data lines
    (``errorbar`` gives its label to the container, not to the line)."""
    parts: Set[int] = set()
    names: Dict[int, str] = {}
    for container in getattr(ax, "containers", []):
        if not _is(container, "ErrorbarContainer"):
            continue
        groups = list(container)  # (data line, caplines, barlinecols)
        if groups and groups[0] is not None:
            names[id(groups[0])] = str(container.get_label())
        for group in groups[1:]:
            for artist in group if isinstance(group, (tuple, list)) else [group]:
                if artist is not None:
                    parts.add(id(artist))
    return parts, names


def _bar_containers(ax: Any, data: List[Any]) -> List[Any]:
    """The BarContainers holding every Rectangle of ``data``, if that is all it has
    besides error bars drawn as lines through bar centres (seaborn's barplot)."""
    containers = [c for c in getattr(ax, "containers", []) if _is(c, "BarContainer")]
    if not containers:
        return []
    in_bars = {id(p) for c in containers for p in c.patches}
    centres: List[Tuple[float, float]] = []
    for container in containers:
        across = getattr(container, "orientation", None) == "horizontal"
        for p in container.patches:
            if across:
                centres.append((p.get_y() + p.get_height() / 2.0, 1.0))
            else:
                centres.append((p.get_x() + p.get_width() / 2.0, 0.0))
    for artist in data:
        if _is(artist, "Rectangle") and id(artist) in in_bars:
            continue
        if _is(artist, "Line2D") and _is_error_bar(artist, centres):
            continue
        return []
    return containers if in_bars else []


def _is_error_bar(line: Any, centres: List[Tuple[float, float]]) -> bool:
    try:
        if len(line.get_xdata()) != 2:
            return False
        xs = [float(v) for v in line.get_xdata()]
        ys = [float(v) for v in line.get_ydata()]
    except Exception:
        return False
    for centre, across in centres[:MAX_ARTISTS]:
        pos = ys if across else xs
        if _close(pos[0], centre) and _close(pos[1], centre):
            return True
    return False


def _is_colorbar(ax: Any) -> bool:
    return getattr(ax, "_colorbar", None) is not None


def chart_data(figure: Any) -> Optional[Dict[str, Any]]:
    """Chart data for a (rendered) figure: one axes as a chart, several as a
    ``superchart``; None for a figure without data. Colour bars are not charts."""
    axes = [ax for ax in figure.get_axes() if ax.get_visible() and not _is_colorbar(ax)]
    if not axes or not any(_has_data(ax) for ax in axes):
        return None
    budget = _Budget()
    if len(axes) == 1:
        chart = _axes_chart(axes[0], budget)
    else:
        charts = [_axes_chart(ax, budget) for ax in budget.elements(axes, cap=MAX_CHARTS)]
        title = None
        getter = getattr(figure, "get_suptitle", None)
        if callable(getter):
            title = _label_or_none(getter())
        elif getattr(figure, "_suptitle", None) is not None:
            title = _label_or_none(_text(figure._suptitle))
        chart = {"type": "superchart", "title": title, "elements": charts}
    if budget.truncated:
        chart["truncated"] = True
    return chart
