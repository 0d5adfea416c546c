"""The web app (``/ui``) in a real headless Chromium against a real ``sandlot serve``.

Debian's chromium, driven through Debian's chromium-driver by selenium (no driver or
browser download). One server and one browser per module. The security tests attack
the real page: sandbox output that tries to run script in it, a state-changing call
without the CSRF token, the Content-Security-Policy a browser enforces.

``$SANDLOT_UI_SCREENSHOTS=DIR`` saves a screenshot of each page there (docs/ui/'s
pictures are made so).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from _browser import WAIT, chromium, css, css_all, png_pixels, screenshot, sign_in, wait_for
from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
    pytest.mark.requires_browser,
]

REPO = Path(__file__).resolve().parents[2]
SALES_CSV = REPO / "examples" / "data" / "sales.csv"
DOT_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk\n"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==\n"
)
"""A 1x1 PNG in base64 broken into lines, as base64.encodebytes writes it."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("ui"), "--idle-ttl", "600").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def key(server: ServerProcess) -> str:
    return server.key("analyst")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def new_sandbox(driver: Any) -> str:
    before = css(driver, "#nb-sandbox").get_attribute("value")
    css(driver, "#nb-new-sandbox").click()
    return str(
        wait_for(
            driver,
            lambda d: (v := css(d, "#nb-sandbox").get_attribute("value")) and v != before and v,
            "a new sandbox",
        )
    )


def run_cell(driver: Any, code: str, *, wait: bool = True) -> Any:
    """Run ``code`` in the last cell if it is new and empty, else in a new one; and
    (``wait``) wait until it ends."""
    cell = css_all(driver, ".cell")[-1]
    if cell.get_attribute("data-status") != "idle" or css(cell, "textarea").get_attribute("value"):
        css(driver, "#nb-add-cell").click()
        cell = css_all(driver, ".cell")[-1]
    source = css(cell, "textarea")
    # Set the code in one step (typing it with send_keys is slow for long cells).
    driver.execute_script("arguments[0].value = arguments[1]", source, code)
    css(cell, ".run").click()
    if wait:
        wait_for(
            driver,
            lambda d: cell.get_attribute("data-status") not in ("idle", "running"),
            "the cell to end",
        )
    return cell


def api(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT
    )


# --- the app's security, seen from HTTP ---------------------------------------------------


def test_every_ui_response_carries_a_strict_csp(server: ServerProcess) -> None:
    for path in ("/ui/", "/ui/static/app.js", "/ui/api/session"):
        response = httpx.get(server.url + path, timeout=WAIT)
        csp = response.headers.get("content-security-policy", "")
        directives = {part.split()[0]: part.split()[1:] for part in csp.split("; ") if part}
        assert directives.get("default-src") == ["'self'"], (path, csp)
        assert directives.get("script-src") == ["'self'"], (path, csp)
        assert directives.get("object-src") == ["'none'"], (path, csp)
        assert directives.get("frame-ancestors") == ["'none'"], (path, csp)
        assert "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp, csp
        assert directives.get("require-trusted-types-for") == ["'script'"], csp
        assert response.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(server.url + "/ui/", timeout=WAIT).text
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "inline script in the page"
    assert not re.search(r"\son[a-z]+\s*=", page), "inline event handler in the page"


def test_sign_in_sets_an_httponly_strict_cookie_and_keeps_the_key_out_of_the_page(
    server: ServerProcess, key: str
) -> None:
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        refused = client.post("/ui/api/session", json={"api_key": key + "x"})
        assert refused.status_code == 401
        # A form on another site can post text/plain without a preflight: not JSON, no session.
        form = client.post(
            "/ui/api/session",
            content=json.dumps({"api_key": key}),
            headers={"Content-Type": "text/plain"},
        )
        assert form.status_code == 422 and "set-cookie" not in form.headers
        response = client.post("/ui/api/session", json={"api_key": key})
        assert response.status_code == 200, response.text
        cookie = response.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        assert key not in response.text and key not in cookie
        session = client.get("/ui/api/session").json()
        assert session["tenant"] == "analyst" and key not in json.dumps(session)


