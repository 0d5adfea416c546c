"""The chart classifier (``sandlot.runner._charts``) on the host's matplotlib.

tests/integration/test_charts.py runs one chart of each type inside a real sandbox;
this file covers the corner cases: variants of each type, what must stay ``unknown``,
scales and units, and the caps that keep a huge figure inside the result budget.
"""

from __future__ import annotations

import datetime
import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandlot.runner import _charts
from sandlot.runner._display import CHART_MIME, mimebundle

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

Draw = Callable[[Any, Any], object]


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    yield
    plt.close("all")


def chart_of(draw: Draw, *, subplots: tuple[int, int] = (1, 1)) -> dict[str, Any] | None:
    """Draw on a fresh figure, then extract as the runner does (after rendering)."""
    figure, axes = plt.subplots(*subplots)
    draw(figure, axes)
    bundle = mimebundle(figure)
    chart = bundle.get(CHART_MIME)
    json.dumps(chart, allow_nan=False)
    return chart


def typed(draw: Draw, kind: str, **kwargs: Any) -> dict[str, Any]:
    chart = chart_of(draw, **kwargs)
    assert chart is not None
    assert chart["type"] == kind, chart
    return chart


# --- line and scatter -----------------------------------------------------------------


def test_line_points_labels_and_reference_lines() -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.plot([1, 2, 3], [4, 5, 6], label="up")
        ax.plot(np.array([1, 2]), np.array([np.nan, 2.5]))
        ax.axhline(5)  # decoration, not data
        ax.axvline(2)

    chart = typed(draw, "line")
    assert [e["label"] for e in chart["elements"]] == ["up", "Line 1"]
    assert chart["elements"][0]["points"] == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]
    assert chart["elements"][1]["points"] == [[1.0, None], [2.0, 2.5]]  # NaN is null
    assert all(isinstance(x, float) for x, _ in chart["elements"][0]["points"])
    assert chart["x_tick_labels"] and all(isinstance(t, float) for t in chart["x_ticks"])


def test_a_closed_line_is_still_a_line() -> None:
    chart = typed(lambda f, ax: ax.plot([0, 1, 1, 0, 0], [0, 0, 1, 1, 0]), "line")
    assert len(chart["elements"][0]["points"]) == 5


@pytest.mark.parametrize(
    ("xs", "first"),
    [
        (
            [datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.datetime(2024, 1, 3)],
            "2024-01-02T03:04:05",
        ),
        (
            np.array(["2024-01-02T03:04:05", "2024-01-03"], dtype="datetime64[ns]"),
            "2024-01-02T03:04:05",
        ),
    ],
)
def test_dates_are_iso_text_and_a_datetime_scale(xs: Any, first: str) -> None:
    chart = typed(lambda f, ax: ax.plot(xs, [1, 2]), "line")
    assert chart["x_scale"] == "datetime" and chart["y_scale"] == "linear"
    assert chart["elements"][0]["points"][0] == [first, 1.0]
    assert all(isinstance(t, str) for t in chart["x_ticks"])
    datetime.datetime.fromisoformat(chart["x_ticks"][0])


def test_pandas_time_series_plot() -> None:
    pd = pytest.importorskip("pandas")
    series = pd.Series([1.0, 2.0, 3.0], index=pd.period_range("2024-01", periods=3, freq="M"))
    chart = typed(lambda f, ax: series.plot(ax=ax), "line")
    assert chart["x_scale"] == "datetime"
    assert [x for x, _ in chart["elements"][0]["points"]] == [
        "2024-01-01T00:00:00",
        "2024-02-01T00:00:00",
        "2024-03-01T00:00:00",
    ]


@pytest.mark.parametrize("scale", ["log", "symlog", "logit", "asinh"])
def test_scales(scale: str) -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.plot([0.1, 0.5, 0.9], [0.1, 0.5, 0.9])
        ax.set_yscale(scale)

    chart = typed(draw, "line")
    assert (chart["x_scale"], chart["y_scale"]) == ("linear", scale)


