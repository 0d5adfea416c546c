"""Charts extracted from real matplotlib figures inside a real sandbox (python-data).

Each test draws one kind of chart the way a user (or a model) would, lets the cell end
(the open figure comes back as a result) and checks the extracted ``Result.chart``:
its type, labels, units, scales and elements, in the shape E2B's code interpreter
uses. tests/unit/test_chart_classifier.py covers the corner cases on the host; this file proves
the whole path: the template's matplotlib, the runner's extraction, the wire.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import pytest

import sandlot
from sandlot import Sandbox

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

PREAMBLE = "import matplotlib.pyplot as plt\nimport numpy as np\n"


def _chart(sandbox: Sandbox, code: str) -> dict[str, Any]:
    """The chart of the one figure ``code`` draws."""
    execution = sandbox.run_code(PREAMBLE + code)
    assert execution.error is None, execution.error
    assert execution.status == "ok"
    [figure] = [r for r in execution.results if r.png is not None]
    assert figure.chart is not None
    json.dumps(figure.chart, allow_nan=False)  # travels as strict JSON
    return figure.chart


def test_line_chart_with_dates_and_units(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "import datetime\n"
        "days = [datetime.date(2024, 3, 1) + datetime.timedelta(days=i) for i in range(50)]\n"
        "x = np.linspace(0, 2 * np.pi, 50)\n"
        "plt.figure(figsize=(8, 4))\n"
        "plt.plot(days, np.sin(x), label='sin(x)')\n"
        "plt.plot(days, np.cos(x))\n"
        "plt.xlabel('Day (UTC)')\n"
        "plt.ylabel('Amplitude [V]')\n"
        "plt.title('Waves')\n",
    )
    assert chart["type"] == "line"
    assert chart["title"] == "Waves"
    assert (chart["x_label"], chart["x_unit"]) == ("Day (UTC)", "UTC")
    assert (chart["y_label"], chart["y_unit"]) == ("Amplitude [V]", "V")
    assert (chart["x_scale"], chart["y_scale"]) == ("datetime", "linear")
    assert chart["x_ticks"] and all(isinstance(t, str) for t in chart["x_ticks"])
    datetime.datetime.fromisoformat(chart["x_ticks"][0])
    assert all(isinstance(t, float) for t in chart["y_ticks"])
    assert len(chart["x_tick_labels"]) == len(chart["x_ticks"])
    assert all(isinstance(t, str) for t in chart["y_tick_labels"])
    first, second = chart["elements"]
    assert first["label"] == "sin(x)"
    assert second["label"].startswith("Line ")  # matplotlib's automatic label, named
    assert len(first["points"]) == 50
    assert first["points"][0] == ["2024-03-01", 0.0]
    assert all(isinstance(x, str) and isinstance(y, float) for x, y in first["points"])


def test_log_and_categorical_scales(sandbox: Sandbox) -> None:
    log = _chart(
        sandbox,
        "x = np.linspace(0, 10, 20)\n"
        "plt.plot(x, np.exp(x))\n"
        "plt.yscale('log')\n"
        "plt.ylabel('Growth (log scale)')\n",
    )
    assert log["type"] == "line"
    assert (log["x_scale"], log["y_scale"]) == ("linear", "log")
    assert log["y_unit"] == "log scale"
    assert all(isinstance(t, float) for t in log["x_ticks"] + log["y_ticks"])

    categorical = _chart(sandbox, "plt.plot([1, 2, 3], ['low', 'mid', 'high'])\n")
    assert (categorical["x_scale"], categorical["y_scale"]) == ("linear", "categorical")
    assert categorical["y_tick_labels"] == ["low", "mid", "high"]
    assert categorical["elements"][0]["points"] == [[1.0, "low"], [2.0, "mid"], [3.0, "high"]]


def test_scatter_chart(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "rng = np.random.default_rng(0)\n"
        "plt.scatter(rng.random(5), rng.random(5), label='Dataset 1')\n"
        "plt.scatter([0.5, 0.25], [0.125, 1.0], label='Dataset 2')\n"
        "plt.grid(True)\n"
        "plt.axhline(0.5)\n"  # a reference line is not data
        "plt.xlabel('A')\n",
    )
    assert chart["type"] == "scatter"
    assert chart["title"] is None and chart["x_label"] == "A" and chart["y_label"] is None
    assert (chart["x_scale"], chart["y_scale"]) == ("linear", "linear")
    first, second = chart["elements"]
    assert first["label"] == "Dataset 1" and len(first["points"]) == 5
    assert second == {"label": "Dataset 2", "points": [[0.5, 0.125], [0.25, 1.0]]}


def test_bar_charts_simple_grouped_stacked_and_horizontal(sandbox: Sandbox) -> None:
    simple = _chart(
        sandbox,
        "plt.bar(['Author A', 'Author B', 'Author C'], [100, 200, 300], label='Books Sold')\n"
        "plt.xlabel('Authors')\n"
        "plt.ylabel('Books (units)')\n"
        "plt.title('Sales')\n",
    )
    assert simple["type"] == "bar"
    assert (simple["title"], simple["x_label"], simple["y_label"]) == (
        "Sales",
        "Authors",
        "Books (units)",
    )
    assert (simple["x_unit"], simple["y_unit"]) == (None, "units")
    assert simple["elements"] == [
        {"label": "Author A", "group": "Books Sold", "value": 100.0},
        {"label": "Author B", "group": "Books Sold", "value": 200.0},
        {"label": "Author C", "group": "Books Sold", "value": 300.0},
    ]

    grouped = _chart(
        sandbox,
        "x = np.arange(2)\n"
        "fig, ax = plt.subplots()\n"
        "ax.bar(x - 0.2, [1, 2], 0.4, label='2023')\n"
        "ax.bar(x + 0.2, [3, 4], 0.4, label='2024')\n"
        "ax.set_xticks(x, ['north', 'south'])\n",
    )
    assert [(e["label"], e["group"], e["value"]) for e in grouped["elements"]] == [
        ("north", "2023", 1.0),
        ("south", "2023", 2.0),
        ("north", "2024", 3.0),
        ("south", "2024", 4.0),
    ]

    stacked = _chart(
        sandbox,
        "plt.bar(['q1', 'q2'], [5, 6], label='cost')\n"
        "plt.bar(['q1', 'q2'], [1, 2], bottom=[5, 6], label='profit')\n",
    )
    # Each segment's own value, not its top.
    assert [(e["label"], e["group"], e["value"]) for e in stacked["elements"]] == [
        ("q1", "cost", 5.0),
        ("q2", "cost", 6.0),
        ("q1", "profit", 1.0),
        ("q2", "profit", 2.0),
    ]

    horizontal = _chart(
        sandbox,
        "plt.barh(['red', 'green', 'blue'], [3, 3, 7])\n"
        "plt.xlabel('Votes (k)')\n"
        "plt.ylabel('Colour')\n",
    )
    # x_label is the category axis, as for vertical bars.
    assert (horizontal["x_label"], horizontal["y_label"]) == ("Colour", "Votes (k)")
    assert (horizontal["x_unit"], horizontal["y_unit"]) == (None, "k")
    assert [(e["label"], e["value"]) for e in horizontal["elements"]] == [
        ("red", 3.0),
        ("green", 3.0),
        ("blue", 7.0),
    ]
    assert {e["group"] for e in horizontal["elements"]} == {"Group 0"}


def test_pie_chart(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "fig, ax = plt.subplots()\n"
        "ax.pie([90, 10], labels=['No', 'No, in blue'], autopct='%1.1f%%', startangle=90)\n"
        "ax.set_title('Will I wake up early tomorrow?')\n",
    )
    assert chart == {
        "type": "pie",
        "title": "Will I wake up early tomorrow?",
        "elements": [
            {"label": "No", "angle": 324.0, "radius": 1.0},
            {"label": "No, in blue", "angle": 36.0, "radius": 1.0},
        ],
    }


BOXES = (
    "data = {'Class A': [85, 90, 78, 92, 88], 'Class B': [95, 89, 76, 91, 84, 87],"
    " 'Class C': [75, 82, 88, 79, 86]}\n"
    "fig, ax = plt.subplots()\n"
    "ax.set_title('Exam Scores Distribution')\n"
    "ax.set_xlabel('Class')\n"
    "ax.set_ylabel('Score (points)')\n"
)
EXPECTED_BOXES = [
    {
        "label": "Class A",
        "min": 78.0,
        "first_quartile": 85.0,
        "median": 88.0,
        "third_quartile": 90.0,
        "max": 92.0,
        "outliers": [],
    },
    {
        "label": "Class B",
        "min": 84.0,
        "first_quartile": 84.75,
        "median": 88.0,
        "third_quartile": 90.5,
        "max": 95.0,
        "outliers": [76.0],
    },
    {
        "label": "Class C",
        "min": 75.0,
        "first_quartile": 79.0,
        "median": 82.0,
        "third_quartile": 86.0,
        "max": 88.0,
        "outliers": [],
    },
]


def test_box_and_whisker_chart(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox, BOXES + "ax.boxplot(data.values(), tick_labels=data.keys(), patch_artist=True)\n"
    )
    assert chart["type"] == "box_and_whisker"
    assert chart["title"] == "Exam Scores Distribution"
    assert (chart["x_label"], chart["y_label"]) == ("Class", "Score (points)")
    assert (chart["x_unit"], chart["y_unit"]) == (None, "points")
    assert chart["elements"] == EXPECTED_BOXES


def test_boxplot_accepts_the_old_labels_spelling(sandbox: Sandbox) -> None:
    """``labels=`` (matplotlib before 3.9, and most code written for E2B) still works on
    a matplotlib that only knows ``tick_labels=``: on Axes and through pyplot."""
    on_axes = _chart(sandbox, BOXES + "ax.boxplot(data.values(), labels=data.keys())\n")
    assert on_axes["elements"] == EXPECTED_BOXES
    through_pyplot = _chart(
        sandbox,
        BOXES + "plt.sca(ax)\nplt.boxplot(list(data.values()), labels=list(data.keys()))\n",
    )
    assert through_pyplot["elements"] == EXPECTED_BOXES


def test_box_and_whisker_variants(sandbox: Sandbox) -> None:
    # Boxes drawn as lines (matplotlib's default), with means shown: still boxes.
    lines = _chart(
        sandbox, BOXES + "ax.boxplot(data.values(), tick_labels=data.keys(), showmeans=True)\n"
    )
    assert lines["type"] == "box_and_whisker"
    assert lines["elements"] == EXPECTED_BOXES
    # Horizontal boxes: x_label stays the category axis.
    horizontal = _chart(
        sandbox,
        BOXES + "ax.boxplot(data.values(), tick_labels=data.keys(), orientation='horizontal')\n",
    )
    assert horizontal["type"] == "box_and_whisker"
    assert (horizontal["x_label"], horizontal["y_label"]) == ("Score (points)", "Class")
    assert horizontal["elements"] == EXPECTED_BOXES
    # seaborn draws its boxes with matplotlib's boxplot too.
    seaborn = _chart(
        sandbox,
        "import seaborn as sns\n"
        "sns.boxplot(x=['a'] * 5 + ['b'] * 5, y=[1, 2, 3, 4, 50, 5, 6, 7, 8, 9])\n",
    )
    assert seaborn["type"] == "box_and_whisker"
    assert [(e["label"], e["median"], e["outliers"]) for e in seaborn["elements"]] == [
        ("a", 3.0, [50.0]),
        ("b", 7.0, []),
    ]


def test_seaborn_charts(sandbox: Sandbox) -> None:
    """seaborn adds legend handles that draw nothing, confidence bands and error bars
    around the data; the chart is still the data's type."""
    sns = "import seaborn as sns\n"
    line = _chart(sandbox, sns + "sns.lineplot(x=[1, 1, 2, 2], y=[1, 3, 2, 4])\n")
    assert line["type"] == "line"
    assert line["elements"][0]["points"] == [[1.0, 2.0], [2.0, 3.0]]  # the means
    scatter = _chart(sandbox, sns + "sns.scatterplot(x=[1, 2], y=[3, 4], hue=['a', 'b'])\n")
    assert scatter["type"] == "scatter"
    assert scatter["elements"][0]["points"] == [[1.0, 3.0], [2.0, 4.0]]
    bars = _chart(
        sandbox, sns + "sns.barplot(x=['a', 'a', 'b', 'b'], y=[1, 2, 3, 4], hue=['u', 'v'] * 2)\n"
    )
    assert bars["type"] == "bar"
    assert sorted((e["label"], e["value"]) for e in bars["elements"]) == [
        ("a", 1.0),
        ("a", 2.0),
        ("b", 3.0),
        ("b", 4.0),
    ]