def test_state_changing_calls_without_the_csrf_token_are_refused(
    server: ServerProcess, key: str
) -> None:
    with httpx.Client(base_url=server.url, timeout=WAIT) as client, api(server, key) as direct:
        csrf = client.post("/ui/api/session", json={"api_key": key}).json()["csrf"]
        created = direct.post("/v1/sandboxes", json={})
        assert created.status_code == 201, created.text
        sandbox = created.json()["sandbox_id"]
        try:
            attempts = {
                "no token": {},
                # One character off (never the token itself: it may start with "x").
                "wrong token": {"X-CSRF-Token": ("y" if csrf[0] == "x" else "x") + csrf[1:]},
                "foreign origin": {"X-CSRF-Token": csrf, "Origin": "http://evil.example"},
            }
            for what, headers in attempts.items():
                kill = client.delete(f"/ui/api/v1/sandboxes/{sandbox}", headers=headers)
                assert kill.status_code == 403, (what, kill.text)
                assert kill.json()["type"] == "CsrfError"
                create = client.post("/ui/api/v1/sandboxes", json={}, headers=headers)
                assert create.status_code == 403, (what, create.text)
                sign_out = client.delete("/ui/api/session", headers=headers)
                assert sign_out.status_code == 403, (what, sign_out.text)
            assert direct.get(f"/v1/sandboxes/{sandbox}").status_code == 200  # still alive
            foreign = httpx.post(
                server.url + "/ui/api/session",
                json={"api_key": key},
                headers={"Origin": "http://evil.example"},
                timeout=WAIT,
            )
            assert foreign.status_code == 403, "sign-in from another origin"
            # Reads need no token; with the token, the same kill goes through.
            assert client.get(f"/ui/api/v1/sandboxes/{sandbox}").status_code == 200
            done = client.delete(f"/ui/api/v1/sandboxes/{sandbox}", headers={"X-CSRF-Token": csrf})
            assert done.status_code == 204, done.text
        finally:
            direct.delete(f"/v1/sandboxes/{sandbox}")


def test_the_gateway_does_not_forward_the_cookie_or_a_second_key(
    server: ServerProcess, key: str
) -> None:
    other = server.key("other-tenant")
    with httpx.Client(base_url=server.url, timeout=WAIT) as client, api(server, other) as theirs:
        created = theirs.post("/v1/sandboxes", json={})
        assert created.status_code == 201
        sandbox = created.json()["sandbox_id"]
        try:
            client.post("/ui/api/session", json={"api_key": key})
            # A header naming another tenant's key does not replace the session's.
            response = client.get(
                f"/ui/api/v1/sandboxes/{sandbox}", headers={"Authorization": f"Bearer {other}"}
            )
            assert response.status_code == 404, response.text
            # And /v1 never takes the session cookie for a key.
            session = client.cookies["sandlot_ui"]
            direct = httpx.get(
                f"{server.url}/v1/sandboxes",
                headers={"Cookie": f"sandlot_ui={session}"},
                timeout=WAIT,
            )
            assert direct.status_code == 401, direct.text
        finally:
            theirs.delete(f"/v1/sandboxes/{sandbox}")


def test_a_revoked_key_signs_its_sessions_out(server: ServerProcess) -> None:
    key = server.key("short-lived")
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        assert client.post("/ui/api/session", json={"api_key": key}).status_code == 200
        assert client.get("/ui/api/v1/sandboxes").status_code == 200
        server.cli("keys", "revoke", key.split("_")[1])
        assert client.get("/ui/api/v1/sandboxes").status_code == 401
        assert client.get("/ui/api/session").status_code == 401


def test_a_request_with_two_session_cookies_is_not_signed_in(server: ServerProcess) -> None:
    """Cookies ignore ports: a page on another port of this host (or a sibling domain)
    can plant a second ``sandlot_ui`` cookie with a longer Path, which the browser then
    sends first. The gateway and the routes must not each pick a different one (the
    page showing one tenant while the gateway acts as another): two is refused."""
    mine = httpx.post(
        f"{server.url}/ui/api/session", json={"api_key": server.key("victim")}, timeout=WAIT
    )
    planted = httpx.post(
        f"{server.url}/ui/api/session", json={"api_key": server.key("planter")}, timeout=WAIT
    )
    both = {
        "Cookie": f"sandlot_ui={planted.cookies['sandlot_ui']}; "
        f"sandlot_ui={mine.cookies['sandlot_ui']}"
    }
    for path in ("/ui/api/session", "/ui/api/v1/sandboxes", "/ui/api/console/keys"):
        response = httpx.get(server.url + path, headers=both, timeout=WAIT)
        assert response.status_code == 401, (path, response.text)
    # Each alone still works.
    for response, tenant in ((mine, "victim"), (planted, "planter")):
        alone = {"Cookie": f"sandlot_ui={response.cookies['sandlot_ui']}"}
        session = httpx.get(f"{server.url}/ui/api/session", headers=alone, timeout=WAIT)
        assert session.json()["tenant"] == tenant