def test_categorical_scales() -> None:
    strings = typed(lambda f, ax: ax.plot(["a", "b", "c"], [1, 2, 3]), "line")
    assert strings["x_scale"] == "categorical" and strings["x_tick_labels"] == ["a", "b", "c"]
    assert strings["elements"][0]["points"][0] == ["a", 1.0]

    def named(fig: Any, ax: Any) -> None:
        ax.plot([0, 1, 2], [3, 1, 2])
        ax.set_xticks([0, 1, 2], ["low", "mid", "high"])

    assert typed(named, "line")["x_scale"] == "categorical"
    numbers = typed(lambda f, ax: ax.plot([0, 1, 2], [3, 1, 2]), "line")
    assert numbers["x_scale"] == "linear"


@pytest.mark.parametrize(
    ("label", "unit"),
    [
        ("Time (s)", "s"),
        ("Speed [m/s]", "m/s"),
        ("Y-axis (log scale)", "log scale"),
        ("f(x)", None),  # no space before the parenthesis: part of the name
        ("Count", None),
        ("Empty ()", None),
    ],
)
def test_units_from_labels(label: str, unit: str | None) -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.plot([1, 2], [1, 2])
        ax.set_xlabel(label)

    chart = typed(draw, "line")
    assert (chart["x_label"], chart["x_unit"]) == (label, unit)
    assert (chart["y_label"], chart["y_unit"]) == (None, None)


def test_scatter_with_dates_and_a_reference_line() -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.scatter([datetime.date(2024, 5, 1), datetime.date(2024, 5, 3)], [1, 2], label="d")
        ax.scatter([datetime.date(2024, 5, 2)], [3])
        ax.axhline(1.5)
        ax.grid(True)

    chart = typed(draw, "scatter")
    assert chart["x_scale"] == "datetime"
    assert chart["elements"][0] == {
        "label": "d",
        "points": [["2024-05-01T00:00:00+00:00", 1.0], ["2024-05-03T00:00:00+00:00", 2.0]],
    }
    assert chart["elements"][1]["label"] == "_child1"  # matplotlib's own name, as E2B


# --- bars -----------------------------------------------------------------------------


def test_numeric_bars_and_histograms_are_named_by_position() -> None:
    bars = typed(lambda f, ax: ax.bar([1, 2, 3], [4, 5, 6]), "bar")
    assert [(e["label"], e["group"], e["value"]) for e in bars["elements"]] == [
        ("1", "Group 0", 4.0),
        ("2", "Group 0", 5.0),
        ("3", "Group 0", 6.0),
    ]
    hist = typed(lambda f, ax: ax.hist([1, 1, 2, 3, 3, 3], bins=[0, 2, 4], label="n"), "bar")
    assert [(e["label"], e["group"], e["value"]) for e in hist["elements"]] == [
        ("1", "n", 2.0),
        ("3", "n", 4.0),
    ]


def test_grouped_bars_with_many_groups_keep_their_categories() -> None:
    def draw(fig: Any, ax: Any) -> None:
        x = np.arange(3)
        for i, offset in enumerate((-0.3, -0.15, 0.0, 0.15, 0.3)):
            ax.bar(x + offset, [i, i, i], 0.15, label=f"s{i}")
        ax.set_xticks(x, ["2021", "2022", "2023"])  # numbers, but names here

    chart = typed(draw, "bar")
    assert len(chart["elements"]) == 15
    assert [e["label"] for e in chart["elements"][:3]] == ["2021", "2022", "2023"]
    assert {e["label"] for e in chart["elements"]} == {"2021", "2022", "2023"}


def test_bars_on_dates_and_pandas_bars() -> None:
    dated = typed(lambda f, ax: ax.bar([datetime.date(2024, 1, 5)], [3]), "bar")
    assert dated["elements"][0]["label"] == "2024-01-05T00:00:00+00:00"
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": [1, 2], "b": [3, 4]}, index=["x", "y"])
    chart = typed(lambda f, ax: frame.plot.bar(ax=ax), "bar")
    assert [(e["label"], e["group"], e["value"]) for e in chart["elements"]] == [
        ("x", "a", 1.0),
        ("y", "a", 2.0),
        ("x", "b", 3.0),
        ("y", "b", 4.0),
    ]


