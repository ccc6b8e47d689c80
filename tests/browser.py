"""Test helper: headless Chromium from the Debian package (``chromium``), driven by Playwright for Python.

Playwright's own browser download is never used: the browser is the system binary. Where it (or Playwright) is
missing the tests skip, except under CI, where that is a failure: ``.ci/run`` installs both.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser

ARGS = [
    "--headless",
    "--no-sandbox",  # the suite may run as root in a container, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed; .ci/run installs it")
    pytest.skip(f"{what} is not installed; CI runs these tests")


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    _missing("chromium (apt-get install chromium)")
    raise AssertionError("unreachable")


@contextmanager
def chromium() -> Iterator[Browser]:
    """A fresh headless Chromium (Playwright gives it a new, temporary user-data dir); closed at the end."""
    binary = chromium_binary()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install -e '.[dev]')")
        raise
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=binary, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