def test_a_file_downloaded_through_the_gateway_is_never_a_page_of_this_origin(
    server: ServerProcess, key: str
) -> None:
    """A sandbox writes a page with script in it: fetched through the session it comes
    back as an opaque download (saved, not shown; no script if shown anyway)."""
    with api(server, key) as client, httpx.Client(base_url=server.url, timeout=WAIT) as page:
        sandbox = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
        try:
            html = b"<script>document.title='ran'</script><h1>hello</h1>"
            written = client.post(
                f"/v1/sandboxes/{sandbox}/files", params={"path": "page.html"}, content=html
            )
            assert written.status_code in (200, 201), written.text
            assert page.post("/ui/api/session", json={"api_key": key}).status_code == 200
            got = page.get(f"/ui/api/v1/sandboxes/{sandbox}/files", params={"path": "page.html"})
            assert got.status_code == 200 and got.content == html
            assert got.headers["content-type"] == "application/octet-stream"
            assert got.headers["x-content-type-options"] == "nosniff"
            assert got.headers["content-disposition"] == "attachment"
            csp = [part.strip() for part in got.headers["content-security-policy"].split(";")]
            assert "sandbox" in csp and "frame-ancestors 'none'" in csp
        finally:
            client.delete(f"/v1/sandboxes/{sandbox}")


def test_the_gateway_reaches_nothing_outside_v1(server: ServerProcess, key: str) -> None:
    """Dot segments, encoded or not, and doubled slashes are not resolved: with the
    session's key in hand, the gateway still reaches only ``/v1`` routes (not the
    key-guarded ``/openapi.json``, ``/metrics`` or the E2B control plane)."""
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        assert client.post("/ui/api/session", json={"api_key": key}).status_code == 200
        for path in (
            "/ui/api/v1/../../openapi.json",
            "/ui/api/v1/%2e%2e/%2e%2e/openapi.json",
            "/ui/api/v1/%2E%2E%2F%2E%2E%2Fmetrics",
            "/ui/api/v1//metrics",
            "/ui/api/v1/..%2f..%2fv2/sandboxes",
            "/ui/api/v1/sandboxes/..%2f..%2f..%2fmetrics",
        ):
            response = client.get(path)
            assert response.status_code == 404, (path, response.status_code, response.text)
        # X-API-Key and a method override from the page are dropped like Authorization.
        other = server.key("gateway-other")
        with api(server, other) as theirs:
            sandbox = theirs.post("/v1/sandboxes", json={}).json()["sandbox_id"]
            try:
                seen = client.get(f"/ui/api/v1/sandboxes/{sandbox}", headers={"X-API-Key": other})
                assert seen.status_code == 404, seen.text
                killed = client.get(
                    f"/ui/api/v1/sandboxes/{sandbox}",
                    headers={"X-HTTP-Method-Override": "DELETE", "X-API-Key": other},
                )
                assert killed.status_code == 404
                assert theirs.get(f"/v1/sandboxes/{sandbox}").status_code == 200
            finally:
                theirs.delete(f"/v1/sandboxes/{sandbox}")


def test_sign_in_issues_a_fresh_id_and_sign_out_forgets_it(server: ServerProcess, key: str) -> None:
    """A cookie the browser held before signing in (planted or old) is not the one it
    holds after; a signed-out id (a copy an attacker kept) is dead on the server too."""
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        assert client.post("/ui/api/session", json={"api_key": key}).status_code == 200
        first = client.cookies["sandlot_ui"]
        again = client.post("/ui/api/session", json={"api_key": key})
        second = again.cookies["sandlot_ui"]
        assert second != first
        old = httpx.get(f"{server.url}/ui/api/session", headers={"Cookie": f"sandlot_ui={first}"})
        assert old.status_code == 401, old.text
        csrf = again.json()["csrf"]
        assert client.delete("/ui/api/session", headers={"X-CSRF-Token": csrf}).status_code == 204
        kept = {"Cookie": f"sandlot_ui={second}"}
        for path in ("/ui/api/session", "/ui/api/v1/sandboxes"):
            response = httpx.get(server.url + path, headers=kept, timeout=WAIT)
            assert response.status_code == 401, (path, response.text)


