"""Headless Chromium for the tests that look at a web page (Airflow's UI, the router's page): Debian's
chromium and chromium-driver, driven through the W3C WebDriver protocol with plain HTTP and JSON, so no
browser-automation package is needed."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from .process import free_port

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's chromium, chromium-driver
MISSING = "headless Chromium is missing: apt-get install chromium chromium-driver (make test does)"


def installed() -> bool:
    return Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()


class Browser:
    """Headless Chromium driven through ChromeDriver's W3C WebDriver protocol (plain HTTP + JSON)."""

    ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

    def __init__(self, profile: Path):
        self.port = free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                self._call("GET", "/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        # Without the background-networking flags Chromium keeps dialling Google's hosts on a closed network.
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1400,1000"]
        options = {"binary": CHROMIUM, "args": args}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def _session(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def open(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def element(self, css: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while not (found := self._session("POST", "/elements", {"using": "css selector", "value": css})):
            assert time.monotonic() < deadline, f"no {css!r} on {self._session('GET', '/url')}"
            time.sleep(0.25)
        return found[0][self.ELEMENT]

    def type(self, css: str, text: str) -> None:
        self._session("POST", f"/element/{self.element(css)}/value", {"text": text})

    def clear(self, css: str) -> None:
        self._session("POST", f"/element/{self.element(css)}/clear", {})

    def click(self, css: str) -> None:
        self._session("POST", f"/element/{self.element(css)}/click", {})

    def run(self, script: str):
        """What ``script`` (a function body) returns in the page."""
        return self._session("POST", "/execute/sync", {"script": script, "args": []})

    def wait_for_text(self, *texts: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            page = self.run("return document.body.innerText")
            if all(text in page for text in texts):
                return page
            assert time.monotonic() < deadline, f"{texts} not on {self._session('GET', '/url')}: {page[:300]}"
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self._session("GET", "/screenshot")))
        return path

    def close(self) -> None:
        try:
            self._session("DELETE", "")
        finally:
            self.driver.terminate()
            self.driver.wait(timeout=30)