def test_error_bars_qualify_the_data_they_belong_to() -> None:
    line = typed(lambda f, ax: ax.errorbar([1, 2], [3, 4], yerr=[1, 1], label="m"), "line")
    assert line["elements"] == [{"label": "m", "points": [[1.0, 3.0], [2.0, 4.0]]}]
    bars = typed(lambda f, ax: ax.bar(["a", "b"], [3, 4], yerr=[1, 1], capsize=3), "bar")
    assert [(e["label"], e["value"]) for e in bars["elements"]] == [("a", 3.0), ("b", 4.0)]


def test_what_seaborn_adds_around_the_data_is_not_data() -> None:
    # Legend handles that draw nothing, and a confidence band that may be empty.
    def scatter(fig: Any, ax: Any) -> None:
        ax.scatter([1, 2], [3, 4])
        ax.plot([], [], label="hue a")

    assert typed(scatter, "scatter")["elements"][0]["points"] == [[1.0, 3.0], [2.0, 4.0]]

    def bars(fig: Any, ax: Any) -> None:
        ax.bar(["a", "b"], [1, 2])
        ax.add_patch(plt.Rectangle((0, 0), 0, 0, label="hue u"))

    assert len(typed(bars, "bar")["elements"]) == 2

    def band(fig: Any, ax: Any) -> None:
        ax.plot([1, 2, 3], [2, 3, 2], label="mean")
        ax.fill_between([1, 2, 3], [1, 2, 1], [3, 4, 3], alpha=0.2)

    assert [e["label"] for e in typed(band, "line")["elements"]] == ["mean"]


def test_bars_with_error_bars_drawn_as_lines_stay_bars() -> None:
    # seaborn's barplot draws each error bar as a two-point line through the bar.
    def draw(fig: Any, ax: Any) -> None:
        ax.bar(["a", "b"], [2, 3])
        ax.plot([0, 0], [1.5, 2.5], color="k")
        ax.plot([1, 1], [2.5, 3.5], color="k")

    assert [e["value"] for e in typed(draw, "bar")["elements"]] == [2.0, 3.0]


def test_horizontal_bars_swap_labels() -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.barh(["a", "b"], [1, 1], label="same widths")
        ax.set_xlabel("Value (EUR)")
        ax.set_ylabel("Name")

    chart = typed(draw, "bar")
    assert (chart["x_label"], chart["x_unit"], chart["y_label"], chart["y_unit"]) == (
        "Name",
        None,
        "Value (EUR)",
        "EUR",
    )
    assert [(e["label"], e["value"]) for e in chart["elements"]] == [("a", 1.0), ("b", 1.0)]


# --- pie ------------------------------------------------------------------------------


def test_pie_variants() -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.pie([1, 2, 1], explode=[0, 0.1, 0], wedgeprops={"width": 0.4}, radius=2, shadow=True)

    chart = typed(draw, "pie")
    assert chart == {
        "type": "pie",
        "title": None,
        "elements": [
            {"label": "", "angle": 90.0, "radius": 2.0},
            {"label": "", "angle": 180.0, "radius": 2.0},
            {"label": "", "angle": 90.0, "radius": 2.0},
        ],
    }


# --- box and whisker ------------------------------------------------------------------

DATA = [[1, 2, 3, 4, 5, 30, -20], [2, 3, 4, 5, 6]]


def _boxes(chart: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (
            e["label"],
            e["min"],
            e["first_quartile"],
            e["median"],
            e["third_quartile"],
            e["max"],
            e["outliers"],
        )
        for e in chart["elements"]
    ]


EXPECTED = [
    ("1", 1.0, 1.5, 3.0, 4.5, 5.0, [-20.0, 30.0]),
    ("2", 2.0, 3.0, 4.0, 5.0, 6.0, []),
]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"patch_artist": True},
        {"notch": True},
        {"notch": True, "patch_artist": True},
        {"showmeans": True},
        {"showmeans": True, "meanline": True},
        {"showcaps": False},
        {"orientation": "horizontal"},
        {"orientation": "horizontal", "patch_artist": True, "showmeans": True},
    ],
)
def test_boxplot_variants(options: dict[str, Any]) -> None:
    chart = typed(lambda f, ax: ax.boxplot(DATA, **options), "box_and_whisker")
    assert _boxes(chart) == EXPECTED