def test_one_key_holds_a_bounded_number_of_sessions(server: ServerProcess) -> None:
    """Signing in over and over with one key signs out only that key's oldest sessions
    (the store's global cap is then out of one key's reach)."""
    other = httpx.post(
        f"{server.url}/ui/api/session", json={"api_key": server.key("bystander")}, timeout=WAIT
    ).cookies["sandlot_ui"]
    flooder = server.key("flooder")
    ids = [
        httpx.post(f"{server.url}/ui/api/session", json={"api_key": flooder}, timeout=WAIT).cookies[
            "sandlot_ui"
        ]
        for _ in range(33)
    ]

    def alive(session: str) -> bool:
        headers = {"Cookie": f"sandlot_ui={session}"}
        response = httpx.get(f"{server.url}/ui/api/session", headers=headers, timeout=WAIT)
        return response.status_code == 200

    assert not alive(ids[0])
    assert all(alive(session) for session in ids[1:])
    assert alive(other)


# --- in the browser -------------------------------------------------------------------------


def test_sign_in_upload_the_demo_csv_and_plot(
    browser: Any, server: ServerProcess, key: str
) -> None:
    browser.get(f"{server.url}/ui/")
    wait_for(browser, lambda d: css(d, "#page-signin").is_displayed(), "the sign-in page")
    screenshot(browser, "signin")
    sign_in(browser, server, key)
    # The key is in no storage the page's scripts can read, nor in the document.
    leftovers = browser.execute_script(
        "return [document.cookie, JSON.stringify(localStorage), JSON.stringify(sessionStorage),"
        " document.documentElement.outerHTML, document.querySelector('#signin-key').value]"
    )
    assert all(key not in item for item in leftovers)
    assert "sandlot_ui" not in leftovers[0], "the session cookie is readable from script"

    new_sandbox(browser)
    css(browser, "#files-upload").send_keys(str(SALES_CSV))
    wait_for(browser, lambda d: css_all(d, '#files-list tr[data-path="sales.csv"]'), "the upload")

    # Download it back through the file's link (the session's cookie, no key).
    link = css(browser, '#files-list tr[data-path="sales.csv"] a.file')
    assert link.get_attribute("download") == "sales.csv"
    downloaded = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0].href).then(r => r.text()).then(done, e => done(String(e)));",
        link,
    )
    assert downloaded == SALES_CSV.read_text()

    table = run_cell(browser, "import pandas as pd\ndf = pd.read_csv('sales.csv')\ndf.head()")
    assert table.get_attribute("data-status") == "ok", table.text
    assert css(table, ".count").text == "[1]"
    assert "pre-check" in css(table, ".precheck").text
    frame = css(table, "iframe.output-frame")
    assert frame.get_attribute("sandbox") == ""
    browser.switch_to.frame(frame)
    try:
        assert "SO-2024-00001" in css(browser, "table").text
    finally:
        browser.switch_to.default_content()

    chart = run_cell(
        browser,
        "import matplotlib.pyplot as plt\n"
        "monthly = df.groupby(df['date'].str[:7])['revenue'].sum()\n"
        "monthly.plot(kind='bar', title='Revenue by month')\n"
        "plt.tight_layout()\n"
        "plt.show()\n"
        "print('months:', len(monthly))",
    )
    assert chart.get_attribute("data-status") == "ok", chart.text
    assert "months: 12" in css(chart, ".output-stdout").text
    image = css(chart, "img.output-image")
    wait_for(
        browser,
        lambda d: d.execute_script(
            "return arguments[0].complete && arguments[0].naturalWidth", image
        ),
        "the chart to decode",
    )
    source = image.get_attribute("src")
    assert source.startswith("data:image/png;base64,")
    colours, ink = png_pixels(base64.b64decode(source.split(",", 1)[1]))
    assert colours > 8 and ink > 0.02, (colours, ink)
    # What the browser painted, not only what it was sent.
    colours, ink = png_pixels(image.screenshot_as_png)
    assert colours > 8 and ink > 0.02, (colours, ink)
    screenshot(browser, "notebook")


