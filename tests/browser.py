"""The real browser of the UI tests: Debian's headless chromium and its driver, through
selenium (nothing is downloaded: Selenium Manager stays offline)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def ensure_browser() -> None:
    """Debian's chromium and chromium-driver, installed with apt-get where missing."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("chromium and chromium-driver are missing and cannot be installed here")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
        done = subprocess.run(install, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            pytest.skip(f"apt-get install chromium chromium-driver failed: {done.stderr[-500:]}")


@contextlib.contextmanager
def headless_chromium(*, window: str, implicit_wait: float) -> Iterator[Any]:
    """A headless chromium session (``window``: ``"W,H"``), quit on exit."""
    ensure_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch a browser or driver
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={window}"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(implicit_wait)
    try:
        yield driver
    finally:
        driver.quit()