def test_boxplot_with_several_outliers_zero_whiskers_and_positions() -> None:
    def draw(fig: Any, ax: Any) -> None:
        ax.boxplot([[5, 5, 5, 5, 5, 5, 100, -100, 200]], positions=[7], tick_labels=["flat"])
        ax.set_ylabel("Score [pts]")

    chart = typed(draw, "box_and_whisker")
    assert _boxes(chart) == [("flat", 5.0, 5.0, 5.0, 5.0, 5.0, [-100.0, 100.0, 200.0])]
    assert (chart["x_label"], chart["y_label"], chart["y_unit"]) == (None, "Score [pts]", "pts")


def test_pandas_boxplot() -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": [1, 2, 3, 4], "b": [2, 4, 6, 8]})
    chart = typed(lambda f, ax: frame.boxplot(ax=ax), "box_and_whisker")
    assert [(e["label"], e["median"]) for e in chart["elements"]] == [("a", 2.5), ("b", 5.0)]


# --- unknown, blank, superchart -------------------------------------------------------


@pytest.mark.parametrize(
    "draw",
    [
        lambda f, ax: ax.errorbar([1, 2], [3, 4], yerr=[1, 1], fmt="none"),  # bars, no data
        lambda f, ax: ax.fill_between([1, 2], [0, 0], [1, 2]),
        lambda f, ax: (ax.bar([1, 2], [3, 4]), ax.plot([1, 2], [3, 4])),
        lambda f, ax: (ax.scatter([1], [2]), ax.plot([1, 2], [3, 4])),
        lambda f, ax: ax.add_patch(plt.Rectangle((0, 0), 1, 1)),  # a rectangle, not a bar
        lambda f, ax: (ax.boxplot(DATA, patch_artist=True), ax.plot([1, 2], [3, 9])),
        lambda f, ax: (ax.imshow(np.eye(3)), f.colorbar(ax.images[0])),
        lambda f, ax: ax.stem([1, 2], [3, 4]),
        lambda f, ax: ax.hist([1, 2, 2, 3], histtype="step"),
    ],
    ids=[
        "errorbar-only",
        "fill_between",
        "bar+line",
        "scatter+line",
        "rectangle",
        "boxplot+line",
        "imshow+colorbar",
        "stem",
        "step-histogram",
    ],
)
def test_never_a_wrong_type(draw: Draw) -> None:
    chart = typed(draw, "unknown")
    assert chart["elements"] == []


def test_blank_figures_have_no_chart() -> None:
    assert chart_of(lambda f, ax: None) is None
    assert chart_of(lambda f, ax: ax.set_title("nothing yet")) is None
    assert chart_of(lambda f, axes: None, subplots=(1, 2)) is None


def test_superchart() -> None:
    def draw(fig: Any, axes: Any) -> None:
        fig.suptitle("All")
        axes[0].plot([1, 2], [3, 4])
        axes[1].pie([1, 1])
        twin = axes[0].twinx()
        twin.bar([1, 2], [5, 6])

    chart = typed(draw, "superchart", subplots=(1, 3))
    assert chart["title"] == "All"
    assert [c["type"] for c in chart["elements"]] == ["line", "pie", "unknown", "bar"]