def test_interrupt_a_long_cell(browser: Any, server: ServerProcess, key: str) -> None:
    sign_in(browser, server, key)
    if not css(browser, "#nb-sandbox").get_attribute("value"):
        new_sandbox(browser)
    cell = run_cell(
        browser,
        "import time\n"
        "for i in range(100000):\n"
        "    print('tick', i, flush=True)\n"
        "    time.sleep(0.05)",
        wait=False,
    )
    # Streamed: output shows while the cell still runs.
    wait_for(browser, lambda d: "tick 3" in css(cell, ".output").text, "streamed output")
    assert cell.get_attribute("data-status") == "running"
    started = time.monotonic()
    css(browser, "#nb-interrupt").click()
    wait_for(browser, lambda d: cell.get_attribute("data-status") != "running", "the interrupt")
    assert cell.get_attribute("data-status") == "interrupted", cell.text
    assert time.monotonic() - started < 30
    # The context lives on: the next cell runs in it.
    after = run_cell(browser, "print('still here', i > 0)")
    assert "still here True" in css(after, ".output").text


def test_contexts_and_restart(browser: Any, server: ServerProcess, key: str) -> None:
    from selenium.webdriver.support.select import Select

    sign_in(browser, server, key)
    new_sandbox(browser)
    assert css(browser, "#nb-context").get_attribute("value") == "default"
    run_cell(browser, "answer = 42")
    css(browser, "#nb-new-context").click()
    wait_for(
        browser,
        lambda d: css(d, "#nb-context").get_attribute("value") != "default",
        "a new context",
    )
    # A context has variables of its own.
    other = run_cell(browser, "print('answer' in globals())")
    assert "False" in css(other, ".output-stdout").text
    Select(css(browser, "#nb-context")).select_by_value("default")
    same = run_cell(browser, "print(answer)")
    assert "42" in css(same, ".output-stdout").text
    css(browser, "#nb-restart").click()
    wait_for(browser, lambda d: "restarted" in css(d, "#nb-status").text, "the restart")
    gone = run_cell(browser, "answer")
    assert gone.get_attribute("data-status") == "error"
    assert "NameError" in css(gone, ".output-error").text


def test_sandbox_output_cannot_run_script_in_the_page(
    browser: Any, server: ServerProcess, key: str
) -> None:
    sign_in(browser, server, key)
    if not css(browser, "#nb-sandbox").get_attribute("value"):
        new_sandbox(browser)
    browser.execute_script("delete window.__sandlot_xss")
    html = (
        "<img src=x onerror=\"parent.__sandlot_xss=1;document.title='ran'\">"
        "<script>parent.__sandlot_xss=2;document.title='ran'</script><b id=evil>bold</b>"
    )
    svg = (
        "<svg xmlns='http://www.w3.org/2000/svg' onload=\"parent.__sandlot_xss=3;"
        "document.title='ran'\"><script>parent.__sandlot_xss=4;document.title='ran'</script>"
        "<circle id=evil cx='10' cy='10' r='5'/></svg>"
    )
    cell = run_cell(
        browser,
        "from IPython.display import display\n"
        f"HTML_ = {html!r}\n"
        f"SVG_ = {svg!r}\n"
        "class EvilHtml:\n"
        "    def _repr_html_(self): return HTML_\n"
        "class EvilSvg:\n"
        "    def _repr_svg_(self): return SVG_\n"
        "print(HTML_)\n"
        "display(EvilHtml())\n"
        "display(EvilSvg())\n"
        "raise ValueError(HTML_)\n",
    )
    assert cell.get_attribute("data-status") == "error", cell.text
    # Text output stays text: the markup shows literally, nothing is parsed from it.
    assert "<img src=x onerror=" in css(cell, ".output-stdout").text
    assert "<script>" in css(cell, ".output-error").text
    assert not css_all(cell, ".output-stdout *, .output-error *")
    frames = css_all(cell, "iframe.output-frame")
    assert len(frames) == 2, cell.text
    for frame in frames:
        assert frame.get_attribute("sandbox") == ""
        browser.switch_to.frame(frame)
        try:
            # The content is there (so it was rendered); its scripts did not run (they
            # would have set the frame's title).
            wait_for(browser, lambda d: css_all(d, "#evil"), "the frame's content")
            titles = [t.get_attribute("textContent") for t in css_all(browser, "title")]
            assert "ran" not in titles
        finally:
            browser.switch_to.default_content()
    assert browser.execute_script("return window.__sandlot_xss") is None
    assert not [
        entry for entry in browser.get_log("browser") if "__sandlot_xss" in entry["message"]
    ]


