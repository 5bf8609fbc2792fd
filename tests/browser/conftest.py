"""The browser tier: headless Chromium (Debian's `chromium` and `chromium-driver`) driven by
Selenium, against a real daemon, real jobs and a real `ddpctl web`.

Skipped, with the reason, where Selenium, chromium or chromedriver is missing, except where
DDPD_TEST_BROWSER=required (as `make test` and `make browser-test` run it, after installing them):
there a missing browser fails each test. The browser runs as root with the flags that needs, a new empty profile in the
test's temporary directory, and no network beyond 127.0.0.1; after each test, chromedriver and every
browser process of that profile are proven gone. Selenium is blocking: its calls run in a worker
thread so the daemon's log pump keeps running on the event loop.
"""

from __future__ import annotations

import os
import select
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from ..conftest import assert_gone, describe

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000")
WAIT = 60.0  # seconds any one thing may take to appear on a page
REQUIRED = os.environ.get("DDPD_TEST_BROWSER") == "required"
GONE_WAIT = 15.0  # seconds the browser may take to exit after quit


def missing() -> str | None:
    """Why the browser tier cannot run here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (make browser-test installs it)"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} not found (apt-get install {package}, or make browser-test)"
    return None


def profile_processes(profile: Path) -> list[int]:
    """Processes whose command line names this browser profile."""
    found = []
    needle = str(profile).encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if needle in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                continue
    return found


class Browser:
    """One headless Chromium; every method runs its Selenium calls off the event loop."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(call, *args)

    async def get(self, url: str) -> None:
        await self.run(self.driver.get, url)

    async def js(self, script: str, *args: Any) -> Any:
        return await self.run(self.driver.execute_script, script, *args)

    async def until(self, script: str, *args: Any, timeout: float = WAIT) -> Any:
        """Wait (bounded) until the JavaScript expression `script` returns something truthy; that value."""
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        def wait() -> Any:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(
                lambda d: d.execute_script(f"return ({script});", *args))

        try:
            return await self.run(wait)
        except TimeoutException:
            body = await self.js("return document.body ? document.body.innerText.slice(0, 2000) : ''")
            raise AssertionError(f"not seen within {timeout}s: {script}\npage: {body}") from None

    async def click(self, css: str) -> None:
        from selenium.webdriver.common.by import By

        await self.run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).click())

    async def accept_confirm(self, timeout: float = WAIT) -> str:
        from selenium.webdriver.support import expected_conditions
        from selenium.webdriver.support.ui import WebDriverWait

        def accept() -> str:
            alert = WebDriverWait(self.driver, timeout).until(expected_conditions.alert_is_present())
            text = str(alert.text)
            alert.accept()
            return text

        return str(await self.run(accept))

    async def screenshot(self, path: Path) -> None:
        assert await self.run(self.driver.save_screenshot, str(path)), f"no screenshot at {path}"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    reason = missing()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"DDPD_TEST_BROWSER=required: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        assert profile_processes(profile), "the browser's processes cannot be found by their profile"
        yield Browser(driver)
    finally:
        driver.quit()
        _assert_browser_gone(service, profile)


def _assert_browser_gone(service: Any, profile: Path) -> None:
    """chromedriver and each process of the profile exited: a bounded wait on their pidfds (quit returns
    before the browser's helpers are gone, and they are no children of ours)."""
    if service.process is not None:
        service.process.wait(timeout=GONE_WAIT)
        assert_gone(service.process.pid)
    fds: dict[int, int] = {}
    for pid in profile_processes(profile):
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        deadline = time.monotonic() + GONE_WAIT
        waiting = set(fds)
        while waiting and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(waiting), [], [], left)
            waiting -= set(ready)
        assert not waiting, "browser processes left: " + "; ".join(f"{fds[fd]}: {describe(fds[fd])}" for fd in waiting)
    finally:
        for fd in fds:
            os.close(fd)
