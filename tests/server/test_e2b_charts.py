"""Charts through a real server to the unmodified ``e2b_code_interpreter`` client.

Configured as in test_e2b.py (``E2B_DEBUG=true``, the key in ``E2B_SANDBOX_URL``). Each
chart type must come back as the client's own Chart subclass with its fields filled,
sync and async, and the native API must carry the very same chart dict.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

PLT = "import matplotlib.pyplot as plt\n"
CODES = {
    "line": PLT + "plt.plot([1, 2, 3], [4, 5, 6], label='up')\n"
    "plt.xlabel('Time (s)')\nplt.yscale('log')\nplt.title('Line')\n",
    "scatter": PLT + "plt.scatter([1, 2], [3, 4], label='dots')\nplt.ylabel('Y [m]')\n",
    "bar": PLT + "plt.bar(['a', 'b'], [3, 5], label='sales')\nplt.xlabel('Shop')\n",
    "pie": PLT + "plt.pie([1, 3], labels=['one', 'three'])\n",
    "box_and_whisker": PLT + "plt.boxplot([[1, 2, 3, 4, 5, 30], [2, 3, 4]], patch_artist=True)\n",
    "superchart": PLT + "fig, axs = plt.subplots(1, 2)\nfig.suptitle('Both')\n"
    "axs[0].plot([1, 2])\naxs[1].boxplot([[1, 2, 3]])\n",
    "unknown": PLT + "plt.imshow([[0, 1], [1, 0]])\nplt.title('Heat')\n",
}


class E2B:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.key = server.key("e2b-charts")

    def url(self) -> str:
        host = self.server.url.removeprefix("http://")
        return f"http://sandlot:{self.key}@{host}/e2b"


@pytest.fixture(scope="module")
def e2b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2B]:
    server = ServerProcess(tmp_path_factory.mktemp("e2b-charts")).start()
    try:
        yield E2B(server)
    finally:
        server.stop()


@pytest.fixture
def client_env(e2b: E2B, monkeypatch: pytest.MonkeyPatch) -> E2B:
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b.url())
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    return e2b


def _only_chart(execution: Any) -> Any:
    assert execution.error is None, execution.error
    [result] = [r for r in execution.results if r.png is not None]
    assert result.chart is not None
    return result.chart


def test_every_chart_type_becomes_its_client_class(
    client_env: E2B, caplog: pytest.LogCaptureFixture
) -> None:
    from e2b_code_interpreter import Sandbox
    from e2b_code_interpreter.charts import (
        BarChart,
        BoxAndWhiskerChart,
        Chart,
        ChartType,
        LineChart,
        PieChart,
        ScaleType,
        ScatterChart,
        SuperChart,
    )

    sbx = Sandbox.create()
    charts = {kind: _only_chart(sbx.run_code(code)) for kind, code in CODES.items()}
    assert not [r for r in caplog.records if "chart" in r.getMessage()]  # all deserialized

    line = charts["line"]
    assert type(line) is LineChart and line.type == ChartType.LINE and line.title == "Line"
    assert (line.x_label, line.x_unit, line.x_scale, line.y_scale) == (
        "Time (s)",
        "s",
        ScaleType.LINEAR,
        ScaleType.LOG,
    )
    assert [(e.label, e.points) for e in line.elements] == [
        ("up", [(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)])
    ]
    assert all(isinstance(t, float) for t in line.x_ticks) and line.x_tick_labels

    scatter = charts["scatter"]
    assert type(scatter) is ScatterChart and scatter.y_unit == "m"
    assert [(e.label, e.points) for e in scatter.elements] == [("dots", [(1.0, 3.0), (2.0, 4.0)])]

    bar = charts["bar"]
    assert type(bar) is BarChart and bar.x_label == "Shop"
    assert [(e.label, e.group, e.value) for e in bar.elements] == [
        ("a", "sales", 3.0),
        ("b", "sales", 5.0),
    ]

    pie = charts["pie"]
    assert type(pie) is PieChart
    assert [(e.label, e.angle, e.radius) for e in pie.elements] == [
        ("one", 90.0, 1.0),
        ("three", 270.0, 1.0),
    ]

    box = charts["box_and_whisker"]
    assert type(box) is BoxAndWhiskerChart and box.type == ChartType.BOX_AND_WHISKER
    assert [
        (e.label, e.min, e.first_quartile, e.median, e.third_quartile, e.max, e.outliers)
        for e in box.elements
    ] == [
        ("1", 1.0, 2.25, 3.5, 4.75, 5.0, [30.0]),
        ("2", 2.0, 2.5, 3.0, 3.5, 4.0, []),
    ]

    superchart = charts["superchart"]
    assert type(superchart) is SuperChart and superchart.title == "Both"
    assert [type(c) for c in superchart.elements] == [LineChart, BoxAndWhiskerChart]

    unknown = charts["unknown"]
    assert type(unknown) is Chart and unknown.type == ChartType.UNKNOWN
    assert (unknown.title, unknown.elements) == ("Heat", [])


def test_async_client_and_the_native_api_see_the_same_chart(client_env: E2B) -> None:
    from e2b_code_interpreter import AsyncSandbox
    from e2b_code_interpreter.charts import BoxAndWhiskerChart

    async def run() -> Any:
        sbx = await AsyncSandbox.create()
        return _only_chart(await sbx.run_code(CODES["box_and_whisker"]))

    chart = asyncio.run(run())
    assert isinstance(chart, BoxAndWhiskerChart)

    server = client_env.server
    headers = {"Authorization": f"Bearer {client_env.key}"}
    created = httpx.post(f"{server.url}/v1/sandboxes", json={}, headers=headers, timeout=120)
    sandbox_id = created.json()["sandbox_id"]
    try:
        response = httpx.post(
            f"{server.url}/v1/sandboxes/{sandbox_id}/execute",
            json={"code": CODES["box_and_whisker"]},
            headers=headers,
            timeout=120,
        )
        messages = [json.loads(line) for line in response.text.splitlines() if line]
        [native] = [m["chart"] for m in messages if m.get("type") == "result" and "chart" in m]
    finally:
        httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)
    assert native == chart.to_dict()


def test_e2b_chart_fills_what_the_client_indexes() -> None:
    """A chart missing keys (an older runner's) still deserializes on the client."""
    from e2b_code_interpreter.charts import BoxAndWhiskerChart, PieChart, _deserialize_chart

    from sandlot.server._e2b import e2b_chart

    box = _deserialize_chart(e2b_chart({"type": "box_and_whisker", "elements": [{"label": "a"}]}))
    assert isinstance(box, BoxAndWhiskerChart) and box.elements[0].outliers == []
    pie = _deserialize_chart(e2b_chart({"type": "pie", "elements": [{"angle": 360.0}]}))
    assert isinstance(pie, PieChart) and pie.elements[0].label is None
