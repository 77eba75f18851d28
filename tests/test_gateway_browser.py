"""The gateway's web page in a real headless browser (Debian chromium + chromedriver, selenium)
against a real swarm and gateway process."""

from __future__ import annotations

import re

import pytest

from tests.test_gateway import start_swarm

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = start_swarm(smollm2_path, tmp_path_factory.mktemp("browser-swarm"))
    yield s
    s.stop()


def test_page_submits_a_prompt_and_shows_streamed_text_and_a_finished_state(swarm, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(swarm.gateway_url + "/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.05)
    text = lambda el_id: browser.find_element(By.ID, el_id).text  # noqa: E731

    # the swarm's coverage, from the tracker, over the WebSocket
    wait.until(lambda d: "worker-1" in text("coverage"))
    coverage = text("coverage")
    assert "smollm2-135m (llama-cpp, 30 layers): 30 " in coverage  # every layer has a replica (one each here)
    (a, b), (c, d) = (w.layers for w in swarm.workers)  # the work-balanced split: 0–18 | 19–29
    assert f"worker-0 smollm2-135m {a}–{b - 1} yes" in coverage and f"worker-1 smollm2-135m {c}–{d - 1} yes" in coverage
    assert re.search(r"map built \d+\.\d s ago", coverage), coverage  # how old the tracker's map is
    assert coverage.count(" ready ") == 2 and "not routed" not in coverage, coverage  # both of the tracker's protocol

    box = browser.find_element(By.ID, "prompt")
    box.send_keys("Write a short poem about the sea.")
    tokens = browser.find_element(By.ID, "max_tokens")
    tokens.clear()
    tokens.send_keys("40")
    browser.find_element(By.ID, "send").click()

    # streamed text appears while the generation runs, then the finished state
    wait.until(
        lambda d: (
            text("output").strip() and browser.find_element(By.ID, "status").get_attribute("data-state") == "running"
        )
    )
    partial = text("output")
    wait.until(lambda d: browser.find_element(By.ID, "status").get_attribute("data-state") != "running")
    assert browser.find_element(By.ID, "status").get_attribute("data-state") == "done", text("error")
    assert text("phase") == "done"
    assert text("status").startswith("finished:")
    final = text("output")
    assert final.startswith(partial.rstrip()) and len(final) >= len(partial)
    assert text("nodes") == "worker-0 → worker-1"
    assert text("tps") not in ("", "–")
    assert int(text("generated")) >= 1
    assert text("error") == ""
