"""A page on another origin streams a chat answer from `pymoe serve` in a real browser, as CORS allows (issue 51).

What this is: the demo model served (BackgroundServer, with a key) with `cors_origins` = one page origin; two tiny
http.server threads on other loopback ports serve the same HTML page, whose script POSTs /v1/chat/completions with
`fetch` (`stream: true`, the key in `Authorization`, JSON: so the browser sends a preflight first) and reads the SSE
stream into the page piece by piece. In headless Chromium (tests/browser.py):
  - from the allowed origin the page shows the whole answer, equal to the server's greedy answer to the same request
    without streaming, read in several pieces;
  - from the other origin the browser refuses: fetch fails, the console says it was CORS, and the server saw only
    the preflight (the access log has no POST from that page: the generation never ran).
What this is not: the header rules themselves (tests/test_server_middleware.py checks them without a browser).
"""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import pymoe
from browser import chromium, wait_for
from pymoe.demo import DEMO_MODEL
from pymoe.serve.app import BackgroundServer, create_app

KEY = "cors-key"
QUESTION = "Write a function that reads a file."
MAX_TOKENS = 24

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>another origin</title></head>
<body><pre id="answer" data-done="0" data-pieces="0"></pre><pre id="error"></pre>
<script>
async function ask(api, key, question, maxTokens) {
  const out = document.getElementById("answer");
  try {
    const r = await fetch(api + "/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key},
      body: JSON.stringify({messages: [{role: "user", content: question}], max_tokens: maxTokens,
                            temperature: 0, stream: true}),
    });
    out.dataset.status = r.status;
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\\n\\n")) >= 0) {          // one SSE event
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") { out.dataset.done = "1"; continue; }
        const piece = JSON.parse(data).choices[0].delta.content;
        if (piece) { out.textContent += piece; out.dataset.pieces = +out.dataset.pieces + 1; }
      }
    }
  } catch (e) {
    document.getElementById("error").textContent = e.name + ": " + e.message;
  }
}
</script></body></html>
"""


class PageServer:
    """PAGE served by http.server on its own loopback port, in a thread: an origin other than the API's."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = PAGE.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def browser():
    with chromium("the cross-origin page test") as driver:
        yield driver


@pytest.fixture(scope="module")
def pages_and_api():
    with PageServer() as allowed, PageServer() as other:
        lines = []
        app = create_app(pymoe.load(DEMO_MODEL, n_ctx=256), kv="f32", api_key=KEY, cors_origins=(allowed.origin,),
                         access_log=lines.append, log_format="json")
        with BackgroundServer(app) as api:
            api.lines = lines
            yield allowed, other, api


def ask(browser, page, api):
    browser.get(page.origin + "/")
    browser.execute_script("ask(arguments[0], arguments[1], arguments[2], arguments[3])", api.url, KEY, QUESTION,
                           MAX_TOKENS)


def logged(api, before: int, expected: int) -> list:
    """The access lines written since `before` lines: waits (10 s at most) for `expected` of them, since a line is
    written once its answer's last byte is sent, then half a second more for any line not expected."""
    deadline = time.monotonic() + 10
    while len(api.lines) < before + expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return [(r["method"], r["path"], r["status"]) for r in map(json.loads, api.lines[before:])]


def test_a_page_on_an_allowed_origin_reads_the_stream(browser, pages_and_api):  # browser first: none, no wait
    from selenium.webdriver.common.by import By

    allowed, _, api = pages_and_api
    n = len(api.lines)
    whole = httpx.post(api.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
                             "temperature": 0})
    assert whole.status_code == 200, whole.text
    want = whole.json()["choices"][0]["message"]["content"]
    assert want.strip(), "the greedy answer is empty: nothing to compare the page with"
    # this request's access line is written once its last byte is sent, which can be after httpx has returned
    assert logged(api, n, 1) == [("POST", "/v1/chat/completions", 200)]
    n += 1

    ask(browser, allowed, api)
    answer = browser.find_element(By.ID, "answer")
    wait_for("the end of the stream ([DONE])", lambda: answer.get_attribute("data-done") == "1"
             or browser.find_element(By.ID, "error").get_attribute("textContent"), timeout=120)
    assert browser.find_element(By.ID, "error").get_attribute("textContent") == ""
    assert answer.get_attribute("data-status") == "200"
    assert answer.get_attribute("textContent") == want  # the page read the whole answer, in order
    assert int(answer.get_attribute("data-pieces")) > 1  # ... as a stream, piece by piece
    assert logged(api, n, 2) == [("OPTIONS", "/v1/chat/completions", 204), ("POST", "/v1/chat/completions", 200)]


def test_a_page_on_another_origin_is_refused_by_the_browser(browser, pages_and_api):
    from selenium.webdriver.common.by import By

    _, other, api = pages_and_api
    n = len(api.lines)
    browser.get_log("browser")  # drop what earlier pages logged
    ask(browser, other, api)
    error = wait_for("fetch's error", lambda: browser.find_element(By.ID, "error").get_attribute("textContent"),
                     timeout=60)
    assert error.startswith("TypeError"), error  # fetch's network error: what a browser gives a refused page
    answer = browser.find_element(By.ID, "answer")
    assert answer.get_attribute("textContent") == "" and answer.get_attribute("data-status") is None
    console = " ".join(e["message"] for e in browser.get_log("browser"))
    assert "blocked by CORS policy" in console and other.origin in console, console
    assert logged(api, n, 1) == [("OPTIONS", "/v1/chat/completions", 204)]  # preflight only: no generation ran
