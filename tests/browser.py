"""Headless Chromium for the dashboard's tests: Debian's ``chromium`` driven through Debian's
``chromedriver`` with Selenium, whose own driver download (Selenium Manager) is never used: the
driver's path is given, and ``SE_OFFLINE`` forbids it any download."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: How the machine's notes run Chromium as root with no network: no sandbox, no GPU, and none of
#: its own connections to Google's services.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
    "--hide-scrollbars",
)


def missing_browser() -> str | None:
    """Why the browser can't run here (None: it can)."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} not found: install Debian's {package} package (.ci/run does)"
    return None


@contextmanager
def chromium(env: dict[str, str] | None = None) -> Iterator[Any]:
    """A Selenium WebDriver of a fresh headless Chromium (an empty profile), quit at the end."""
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lockstep-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, env=env)
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