def test_superchart(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "fig, axs = plt.subplots(1, 3, figsize=(12, 4))\n"
        "fig.suptitle('Multiple Charts')\n"
        "axs[0].plot(np.linspace(0, 10, 100), np.sin(np.linspace(0, 10, 100)), 'r')\n"
        "axs[0].set_title('Sine Wave')\n"
        "axs[0].grid(True)\n"
        "axs[1].scatter([1, 2], [3, 4], label='points')\n"
        "axs[1].set_xlabel('X')\n"
        "axs[2].pie([1, 3])\n",
    )
    assert chart["type"] == "superchart"
    assert chart["title"] == "Multiple Charts"
    line, scatter, pie = chart["elements"]
    assert (line["type"], line["title"], line["x_label"]) == ("line", "Sine Wave", None)
    assert len(line["elements"]) == 1 and len(line["elements"][0]["points"]) == 100
    assert (scatter["type"], scatter["x_label"]) == ("scatter", "X")
    assert scatter["elements"] == [{"label": "points", "points": [[1.0, 3.0], [2.0, 4.0]]}]
    assert [e["angle"] for e in pie["elements"]] == [90.0, 270.0]


def test_unknown_is_never_a_wrong_type(sandbox: Sandbox) -> None:
    circles = _chart(
        sandbox,
        "fig, ax = plt.subplots()\n"
        "ax.add_artist(plt.Circle((0, 0), 1, fill=False))\n"
        "ax.add_artist(plt.Circle((0, 0), 2, fill=False))\n"
        "ax.grid(True)\n"
        "plt.title('Two Concentric Circles')\n",
    )
    assert circles == {"type": "unknown", "title": "Two Concentric Circles", "elements": []}
    # A heat map with its colour bar: one image, not a two-chart figure.
    heatmap = _chart(sandbox, "plt.imshow(np.eye(3))\nplt.colorbar()\n")
    assert heatmap == {"type": "unknown", "title": None, "elements": []}
    # Bars with a line over them are neither a bar nor a line chart.
    mixed = _chart(sandbox, "plt.bar([1, 2], [3, 4])\nplt.plot([1, 2], [3, 4])\n")
    assert mixed["type"] == "unknown"


