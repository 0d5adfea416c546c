"""Helpers for the web app's browser tests: Debian's chromium driven by selenium.

No browser or driver is downloaded: ``/usr/bin/chromium`` and ``/usr/bin/chromedriver``
come from the distribution (``scripts/setup.sh``), named explicitly so selenium never
looks for one.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _server_harness import ServerProcess

WAIT = 60.0
"""Seconds a step may take on a busy shared machine before the test fails."""

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # runs as root in CI; the page under test is ours
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's chromium through Debian's chromium-driver, headless, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="ui-test-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_script_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, condition: Callable[[Any], Any], what: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT, ignored_exceptions=[StaleElementReferenceException]).until(
        condition, f"timed out waiting for {what}"
    )


def css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def css_all(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def screenshot(driver: Any, name: str) -> None:
    folder = os.environ.get("SANDLOT_UI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        size = driver.get_window_size()
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(size["width"], min(max(size["height"], height + 140), 2400))
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))
        driver.set_window_size(size["width"], size["height"])


def sign_in(driver: Any, server: ServerProcess, key: str) -> None:
    """Open the app signed in as ``key``'s tenant (signing in if the session is gone)."""
    driver.get(f"{server.url}/ui/")
    wait_for(driver, lambda d: css_all(d, "body[data-ready]"), "the app to load")
    if css(driver, "#page-signin").is_displayed():
        css(driver, "#signin-key").send_keys(key)
        css(driver, "#signin-submit").click()
    wait_for(driver, lambda d: css(d, "#page-notebook").is_displayed(), "the notebook")


def png_pixels(data: bytes) -> tuple[int, float]:
    """(distinct colours, share of pixels that are not the background) of a PNG."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    total = image.width * image.height
    counts = image.getcolors(maxcolors=total) or []
    background = max(count for count, _ in counts)
    return len(counts), 1 - background / total
