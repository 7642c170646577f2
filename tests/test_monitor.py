"""The live monitor page (`pymoe serve` at /, pymoe/serve/monitor.html) and the /v1/status fields it reads.

What this is: the demo model served with an API key and a slot pool (so there is a hit rate to show), then
  - without a browser (fast): / answers its HTML without the key; /v1/status has each slot's state, each recent
    request's log line and end time, and with ?experts=1 the per-layer expert map (residency = the cache's own table,
    heat = decode lookups counted per expert, growing with a request);
  - in headless Chromium driven by selenium: the page asks for the key, polls once it has it, draws one heat-map row
    per MoE layer, its charts take samples and its numbers fill in after a completion sent with the openai client,
    the request's line shows up, and a chat round trip streams an answer into the chat box. A screenshot is saved
    (tmp_path and /tmp/pymoe-monitor.png) for a person to look at.
The browser is Debian's chromium + chromium-driver (tests/browser.py): without them the browser test skips here, and
FAILS in CI (CI=true): a missing browser must not turn into a green run.
"""
import re
import shutil
import time

import httpx
import numpy as np
import openai
import pytest

import pymoe
from browser import chromium, wait_for
from pymoe.demo import DEMO_MODEL
from pymoe.experts.cache import PassThroughCache
from pymoe.serve.metrics import expert_map
from pymoe.serve.app import BackgroundServer, create_app

KEY = "monitor-key"
SCREENSHOT = "/tmp/pymoe-monitor.png"


@pytest.fixture(scope="module")
def server():
    logs = []
    # 64 slots for the demo's 4 x 32 experts; pcie_frac 0.5: half the misses counted as spills (a GPU's split)
    engine = pymoe.load(DEMO_MODEL, n_ctx=256, cache_slots=64, pcie_frac=0.5)
    app = create_app(engine, parallel=2, max_queue=4, kv="f32", api_key=KEY, log=logs.append)
    with BackgroundServer(app) as srv:
        srv.logs, srv.engine = logs, engine
        yield srv


def status(srv, query=""):
    r = httpx.get(srv.url + "/v1/status" + query, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def complete(srv, prompt="def read_lines(path):", n=12):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    return client.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0)


# --- without a browser ------------------------------------------------------------------------------------------

def test_the_page_is_served_without_the_key(server):
    r = httpx.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>pymoe monitor</title>" in r.text and "/v1/status?experts=1" in r.text
    assert "http://" not in r.text and "https://" not in r.text  # nothing from a CDN: works offline
    head = httpx.head(server.url + "/", timeout=10)  # as link checkers and uptime probes ask
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(server.url + "/v1/status", timeout=10).status_code == 401  # the data stays behind the key


def test_status_has_slot_states_request_lines_and_the_expert_map(server):
    cfg, cache = server.engine.config, server.engine.cache
    s = status(server)
    assert "expert_map" not in s  # L x E numbers only when asked for
    assert [slot["state"] for slot in s["slots"]] == ["idle", "idle"] and s["queue_depth"] == 0
    before = status(server, "?experts=1")["expert_map"]
    r = complete(server)
    s = status(server, "?experts=1")
    m = s["expert_map"]
    assert m["layers"] == list(cfg.moe_layers) and m["n_expert"] == cfg.n_expert
    assert len(m["heat"]) == len(m["resident"]) == len(cfg.moe_layers)
    assert all(len(row) == cfg.n_expert for row in m["heat"] + m["resident"])
    # heat: each decode step looks up top-k experts in every MoE layer
    decoded = sum(map(sum, m["heat"])) - sum(map(sum, before["heat"]))
    assert decoded == (r.usage.completion_tokens - 1) * cfg.n_expert_used * len(cfg.moe_layers)
    assert m["resident"] == (cache.residency[list(cfg.moe_layers)] >= 0).astype(int).tolist()
    assert 0 < sum(map(sum, m["resident"])) <= cache.n_slots  # promoted by the request's misses
    last = s["recent"][-1]
    assert last["line"] in server.logs and last["line"].startswith(f"slot {last['slot']} ")
    assert abs(last["time"] - time.time()) < 60
    assert httpx.get(server.url + "/v1/status?experts=maybe", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).status_code == 400


