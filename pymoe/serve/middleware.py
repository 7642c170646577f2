"""CORS and the access log of `pymoe serve`: two small ASGI middlewares around the FastAPI app (app.py).

    Cors(app, origins)          browsers' cross-origin rules: Access-Control-Allow-Origin on every answer (streamed
                                ones too) to an allowed Origin; a preflight (OPTIONS with Origin and
                                Access-Control-Request-Method) answered 204 here, before routing and the API key
    AccessLog(app, write, fmt)  one line per request, whatever its status (404s and 401s included): time, client
                                address, method, path, status, milliseconds, and the tokens where a job ran

Both are plain ASGI (they wrap `send`), not Starlette's BaseHTTPMiddleware, which would buffer the app in a task of
its own and change how a streaming client's disconnect reaches the handler.
What this is not: the routes (app.py), or any decision about a request's body.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Optional
from urllib.parse import urlsplit

LOCALHOST = "localhost"  # the --cors-origin value that allows any http(s) origin on this machine, any port
ANY = "*"
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer (Chromium caps it at 7200)
ALLOW_METHODS = "GET, HEAD, POST, OPTIONS"  # every method a route here takes
EXPOSE_HEADERS = "Retry-After"  # a 429's hint, not on the CORS safelist: a page's script may read it


def parse_origins(values) -> tuple:
    """--cors-origin values (repeated, or comma lists) -> the allowed origins; `none` (or nothing) -> () (off).
    An origin is `*`, `localhost`, or scheme://host[:port] as a browser sends it (a one-line PymoeError if not)."""
    from pymoe.errors import PymoeError

    out = []
    for value in values or ():
        for origin in (o.strip() for o in value.split(",")):
            if origin in ("", "none"):
                continue
            if origin not in (ANY, LOCALHOST):
                parts = urlsplit(origin)
                if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                        or parts.query or parts.fragment:
                    raise PymoeError(f"--cors-origin {origin!r}: give scheme://host[:port] (as a browser sends "
                                     "Origin), '*' or 'localhost'")
                origin = origin.rstrip("/")
            out.append(origin)
    return tuple(dict.fromkeys(out))


def is_local_origin(origin: str) -> bool:
    """http(s)://localhost, 127.x.x.x or [::1], any port: a page served from this machine."""
    try:
        parts = urlsplit(origin)
        host = parts.hostname or ""
        parts.port  # noqa: B018  (a bad port raises)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and (host in ("localhost", "::1") or host.startswith("127."))


def _header(scope, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class Cors:
    """Access-Control-Allow-Origin for the origins allowed: `*` answers `*`; `localhost` and listed origins answer
    the request's own Origin (with Vary: Origin). No credentials mode: an API key travels in a header, which needs
    none. A request from an origin not allowed is served as before, without the header (the browser then hides the
    answer from the page); a preflight from it gets a 204 without it."""

    def __init__(self, app, origins: tuple):
        self.app, self.origins = app, tuple(origins)

    def allow(self, origin: Optional[str]) -> Optional[str]:
        """The Access-Control-Allow-Origin value for this Origin, or None."""
        if not origin or not self.origins:
            return None
        if ANY in self.origins:
            return ANY
        if origin in self.origins or (LOCALHOST in self.origins and is_local_origin(origin)):
            return origin
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.origins:
            return await self.app(scope, receive, send)
        origin = _header(scope, b"origin")
        allowed = self.allow(origin)
        cors = [] if allowed is None else [(b"access-control-allow-origin", allowed.encode("latin-1"))]
        if allowed not in (None, ANY):
            cors.append((b"vary", b"Origin"))
        if scope["method"] == "OPTIONS" and origin and _header(scope, b"access-control-request-method"):
            asked = _header(scope, b"access-control-request-headers")
            if allowed is not None:  # the headers asked for (Authorization is never covered by a '*')
                cors += [(b"access-control-allow-methods", ALLOW_METHODS.encode()),
                         (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]
                if asked:
                    cors.append((b"access-control-allow-headers", asked.encode("latin-1")))
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            await send({"type": "http.response.body", "body": b""})
            return
        if allowed is not None:
            cors.append((b"access-control-expose-headers", EXPOSE_HEADERS.encode()))

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


# --- the access log ------------------------------------------------------------------------------------------------

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before any answer was sent
JOBS_KEY = "pymoe.jobs"  # app.py puts a request's jobs here (scope): the log line reads their token counts


class AccessLog:
    """One line per HTTP request, written when its answer is complete (a stream: at its end):

        text: 2026-12-06T01:02:03Z 127.0.0.1:50412 POST /v1/chat/completions 200 812.3ms prompt=12 completion=32
        json: {"time": "2026-12-06T01:02:03Z", "client": "127.0.0.1:50412", "method": "POST",
               "path": "/v1/chat/completions", "status": 200, "ms": 812.3, "prompt_tokens": 12,
               "completion_tokens": 32}

    ms: from the request's arrival to its last byte sent. The token counts are there when the request ran jobs on the
    engine (completions, chat, messages; n > 1: the prompt once, the choices' tokens together), else left out (text)
    or null (json). status: the one sent; 499 when the client left before any was, 500 when the app raised."""

    def __init__(self, app, write: Callable[[str], None], fmt: str = "text"):
        if fmt not in ("text", "json"):
            from pymoe.errors import PymoeError

            raise PymoeError(f"--log-format must be text or json, got {fmt!r}")
        self.app, self.write, self.fmt = app, write, fmt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [None]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            status[0] = 500 if status[0] is None else status[0]
            raise
        finally:
            self.write(self.line(scope, status[0] or CLIENT_CLOSED, (time.perf_counter() - t0) * 1e3))

    def line(self, scope, status: int, ms: float) -> str:
        client = scope.get("client")
        client = f"{client[0]}:{client[1]}" if client else "-"
        jobs = scope.get(JOBS_KEY) or []
        prompt = jobs[0].stats.n_prompt if jobs else None
        completion = sum(j.stats.n_generated for j in jobs) if jobs else None
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if self.fmt == "json":
            return json.dumps({"time": when, "client": client, "method": scope["method"], "path": scope["path"],
                               "status": status, "ms": round(ms, 1), "prompt_tokens": prompt,
                               "completion_tokens": completion}, ensure_ascii=False)
        tokens = f" prompt={prompt} completion={completion}" if jobs else ""
        path = scope["path"].encode("unicode_escape").decode("ascii")  # one line, whatever the path holds
        return f"{when} {client} {scope['method']} {path} {status} {ms:.1f}ms{tokens}"