def test_a_huge_figure_is_capped_and_says_so(sandbox: Sandbox) -> None:
    from sandlot.runner._charts import MAX_POINTS

    started = time.monotonic()
    line = _chart(sandbox, "plt.plot(np.arange(2_000_000), np.arange(2_000_000) % 7)\n")
    assert line["truncated"] is True
    [series] = line["elements"]
    assert 100 <= len(series["points"]) <= MAX_POINTS
    # Evenly sampled over the whole series, first and last points included.
    assert series["points"][0] == [0.0, 0.0]
    assert series["points"][-1] == [1_999_999.0, float(1_999_999 % 7)]
    many = _chart(sandbox, "for i in range(400):\n    plt.plot([0, 1], [i, i + 1])\n")
    assert many["truncated"] is True and len(many["elements"]) < 400
    assert len(json.dumps(many)) < 1_000_000
    assert time.monotonic() - started < 90  # rendering 2M points dominates; catches a hang


def test_result_chart_is_the_e2b_dict(sandbox: Sandbox) -> None:
    """sandlot's own Result carries the same dict the E2B wire sends."""
    execution = sandbox.run_code(PREAMBLE + "plt.bar(['a'], [1]);\n")
    [result] = [r for r in execution.results if r.png is not None]
    assert isinstance(result, sandlot.Result)
    assert result.chart == {
        "type": "bar",
        "title": None,
        "x_label": None,
        "y_label": None,
        "x_unit": None,
        "y_unit": None,
        "elements": [{"label": "a", "group": "Group 0", "value": 1.0}],
    }


def test_an_image_saved_to_a_file_is_also_shown(sandbox: Sandbox) -> None:
    """As in E2B's template: `img.save(path)` writes the file and returns the picture;
    a save into a buffer (how PIL renders its own PNG) shows nothing."""
    execution = sandbox.run_code(
        "import io\n"
        "from PIL import Image\n"
        "img = Image.new('RGB', (16, 8), (200, 10, 10))\n"
        "img.save(io.BytesIO(), format='PNG')\n"
        "img.save('saved-image.png')\n"
        "import os; print(os.path.getsize('saved-image.png') > 0)\n"
    )
    assert execution.error is None, execution.error
    assert execution.logs.stdout == ["True\n"]
    [shown] = execution.results
    assert shown.png is not None and not shown.is_main_result
    failed = sandbox.run_code("img.save('/no-such-dir/x.png')")
    assert failed.error is not None and failed.error.name == "FileNotFoundError"
    assert failed.results == []
