"""`pymoe serve`'s CORS and access log (pymoe/serve/middleware.py).

The middlewares alone, on a two-route Starlette app (httpx against it in process, no model): which Origin gets
Access-Control-Allow-Origin under `*`, `localhost`, a list and off; preflights answered 204 with the headers a
browser asked for, before any API key; the origin parsing of `--cors-origin`; one access line per request, 404s
included, in both formats. Then a live server on the tiny model (httpx over TCP): a streamed chat answer carries
the header, a preflight is not a 405 or a 401, and the access lines of a chat, a stream, a 401 and a 404 carry the
client address, status and token counts.
"""
import json
import re
import time

import httpx
import pytest

from pymoe.errors import PymoeError
from pymoe.serve.middleware import AccessLog, Cors, is_local_origin, parse_origins


def toy_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def hello(request):
        return JSONResponse({"hi": 1})

    async def stream(request):
        async def parts():
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        return StreamingResponse(parts(), media_type="text/event-stream")

    return Starlette(routes=[Route("/hello", hello), Route("/stream", stream, methods=["POST"])])


def call(app, method, path, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.request(method, path, headers=headers or {})

    import asyncio
    return asyncio.run(go())


PAGE = "https://ui.example"


@pytest.mark.parametrize("origins, origin, want", [
    (("*",), PAGE, "*"),
    (("*",), "http://localhost:3000", "*"),
    (("localhost",), "http://localhost:3000", "http://localhost:3000"),
    (("localhost",), "http://127.0.0.1:5173", "http://127.0.0.1:5173"),
    (("localhost",), "http://[::1]:8000", "http://[::1]:8000"),
    (("localhost",), PAGE, None),
    (("localhost",), "http://localhost.evil.example", None),  # a name that starts with localhost is not this machine
    ((PAGE,), PAGE, PAGE),
    ((PAGE,), "https://ui.example:444", None),
    ((), PAGE, None),  # off
])
def test_allow_origin_on_plain_and_streamed_answers(origins, origin, want):
    app = Cors(toy_app(), origins)
    for method, path in (("GET", "/hello"), ("POST", "/stream")):
        r = call(app, method, path, {"Origin": origin})
        assert r.status_code == 200
        assert r.headers.get("access-control-allow-origin") == want
        assert ("Origin" in r.headers.get("vary", "")) == (want not in (None, "*"))  # caches keep answers apart
    assert "access-control-allow-origin" not in call(app, "GET", "/hello").headers  # no Origin: not a CORS request


def test_a_preflight_is_answered_with_what_the_browser_asked():
    app = Cors(toy_app(), (PAGE,))
    asked = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
    r = call(app, "OPTIONS", "/stream", asked)  # the route takes POST only: without the middleware, a 405
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in r.headers["access-control-allow-methods"]
    denied = call(app, "OPTIONS", "/stream", {**asked, "Origin": "https://other.example"})
    assert denied.status_code == 204 and "access-control-allow-origin" not in denied.headers
    assert call(Cors(toy_app(), ()), "OPTIONS", "/stream", asked).status_code == 405  # off: as before
    assert call(app, "OPTIONS", "/stream").status_code == 405  # not a preflight (no Origin): the routes answer


def test_cors_origin_values():
    assert parse_origins(["*"]) == ("*",)
    assert parse_origins(["http://a.example, https://b.example:8443/", "localhost"]) == (
        "http://a.example", "https://b.example:8443", "localhost")
    assert parse_origins(["none"]) == () and parse_origins([]) == ()
    for bad in ("ui.example", "ftp://ui.example", "http://ui.example/path", "http://"):
        with pytest.raises(PymoeError, match="--cors-origin"):
            parse_origins([bad])
    assert is_local_origin("http://localhost") and is_local_origin("https://127.0.0.2:1")
    assert not is_local_origin("http://localhost:99999") and not is_local_origin("file://localhost")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_access_log_one_line_per_request_404_included(fmt):
    lines = []
    app = AccessLog(toy_app(), lines.append, fmt)
    assert call(app, "GET", "/hello").status_code == 200
    assert call(app, "GET", "/nowhere").status_code == 404
    assert call(app, "POST", "/hello").status_code == 405
    assert len(lines) == 3
    if fmt == "json":
        rows = [json.loads(line) for line in lines]
        assert [(r["method"], r["path"], r["status"]) for r in rows] == [
            ("GET", "/hello", 200), ("GET", "/nowhere", 404), ("POST", "/hello", 405)]
        assert all(r["ms"] >= 0 and r["prompt_tokens"] is None and r["client"] for r in rows)
    else:
        assert re.fullmatch(r"\S+Z \S+:\d+ GET /nowhere 404 \d+\.\dms", lines[1]), lines[1]
    with pytest.raises(PymoeError, match="log-format"):
        AccessLog(toy_app(), lines.append, "xml")


# --- a live server on the tiny model -------------------------------------------------------------------------------

KEY = "k"


@pytest.fixture(scope="module")
def live(tiny_model):
    import pymoe
    from pymoe.serve.app import BackgroundServer, create_app

    lines = []
    app = create_app(pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=128), kv="f32", api_key=KEY,
                     cors_origins=("localhost",), access_log=lines.append, log_format="json")
    with BackgroundServer(app) as srv:
        srv.lines = lines
        yield srv


def test_live_server_cors_and_access_log(live):
    page = "http://localhost:3000"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    auth = {"Authorization": f"Bearer {KEY}", "Origin": page}
    pre = httpx.options(live.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})  # no key: browsers send none here
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == page
    whole = httpx.post(live.url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert whole.status_code == 200 and whole.headers["access-control-allow-origin"] == page
    streamed = {**body, "stream": True, "messages": [{"role": "user", "content": "a longer question, streamed"}]}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=streamed, headers=auth, timeout=60) as r:
        assert r.headers["access-control-allow-origin"] == page
        assert r.read().decode().rstrip().endswith("data: [DONE]")
    denied = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"Origin": page}, timeout=10)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == page  # the page sees why
    assert httpx.get(live.url + "/no/such/route", headers={"Origin": page}, timeout=10).status_code == 404

    deadline = time.monotonic() + 10  # a line is written once its answer's last byte is sent: wait for the last
    while len(live.lines) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    rows = [json.loads(line) for line in live.lines]
    assert sorted((r["method"], r["path"], r["status"]) for r in rows) == [
        ("GET", "/no/such/route", 404), ("OPTIONS", "/v1/chat/completions", 204),
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 401)]
    usage = whole.json()["usage"]
    ran = {r["prompt_tokens"]: r["completion_tokens"] for r in rows if r["status"] == 200}
    assert len(ran) == 2 and ran[usage["prompt_tokens"]] == usage["completion_tokens"]  # two prompts, two lengths
    assert all(n >= 1 for n in ran.values())
    assert all(r["prompt_tokens"] is None and r["completion_tokens"] is None for r in rows if r["status"] != 200)
    assert all(r["client"].startswith("127.0.0.1:") for r in rows)
