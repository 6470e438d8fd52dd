"""The web server of `ppoflow explore`: three files of its own (the page, its script, its style) and
a JSON API over tasks/observe/explorer_data.py, nothing else.

Who may ask: a request must come from a loopback address and name a loopback host (`Host:
127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`), unless the user chose a non-loopback `--host` and
said `--allow-remote`; a web page elsewhere that makes the browser ask for `evil.example` resolving
to 127.0.0.1 (DNS rebinding) gets a 403. Every API call carries the token printed with the URL (in
the URL's fragment, so it never travels in a request line, a log or a Referer), sent back by the page
in a header: another user of the machine, who can reach its loopback port, cannot read the run, and a
page elsewhere cannot make the browser send the header without the server's consent, which it never
gives (no CORS). No path in a request names a file: the three files are fixed names read from this
package, and the run's files are read by DuckDB, confined to the run.
"""

from __future__ import annotations

import ipaddress
import math
import secrets
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ppoflow.tasks.observe.explorer_data import ExplorerError, RunExplorer, SampleFilter

__all__ = ["TOKEN_HEADER", "explorer_app", "is_loopback_host"]

TOKEN_HEADER = "x-ppoflow-token"
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/explorer.js": ("explorer.js", "text/javascript; charset=utf-8"),
    "/explorer.css": ("explorer.css", "text/css; charset=utf-8"),
}
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
"""Even a value that slipped past the page's text-only rendering could run no script: only the
package's own script file may run, and nothing may be fetched from elsewhere."""
LOOPBACK_NAMES = ("localhost",)


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is loopback."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Guard:
    """Refuses (403) a request from a non-loopback peer or for a non-loopback Host, unless
    `allow_remote`; refuses (401) an API request without the token."""

    def __init__(self, app: ASGIApp, token: str, allow_remote: bool):
        self.app, self.token, self.allow_remote = app, token, allow_remote

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # (uvicorn is started without websockets: none arrives)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not self.allow_remote:
            peer = (scope.get("client") or ("", 0))[0]
            host = _host_name(headers.get("host", ""))
            if not is_loopback_host(peer) or not is_loopback_host(host):
                await _plain(403, "ppoflow explore answers loopback requests only")(scope, receive, send)
                return
        if scope["path"].startswith("/api/") and not secrets.compare_digest(
            headers.get(TOKEN_HEADER, "").encode(), self.token.encode()
        ):
            await _plain(401, "a request to the explorer needs the token of its URL")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port (an IPv6 address keeps its brackets off)."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _plain(status: int, text: str) -> Response:
    return Response(text, status_code=status, media_type="text/plain", headers=SECURITY_HEADERS)


def explorer_app(
    run_dir: str | Path, token: str, *, allow_remote: bool = False, note: Callable[[str], None] | None = None
) -> tuple[ASGIApp, RunExplorer]:
    """The explorer of `run_dir` as an ASGI app, and its reader (close it when the server stops);
    `note(line)` is told each step left out (a file that cannot be read)."""
    explorer = RunExplorer(run_dir) if note is None else RunExplorer(run_dir, note)

    def api(handler: Callable[[Request], object]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                body, status = _json_safe(handler(request)), 200
            except (ValueError, FileNotFoundError) as exc:  # ExplorerError, and DuckDB's explained
                body, status = {"error": str(exc)}, 400
            return JSONResponse(body, status_code=status, headers=SECURITY_HEADERS)

        return endpoint

    package = resources.files("ppoflow.explorer").joinpath("static")
    files = {path: (package.joinpath(name).read_bytes(), media) for path, (name, media) in STATIC.items()}

    def static(request: Request) -> Response:
        content, media_type = files[request.url.path]
        return Response(content, media_type=media_type, headers=SECURITY_HEADERS)

    routes = [Route(path, static) for path in STATIC]
    routes.append(Route("/favicon.ico", lambda r: Response(status_code=204, headers=SECURITY_HEADERS)))
    routes += [
        Route("/api/run", api(lambda r: explorer.overview())),
        Route("/api/metrics", api(lambda r: explorer.metric_series(_names(r, "names")))),
        Route("/api/samples", api(lambda r: explorer.samples(_sample_filter(r)))),
        Route(
            "/api/sample",
            api(
                lambda r: explorer.sample(
                    _text(r, "kind"), _integer(r, "iter"), _text(r, "prompt_id"), _integer(r, "sample_idx")
                )
            ),
        ),
        Route(
            "/api/across",
            api(
                lambda r: explorer.across_iterations(
                    _text(r, "kind"), _text(r, "prompt_id"), _integers(r, "iters")
                )
            ),
        ),
    ]
    app = Starlette(routes=routes)
    return _Guard(app, token, allow_remote), explorer


def _json_safe(value):
    """`value` with every NaN or infinity as null: JSON has neither (a run's tables may)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _text(request: Request, name: str, default: str | None = None) -> str:
    value = request.query_params.get(name, default)
    if value is None:
        raise ExplorerError(f"missing parameter {name}")
    if len(value) > 1_000:
        raise ExplorerError(f"parameter {name} is longer than 1,000 characters")
    return value


def _number(request: Request, name: str, whole: bool) -> int | float | None:
    """A number parameter, None when absent or empty; a whole one may be written `3` or `3.0`."""
    value = request.query_params.get(name, "")
    if value == "":
        return None
    what = "a whole number" if whole else "a number"
    try:
        number = float(value) if len(value) <= 40 else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or (whole and not number.is_integer()):
        raise ExplorerError(f"parameter {name} must be {what}, not {value[:40]!r}")
    return int(number) if whole else number


def _integer(request: Request, name: str, default: int | None = None) -> int:
    value = _number(request, name, whole=True)
    if value is None:
        if default is None:
            raise ExplorerError(f"missing parameter {name}")
        return default
    return value


def _names(request: Request, name: str) -> list[str]:
    """A list parameter: its values, repeated (`?names=a&names=b`)."""
    values = request.query_params.getlist(name)
    if len(values) > 64:
        raise ExplorerError(f"at most 64 values of {name}")
    return [v for v in values if v]


def _integers(request: Request, name: str) -> list[int]:
    values = _names(request, name)
    if not all(v.isascii() and v.isdigit() and len(v) <= 12 for v in values):  # (not "²": a digit to str)
        raise ExplorerError(f"every {name} must be a whole number of at most 12 digits")
    return [int(v) for v in values]


def _choice(request: Request, name: str, choices: tuple[str, ...]) -> str:
    value = request.query_params.get(name, choices[0])
    if value not in choices:
        raise ExplorerError(f"{name} must be one of {', '.join(choices)}, not {value[:40]!r}")
    return value


def _sample_filter(request: Request) -> SampleFilter:
    truncated = _choice(request, "truncated", ("any", "yes", "no"))
    return SampleFilter(
        kind=_text(request, "kind", "train"),
        iteration=_integer(request, "iter"),
        data_source=_text(request, "source", "") or None,
        min_score=_number(request, "min_score", whole=False),
        max_score=_number(request, "max_score", whole=False),
        min_length=_number(request, "min_length", whole=True),
        max_length=_number(request, "max_length", whole=True),
        truncated=None if truncated == "any" else truncated == "yes",
        sort=_text(request, "sort", "score"),
        descending=_choice(request, "order", ("asc", "desc")) == "desc",
        page=_integer(request, "page", 0),
        page_rows=_integer(request, "page_rows", 50),
    )