def test_a_result_built_to_stall_the_image_check_does_not_freeze_the_page(
    browser: Any, server: ServerProcess, key: str
) -> None:
    """A "PNG" of 1.6 million spaces and one stray character: the page's base64 check
    once backtracked quadratically on it (the tab froze for many minutes, and this
    test's browser call timed out). It must be refused as not base64, at once."""
    sign_in(browser, server, key)
    if not css(browser, "#nb-sandbox").get_attribute("value"):
        new_sandbox(browser)
    cell = run_cell(
        browser,
        "from IPython.display import display\n"
        f"DOT = {DOT_PNG!r}\n"
        "class Stall:\n"
        "    def _repr_png_(self): return ' ' * 1_600_000 + '!'\n"
        "class Dot:\n"
        "    def _repr_png_(self): return DOT\n"
        "display(Stall())\n"
        "display(Dot())\n",
    )
    assert cell.get_attribute("data-status") == "ok", cell.text
    results = css_all(cell, ".result")
    assert len(results) == 2, cell.text
    assert "(png image that is not base64)" in results[0].text
    assert not css_all(results[0], "img")
    # A real PNG whose base64 is broken into lines still shows.
    dot = css(results[1], "img.output-image")
    wait_for(
        browser, lambda d: d.execute_script("return arguments[0].naturalWidth", dot), "the PNG"
    )


def test_file_names_show_as_text_with_hidden_characters_revealed(
    browser: Any, server: ServerProcess, key: str
) -> None:
    """A sandbox names its files: markup in a name stays text, and a right-to-left
    override cannot make ``invoice<RLO>fdp.exe`` pass for ``invoiceexe.pdf``."""
    sign_in(browser, server, key)
    sandbox = new_sandbox(browser)
    markup = "<img src=x onerror=window.__sandlot_xss=5>"
    run_cell(
        browser,
        f"open({markup!r}, 'w').write('x')\n"
        "open('invoice\u202efdp.exe', 'w').write('x')\n"
        "open('tab\there', 'w').write('x')\n",
    )
    css(browser, "#files-refresh").click()
    # Read the list in one step (it is redrawn when a cell ends).
    links = wait_for(
        browser,
        lambda d: (
            (
                rows := d.execute_script(
                    "return [...document.querySelectorAll('#files-list a.file')]"
                    ".map((a) => [a.textContent, a.getAttribute('download')])"
                )
            )
            and len(rows) >= 3
            and rows
        ),
        "the files",
    )
    names = [name for name, _ in links]
    assert markup in names, names
    assert "invoice⟨U+202E⟩fdp.exe" in names and "tab\there" in names, names
    assert not any("\u202e" in name for name in names), names
    assert ["invoice⟨U+202E⟩fdp.exe"] * 2 in [list(pair) for pair in links], links
    assert not css_all(browser, "#files-list img")
    assert browser.execute_script("return window.__sandlot_xss") is None
    with api(server, key) as client:
        client.delete(f"/v1/sandboxes/{sandbox}")


