"""Test helper: headless Chromium from the Debian package (``chromium``), driven by Playwright for Python.

Playwright's own browser download is never used: the browser is the system binary. Where it (or Playwright) is
missing the tests skip, except under CI, where that is a failure: ``.ci/run`` installs both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tests.support.processes import missing, system_binary

if TYPE_CHECKING:
    from playwright.sync_api import Browser

WAIT_MS = 60_000  # the longest a page test waits for what it expects: a shared 2-core machine answers slowly

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


def chromium_binary() -> str:
    return system_binary("chromium", "chromium")


@contextmanager
def chromium() -> Iterator[Browser]:
    """A fresh headless Chromium (Playwright gives it a new, temporary user-data dir); closed at the end."""
    binary = chromium_binary()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright (pip install -e '.[dev]')")
        raise
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=binary, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
