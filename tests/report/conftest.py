"""The report tests' shared fixture: one headless Debian Chromium per module, driven by Playwright."""

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM, "chromium must be installed in CI (.ci/run installs Debian's chromium)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