ATTACK_PAGE = """<!doctype html><title>attack</title><body><script>
const target = %(target)s, key = %(key)s, sandbox = %(sandbox)s;
const json = JSON.stringify({ api_key: key });
const files = target + '/ui/api/v1/sandboxes/' + sandbox + '/files?path=';
const tries = [
  // Same site (cookies ignore ports, SameSite=Strict lets the cookie through): a raw
  // upload, which needs no JSON, into a sandbox of the victim's whose id it learnt.
  fetch(files + 'planted.txt', { method: 'POST', mode: 'no-cors',
    credentials: 'include', headers: { 'Content-Type': 'text/plain' }, body: 'planted' }),
  fetch(files + 'planted2.txt', { method: 'POST', mode: 'no-cors',
    credentials: 'include', body: new Blob(['planted']) }),
  // Login CSRF: sign the victim in with the attacker's key (no Content-Type at all).
  fetch(target + '/ui/api/session', { method: 'POST', mode: 'no-cors',
    credentials: 'include', body: new Blob([json]) }),
  fetch(target + '/ui/api/session', { method: 'POST', mode: 'no-cors',
    credentials: 'include', headers: { 'Content-Type': 'text/plain' }, body: json }),
];
const form = document.createElement('form');
form.method = 'POST';
form.enctype = 'text/plain';
form.action = target + '/ui/api/session';
form.target = 'sink';
const input = document.createElement('input');
input.name = '{"api_key": "' + key + '", "x": "';
input.value = '"}';
form.append(input);
const sink = document.createElement('iframe');
sink.name = 'sink';
sink.onload = () => { if (sink.dataset.sent) document.title = 'form done'; };
document.body.append(sink, form);
Promise.allSettled(tries).then((results) => {
  document.body.dataset.fetches = results.map((r) => r.status).join(',');
  sink.dataset.sent = '1';
  form.submit();
});
</script>"""


@contextlib.contextmanager
def attacker_site(page: str) -> Iterator[str]:
    """Another origin on the same host (same site: another port): serves ``page``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()
        thread.join()


def test_another_site_on_this_host_can_neither_act_nor_sign_the_browser_in(
    browser: Any, server: ServerProcess, key: str
) -> None:
    """A page on another port of this host: the browser sends the session cookie with
    its requests (same site), and it tries to write a file into the victim's sandbox,
    then to sign the browser in with the attacker's own key (fetch with no
    Content-Type or text/plain, and a text/plain form). Nothing happens."""
    attacker_key = server.key("attacker")
    sign_in(browser, server, key)
    whoami = css(browser, "#whoami").text
    assert "analyst" in whoami
    with api(server, key) as mine, api(server, attacker_key) as theirs:
        sandbox = mine.post("/v1/sandboxes", json={}).json()["sandbox_id"]
        try:
            page = ATTACK_PAGE % {
                "target": json.dumps(server.url),
                "key": json.dumps(attacker_key),
                "sandbox": json.dumps(sandbox),
            }
            with attacker_site(page) as site:
                browser.get(f"{site}/")
                wait_for(browser, lambda d: d.title == "form done", "the attack page")
                fetches = browser.execute_script("return document.body.dataset.fetches")
                assert fetches == "fulfilled,fulfilled,fulfilled,fulfilled", fetches
            listed = mine.get(f"/v1/sandboxes/{sandbox}/files/list", params={"path": "."})
            assert not [e for e in listed.json() if "planted" in e["name"]], listed.json()
            assert theirs.get("/v1/sandboxes").json() == []
        finally:
            mine.delete(f"/v1/sandboxes/{sandbox}")
    browser.get(f"{server.url}/ui/")
    wait_for(browser, lambda d: css_all(d, "body[data-ready]"), "the app")
    assert css(browser, "#whoami").text == whoami  # still the victim's own session


def test_sandbox_html_cannot_navigate_the_app_open_windows_or_submit_forms(
    browser: Any, server: ServerProcess, key: str
) -> None:
    """Links and forms inside an HTML result, clicked by the user: none may take the
    app's tab elsewhere, open a window, or send anything."""
    sign_in(browser, server, key)
    if not css(browser, "#nb-sandbox").get_attribute("value"):
        new_sandbox(browser)
    html = (
        "<a id=top target=_top href='/health'>top</a> "
        "<a id=blank target=_blank href='/health'>blank</a> "
        "<a id=js href='javascript:parent.__sandlot_xss=6'>js</a> "
        "<a id=away href='http://127.0.0.2:9/'>away</a> "
        "<form id=f action='/ui/api/v1/sandboxes' method=post target=_top>"
        "<input name=x value=y><button id=send>send</button></form>"
    )
    cell = run_cell(
        browser,
        f"HTML_ = {html!r}\nclass Page:\n    def _repr_html_(self): return HTML_\nPage()\n",
    )
    frame = css(cell, "iframe.output-frame")
    app = browser.current_url
    windows = list(browser.window_handles)
    for target in ("top", "blank", "js", "send", "away"):
        browser.switch_to.frame(frame)
        try:
            wait_for(browser, lambda d, t=target: css_all(d, f"#{t}"), f"the {target} link")
            css(browser, f"#{target}").click()
        finally:
            browser.switch_to.default_content()
        assert browser.current_url == app, target
        assert list(browser.window_handles) == windows, target
        assert browser.execute_script("return window.__sandlot_xss") is None, target
        if target != "away":  # the last one may take the frame itself: that is its own box
            frame = css(cell, "iframe.output-frame")


