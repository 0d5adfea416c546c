"""The web app's chat in a real headless Chromium: a real ``sandlot serve`` whose agent
talks to the scripted model over loopback. The user allows one cell, edits another,
refuses a third; the model hears each decision, and the cells that ran are in the
tenant's audit trail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripted_model import Run, Say, ScriptedModel, last_tool_result

from _browser import chromium, css, css_all, png_pixels, screenshot, sign_in, wait_for
from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
    pytest.mark.requires_browser,
]

SALES = Path(__file__).resolve().parents[2] / "examples" / "data" / "sales.csv"
CHART = (
    "import matplotlib.pyplot as plt\n"
    "df.groupby('region')['revenue'].sum().plot(kind='bar', title='Revenue by region')\n"
    "plt.show()"
)


def answer(body: dict[str, Any]) -> Say:
    # The model reads the last tool result: the refusal of the third cell.
    # Model text is untrusted too: markup in it must show as text.
    return Say(
        f"North sells most. (last result: {last_tool_result(body)[:80]}) "
        '<img src=x onerror="window.__sandlot_xss=1">'
    )


@pytest.fixture(scope="module")
def model() -> Iterator[ScriptedModel]:
    script = [
        Run("print(df.shape)"),
        Run(CHART),
        Run("import os\nos.system('id')"),
        answer,
    ]
    with ScriptedModel(script) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: ScriptedModel) -> Iterator[Any]:
    env = {
        "SANDLOT_CHAT_PROVIDER": "openai",
        "SANDLOT_CHAT_BASE_URL": f"{model.url}/v1",
        "SANDLOT_CHAT_MODEL": "scripted",
        "OPENAI_API_KEY": "not-a-real-key",
    }
    server = ServerProcess(tmp_path_factory.mktemp("ui-chat"), "--idle-ttl", "600", env=env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def review(driver: Any, step: int) -> Any:
    return wait_for(
        driver,
        lambda d: [
            box
            for box in css_all(d, '.chat-review[data-status="review"]')
            if css(box, ".count").text == f"cell {step}"
        ],
        f"cell {step} to wait for a decision",
    )[0]


def test_chat_allow_edit_refuse(server: ServerProcess, model: ScriptedModel) -> None:
    key = server.key("analyst")
    with chromium() as browser:
        sign_in(browser, server, key)
        browser.get(f"{server.url}/ui/#/chat")
        wait_for(browser, lambda d: css(d, "#page-chat").is_displayed(), "the chat page")
        css(browser, "#chat-start").click()
        wait_for(browser, lambda d: css(d, "#chat-upload").is_enabled(), "the chat's sandbox")
        css(browser, "#chat-upload").send_keys(str(SALES))
        wait_for(browser, lambda d: "Loaded sales.csv as df" in css(d, "#chat-log").text, "data")
        css(browser, "#chat-question").send_keys("Which region sells most? Plot it.")
        css(browser, "#chat-ask").click()

        first = review(browser, 1)
        assert "print(df.shape)" in css(first, "textarea").get_attribute("value")
        assert "pre-check" in css(first, ".precheck").text  # the cell's report is shown
        css(first, "button.allow").click()
        wait_for(browser, lambda d: "(1200, 9)" in css(d, "#chat-log").text, "the first result")

        second = review(browser, 2)
        source = css(second, "textarea")
        edited = CHART.replace("Revenue by region", "Edited by the user")
        browser.execute_script("arguments[0].value = arguments[1]", source, edited)
        css(second, "button.edit").click()
        image = wait_for(browser, lambda d: css_all(d, ".chat-step img.output-image"), "chart")[0]
        wait_for(
            browser,
            lambda d: d.execute_script("return arguments[0].naturalWidth", image),
            "the chart to decode",
        )
        colours, ink = png_pixels(image.screenshot_as_png)
        assert colours > 8 and ink > 0.02, (colours, ink)
        assert "Edited by the user" in css(browser, ".chat-step .code-ran").text

        third = review(browser, 3)
        assert css(third, ".precheck").text  # os.system: the pre-check has something to say
        css(third, "button.refuse").click()
        final = wait_for(browser, lambda d: css_all(d, ".chat-answer"), "the answer")[0]
        assert "North sells most." in final.text
        assert "refused" in final.text  # the model was told why the cell did not run
        assert "<img src=x onerror=" in final.text and not css_all(final, "img")
        assert browser.execute_script("return window.__sandlot_xss") is None
        screenshot(browser, "chat")

    # The edited cell ran (not the model's), as the tenant, and is on its audit trail;
    # the refused one never ran.
    rows = [
        json.loads(line)
        for line in server.cli("audit", "--tenant", "analyst", "--json").stdout.splitlines()
    ]
    codes = [row["code"] for row in rows]
    assert any("Edited by the user" in code for code in codes), codes
    assert not any("Revenue by region" in code or "os.system" in code for code in codes)
    assert {row["tenant"] for row in rows} == {"analyst"}
    assert len(model.requests) == 4


TROJAN = (
    # Python reads: access != "none<RLO> <LRI># admin only<PDI> <LRI>", always true; an
    # editor reorders the line so that the comparison seems to end at "none".
    'access = "user"\n'
    'if access != "none\u202e \u2066# admin only\u2069 \u2066":\n'
    '    print("ran for", access)\n'
)


def test_a_cell_with_hidden_characters_cannot_be_approved_as_shown(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """ "Trojan Source": a model (or a prompt injection) writes a cell whose bidirectional
    controls make it read differently from how Python runs it. The review shows them
    and will not run the cell as is: what is approved is what runs."""
    with ScriptedModel([Run(TROJAN), Say("done")]) as model:
        env = {
            "SANDLOT_CHAT_PROVIDER": "openai",
            "SANDLOT_CHAT_BASE_URL": f"{model.url}/v1",
            "SANDLOT_CHAT_MODEL": "scripted",
            "OPENAI_API_KEY": "not-a-real-key",
        }
        server = ServerProcess(tmp_path_factory.mktemp("ui-chat-hidden"), env=env).start()
        try:
            with chromium() as browser:
                sign_in(browser, server, server.key("reviewer"))
                browser.get(f"{server.url}/ui/#/chat")
                wait_for(browser, lambda d: css(d, "#page-chat").is_displayed(), "the chat")
                css(browser, "#chat-start").click()
                wait_for(browser, lambda d: css(d, "#chat-question").is_enabled(), "the chat")
                css(browser, "#chat-question").send_keys("Am I an admin?")
                css(browser, "#chat-ask").click()
                box = review(browser, 1)
                shown = css(box, "textarea").get_attribute("value")
                assert "\u202e" not in shown and "\u2066" not in shown, shown
                assert "⟨U+202E⟩" in shown and "⟨U+2066⟩" in shown, shown
                assert css(box, ".hidden-characters").is_displayed()
                assert not css(box, "button.allow").is_enabled()
                css(box, "button.refuse").click()
                wait_for(browser, lambda d: css_all(d, ".chat-answer"), "the answer")
            rows = server.cli("audit", "--tenant", "reviewer", "--json").stdout.splitlines()
            assert not any("admin only" in row for row in rows), rows
        finally:
            server.stop()