def test_the_e2b_client_builds_its_chart_classes() -> None:
    charts = pytest.importorskip("e2b_code_interpreter.charts")
    drawings: dict[str, Draw] = {
        "LineChart": lambda f, ax: ax.plot([1, 2], [3, 4]),
        "ScatterChart": lambda f, ax: ax.scatter([1, 2], [3, 4]),
        "BarChart": lambda f, ax: ax.bar(["a"], [1]),
        "PieChart": lambda f, ax: ax.pie([1, 2]),
        "BoxAndWhiskerChart": lambda f, ax: ax.boxplot(DATA),
        "Chart": lambda f, ax: ax.imshow(np.eye(2)),
    }
    for name, draw in drawings.items():
        chart = charts._deserialize_chart(chart_of(draw))
        assert type(chart).__name__ == name
    superchart = charts._deserialize_chart(
        chart_of(lambda f, axes: [ax.plot([1], [2]) for ax in axes], subplots=(1, 2))
    )
    assert isinstance(superchart, charts.SuperChart)
    assert [type(c).__name__ for c in superchart.elements] == ["LineChart", "LineChart"]
    box = charts._deserialize_chart(chart_of(drawings["BoxAndWhiskerChart"]))
    assert [b.outliers for b in box.elements] == [[-20.0, 30.0], []]
    capped = chart_of(lambda f, ax: ax.plot(np.arange(_charts.MAX_POINTS + 1)))
    assert capped is not None and capped["truncated"] is True
    line = charts._deserialize_chart(capped)  # the extra key does not trouble the client
    assert isinstance(line, charts.LineChart) and line.to_dict()["truncated"] is True


# --- budget ---------------------------------------------------------------------------


def test_a_long_series_is_sampled_evenly() -> None:
    n = 1_000_001
    chart = typed(lambda f, ax: ax.plot(np.arange(n), np.arange(n) * 2.0), "line")
    assert chart["truncated"] is True
    points = chart["elements"][0]["points"]
    assert len(points) == _charts.MAX_POINTS
    assert points[0] == [0.0, 0.0] and points[-1] == [n - 1.0, 2.0 * (n - 1)]
    steps = {b[0] - a[0] for a, b in itertools.pairwise(points)}
    assert max(steps) - min(steps) <= 1  # evenly spread


def test_short_series_are_whole_and_not_marked() -> None:
    chart = typed(lambda f, ax: ax.plot(np.arange(_charts.MAX_POINTS)), "line")
    assert "truncated" not in chart
    assert len(chart["elements"][0]["points"]) == _charts.MAX_POINTS


def test_caps_on_elements_figure_points_and_subcharts() -> None:
    many_lines = typed(
        lambda f, ax: [ax.plot([0, 1], [i, i + 1]) for i in range(_charts.MAX_ELEMENTS + 5)],
        "line",
    )
    assert len(many_lines["elements"]) == _charts.MAX_ELEMENTS and many_lines["truncated"]

    series = _charts.MAX_TOTAL_POINTS // _charts.MAX_POINTS + 5
    big = typed(
        lambda f, ax: [ax.plot(np.arange(_charts.MAX_POINTS) + i) for i in range(series)], "line"
    )
    assert sum(len(e["points"]) for e in big["elements"]) == _charts.MAX_TOTAL_POINTS
    assert big["truncated"] is True

    bars = typed(lambda f, ax: ax.bar(np.arange(500), np.ones(500)), "bar")
    assert len(bars["elements"]) == _charts.MAX_ELEMENTS and bars["truncated"]

    figure = plt.figure()
    for i in range(_charts.MAX_CHARTS + 4):
        figure.add_subplot(6, 6, i + 1).plot([1, 2])
    chart = _charts.chart_data(figure)
    assert chart is not None and len(chart["elements"]) == _charts.MAX_CHARTS
    assert chart["truncated"] is True


def test_a_huge_figure_is_extracted_quickly_and_small() -> None:
    figure, ax = plt.subplots()
    for i in range(300):
        ax.plot(np.arange(20_000), np.arange(20_000) + i)
    ax.scatter(np.arange(500_000), np.arange(500_000))  # makes it unknown: mixed
    figure2, ax2 = plt.subplots()
    for i in range(300):
        ax2.plot(np.arange(20_000), np.arange(20_000) + i)
    started = time.perf_counter()
    mixed = _charts.chart_data(figure)
    lines = _charts.chart_data(figure2)
    elapsed = time.perf_counter() - started
    assert mixed is not None and mixed["type"] == "unknown"
    assert lines is not None and lines["truncated"] is True
    assert len(json.dumps(lines)) < 2_000_000
    assert elapsed < 30.0  # about 0.2 s on an idle machine; the bound only catches a hang