def test_a_script_on_the_page_without_the_csrf_token_is_refused(
    browser: Any, server: ServerProcess, key: str
) -> None:
    """Even from the app's own origin (the cookie is sent), no token: no change."""
    sign_in(browser, server, key)
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/ui/api/v1/sandboxes', {method: 'POST', headers: {'Content-Type':"
        " 'application/json'}, body: '{}'}).then(r => done(r.status), e => done(String(e)));"
    )
    assert status == 403


def test_kill_a_sandbox_from_the_console(browser: Any, server: ServerProcess, key: str) -> None:
    with api(server, key) as direct:
        created = direct.post("/v1/sandboxes", json={"metadata": {"purpose": "console test"}})
        assert created.status_code == 201, created.text
        sandbox = created.json()["sandbox_id"]
        sign_in(browser, server, key)
        browser.get(f"{server.url}/ui/#/console")
        row = f'#console-sandboxes tr[data-sandbox="{sandbox}"]'
        wait_for(browser, lambda d: css_all(d, row), "the sandbox in the console")
        cells = [td.text for td in css_all(css(browser, row), "td")]
        assert cells[1] == "python-data" and cells[2].endswith(("ms", "s", "min")), cells
        assert cells[6].endswith("GiB") or cells[6].endswith("MiB"), cells  # its memory limit
        wait_for(browser, lambda d: css_all(d, "#audit-results tr[data-execution]"), "the audit")
        # The server's figures are drawn (from numbers, as SVG) and the tenant's keys
        # listed, this session's marked.
        wait_for(browser, lambda d: css_all(d, "#figures svg"), "the figures")
        keys = css(browser, "#keys").text
        assert key.split("_")[1] in keys and "this session" in keys, keys
        screenshot(browser, "console")
        css(css(browser, row), "button.kill").click()
        wait_for(browser, lambda d: not css_all(d, row), "the row to go")
        assert direct.get(f"/v1/sandboxes/{sandbox}").status_code == 404


def test_audit_search_finds_a_cell_by_its_code(
    browser: Any, server: ServerProcess, key: str
) -> None:
    sign_in(browser, server, key)
    if not css(browser, "#nb-sandbox").get_attribute("value"):
        new_sandbox(browser)
    marker = f"audit_marker_{time.monotonic_ns()}"
    run_cell(browser, f"{marker} = 1")
    browser.get(f"{server.url}/ui/#/console")
    wait_for(browser, lambda d: css(d, "#page-console").is_displayed(), "the console")
    css(browser, "#audit-text").send_keys(marker)
    css(browser, "#audit-form button[type=submit]").click()
    rows = wait_for(
        browser,
        lambda d: [r for r in css_all(d, "#audit-results tr[data-execution]") if marker in r.text],
        "the search result",
    )
    assert len(css_all(browser, "#audit-results tr[data-execution]")) == len(rows) == 1


def test_chat_says_how_to_configure_a_model_when_none_is(
    browser: Any, server: ServerProcess, key: str
) -> None:
    sign_in(browser, server, key)
    browser.get(f"{server.url}/ui/#/chat")
    note = wait_for(
        browser,
        lambda d: css(d, "#chat-unavailable").is_displayed() and css(d, "#chat-unavailable"),
        "the note",
    )
    assert "SANDLOT_CHAT_PROVIDER" in note.text
    assert not css(browser, "#chat-start").is_enabled()
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        csrf = client.post("/ui/api/session", json={"api_key": key}).json()["csrf"]
        refused = client.post("/ui/api/chat", headers={"X-CSRF-Token": csrf})
        assert refused.status_code == 503 and refused.json()["type"] == "ChatUnavailable"