def test_the_expert_map_without_a_slot_pool(server):
    """No pool (the CPU backend's default): nothing resident, the heat counted all the same."""
    cfg = server.engine.config
    cache = PassThroughCache(server.engine.file)
    cache.lookup(cfg.moe_layers[0], np.array([[0, 1], [1, 2]]), "decode")  # ids [T=2, K=2]
    cache.lookup(cfg.moe_layers[0], np.array([[3, 3]]), "prefill")         # prefill: not counted
    m = expert_map(cache, cfg)
    assert m["resident"] == [[0] * cfg.n_expert] * len(cfg.moe_layers)
    assert m["heat"][0][:4] == [1, 2, 1, 0] and sum(map(sum, m["heat"])) == 4


def test_a_busy_slot_shows_its_state(server):
    """A long generation, watched from /v1/status: its slot is seen decoding, then idle again."""
    seen = set()
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": "import os", "max_tokens": 48, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {(slot["state"], slot["generated"] > 0) for slot in status(server)["slots"]}
    assert ("decode", True) in seen
    assert [slot["state"] for slot in status(server)["slots"]] == ["idle", "idle"]


# --- in a browser -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    with chromium("the monitor page test") as driver:
        yield driver


def test_the_monitor_page_in_a_browser(browser, server, tmp_path):  # browser first: no browser, no wait
    from selenium.webdriver.common.by import By

    def text(element_id):
        return browser.find_element(By.ID, element_id).text

    def samples(chart="chart-toks"):
        return int(browser.find_element(By.ID, chart).get_attribute("data-samples"))

    browser.get(server.url + "/")
    assert browser.title == "pymoe monitor"
    for element_id in ("api-key", "chart-hit", "chart-spill", "chart-toks", "chart-queue", "chart-busy", "heatmap",
                       "recent", "chat-input", "chat-send"):
        browser.find_element(By.ID, element_id)

    # the server has a key: the page says so until it is given one, then polls (and keeps the key)
    wait_for("'API key needed'", lambda: text("conn") == "API key needed")
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "save-key").click()
    wait_for("a live connection", lambda: text("conn") == "live")
    assert browser.execute_script("return localStorage.getItem('pymoe.apiKey')") == KEY

    # the heat map: one row per MoE layer
    n_moe = len(server.engine.config.moe_layers)
    wait_for("the heat map's rows", lambda: browser.find_element(By.ID, "heatmap").get_attribute("data-rows")
             == str(n_moe))
    rows = browser.find_elements(By.CSS_SELECTOR, "#heatmap .heat-row")
    assert [r.get_attribute("data-layer") for r in rows] == [str(i) for i in server.engine.config.moe_layers]

    # a completion from outside the page: the charts take samples, the numbers and the request's line appear
    first = samples()
    complete(server, prompt="import os\n\n\ndef read_lines(path):\n    ", n=24)
    line = status(server)["recent"][-1]["line"]
    wait_for("a new chart sample", lambda: samples() > first and samples("chart-hit") > first)
    wait_for("a hit rate in %", lambda: re.fullmatch(r"\d+\.\d%", text("hit-rate")))
    wait_for("a spill share in %", lambda: re.fullmatch(r"\d+\.\d%", text("spill-share")))
    wait_for("tok/s above 0", lambda: re.fullmatch(r"\d+\.\d", text("tok-s")) and float(text("tok-s")) > 0)
    wait_for("the request's telemetry line", lambda: line in text("recent"))
    assert text("queue") == "0 / 4" and text("busy") in ("0 / 2", "1 / 2")
    assert browser.execute_script("return window.monitor.series.toks.some((v) => v > 0)")  # the chart's data

    # a chat round trip through the chat box, streamed from /v1/chat/completions
    n_lines = len(browser.find_elements(By.CSS_SELECTOR, "#recent li"))
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys("Write a function that reads a file.")
    browser.find_element(By.ID, "chat-send").click()
    answer = wait_for("the assistant's answer", lambda: browser.find_elements(
        By.CSS_SELECTOR, "#chat-log .msg.assistant[data-done='1']"), timeout=30)[0]
    assert "error" not in answer.get_attribute("class"), answer.text
    assert answer.text.startswith("assistant") and len(answer.text) > len("assistant") + 2, answer.text
    wait_for("the chat's request line", lambda: len(browser.find_elements(By.CSS_SELECTOR, "#recent li")) > n_lines)
    wait_for("the slots idle again", lambda: text("busy") == "0 / 2")
    path = tmp_path / "pymoe-monitor.png"
    browser.save_screenshot(str(path))
    shutil.copyfile(path, SCREENSHOT)
    print(f"monitor page screenshot: {path} (and {SCREENSHOT})")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
    assert not errors, errors  # no JavaScript errors (the network's: the 401s before the key was typed)
