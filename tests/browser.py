"""Headless Chromium through selenium, for the tests that drive a page (test_monitor.py, test_cors_browser.py).

The browser is Debian's chromium + chromium-driver (.ci/run installs them). Without them a browser test skips here,
and FAILS in CI (CI=true, oracle.strict()): a missing browser must not turn into a green run.
"""
import os
import shutil
import time
from contextlib import contextmanager

import pytest

from oracle import strict

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def need_browser(what: str, why: str):
    why = f"no headless browser for {what}: {why} (apt-get install chromium chromium-driver)"
    if strict():
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@contextmanager
def chromium(what: str):
    """A selenium Chrome driver on headless Chromium; `what` names the test in the skip (or CI failure) reason."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        need_browser(what, f"selenium is not importable ({e}; pip install -e '.[test]')")
    binary = next((shutil.which(b) for b in CHROMIUM if shutil.which(b)), None)
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if binary is None or not os.path.exists(driver_path):
        need_browser(what, "chromium or chromedriver not found")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--force-device-scale-factor=1"):
        options.add_argument(arg)  # --no-sandbox: CI runs as root, where Chromium's sandbox will not start
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, predicate, timeout: float = 20.0):
    """Poll predicate() until it is truthy -> its value; fail naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"the page did not show {what} within {timeout:g} s")
        time.sleep(0.1)
