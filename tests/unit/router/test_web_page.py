"""The web page (``GET /``) as a person uses it: headless Chromium against the router as deployed (the
``router`` fixture of test_openai_clients.py: gunicorn, with the stand-in routing of test_openai_compat.py),
the key typed once, questions in English and Chinese answered as they stream, a decline shown as one."""

from __future__ import annotations

import pytest
import requests
import test_openai_clients as clients
import test_openai_compat as compat
from cagflow.answering.prompt import declined_answer
from cagflow.devstack import webdriver

router = clients.router  # its module-scoped fixture: (base URL, user key)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def browser(router, tmp_path_factory):
    """One tab on the page with the user's key typed in, as a person keeps it open; each test starts there
    whichever tests ran before it."""
    if not webdriver.installed():
        pytest.skip(webdriver.MISSING)
    url, key = router
    browser = webdriver.Browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        browser.open(f"{url}/")
        browser.type("#key", key)
        yield browser
    finally:
        browser.close()


def ask(browser: webdriver.Browser, question: str) -> None:
    browser.clear("#question")
    browser.type("#question", question)
    browser.click("#send")


def test_the_page_runs_only_its_own_script_and_style(router):
    url, _ = router
    page = requests.get(f"{url}/", timeout=5)
    policy = page.headers["Content-Security-Policy"]
    assert page.status_code == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in policy and "style-src 'self'" in policy and "unsafe-inline" not in policy
    assert '<script src="static/page.js" defer></script>' in page.text and "<style" not in page.text
    for name, media_type in (("page.js", "text/javascript"), ("page.css", "text/css")):
        assert requests.get(f"{url}/static/{name}", timeout=5).headers["Content-Type"].startswith(media_type)


def test_an_answer_streams_with_its_sources_route_and_time_to_first_token(router, browser, tmp_path):
    url, key = router
    ask(browser, compat.QUESTION)
    page = browser.wait_for_text("Port 8443.", "Gateway manual — Ports", "gateway-manual", "Time to first token",
                                 "The web console listens on port 8443 (HTTPS).")  # the citation's quote
    assert "Route\ncache\nCache hit\nyes\nTime to first token\n5 ms" in page  # the record's, as facts
    assert browser.run("return [sessionStorage.getItem('cagflow.apiKey'), localStorage.length]") == [key, 0]
    assert browser.screenshot(tmp_path / "web-page.png").read_bytes().startswith(PNG)
    browser.open(f"{url}/")  # the key is typed once: the tab keeps it
    assert browser.run("return document.getElementById('key').value") == key


def test_a_chinese_question_is_answered_in_chinese(router, browser):
    url, key = router
    ask(browser, compat.CHINESE)
    browser.wait_for_text("网页控制台使用端口 8443。", "网关手册 — 端口", "gateway-manual-zh",
                          "网页控制台监听 8443 端口。")
    assert browser.run("return document.getElementById('answer').lang") == "zh"
    browser.click("#labels")
    browser.wait_for_text("问题", "提问")
    assert browser.run("return document.documentElement.lang") == "zh"


def test_a_decline_is_shown_as_a_decline(router, browser):
    ask(browser, compat.OFF_TOPIC)
    browser.wait_for_text("Declined (no_relevant_passage)", declined_answer(compat.OFF_TOPIC), "Closest sections")
    ask(browser, compat.INVENTED)  # streamed, then held unsupported: the streamed text gives way to the decline
    page = browser.wait_for_text("Declined (unsupported_figures)", declined_answer(compat.INVENTED))
    assert "9999 euros" not in page


def test_a_wrong_key_is_a_clear_error(router, browser):
    url, _ = router
    browser.run("sessionStorage.clear()")
    browser.open(f"{url}/")
    browser.type("#key", "cgf_000000000000_wrong")
    ask(browser, compat.QUESTION)
    browser.wait_for_text("Error:", "(invalid_api_key)")
