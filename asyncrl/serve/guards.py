"""What every Serve application of asyncrl shares: its config from the builder's args, and the
guards in front of the routes that need a token (checked from the headers, before a body is read)."""

import hmac
import ipaddress
import shlex
from typing import Any

import msgspec
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from asyncrl.config import Config, compose

# The admin token of this process's train controller (set in its __init__; one per process), and
# the reward endpoint's token (set in RewardService.__init__). Set through this module, never a
# copy: Serve pickles deployment classes by value, so a global bound in their module would be one.
ADMIN_TOKEN = {"value": ""}
REWARD_TOKEN = {"value": ""}
BODY_LIMIT = {"value": 0}  # the policy endpoint's body limit in bytes (set in PolicyServer.__init__)
API_KEY = {"value": ""}  # the policy endpoint's bearer key (set in PolicyServer.__init__; "" = open)
REWARD_LOCAL_WITHOUT_TOKEN = {"value": False}  # serve.reward_local_without_token (opt-in)
MAX_ADMIN_BODY_BYTES = 1 << 20
MAX_SCORE_BODY_BYTES = 16 << 20


class FiniteJSONResponse(JSONResponse):
    """JSON with every NaN or infinity as null: JSON has neither, and Starlette's own response
    refuses them with a 500 (a run whose loss diverged records a NaN loss)."""

    @staticmethod
    def encode(content: Any) -> bytes:
        return msgspec.json.encode(content, enc_hook=_plain)

    def render(self, content: Any) -> bytes:
        return self.encode(content)


def _plain(value: Any) -> Any:
    """What msgspec cannot encode itself: numpy scalars as numbers, anything else as its text."""
    return value.item() if hasattr(value, "item") and hasattr(value, "dtype") else str(value)


def config_from_args(args: dict[str, Any]) -> Config:
    """Builder args (strings from `serve run` or the config file) -> a validated Config. `overrides` is
    a list, or one string split as a shell would (quote a value with spaces: 'k={a: 1}')."""
    overrides = args.get("overrides", "")
    overrides = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    overrides += [f"{k}={v}" for k, v in args.items() if k != "overrides"]
    return compose(overrides, until_stopped=True)


def _route_path(request: Request) -> str:
    return _scope_path(request.scope)


def _scope_path(scope) -> str:
    """The path inside the application (Serve mounts it under its route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _bearer_matches(request: Request, token: str) -> bool:
    return _bearer_is(request.headers.get("authorization", ""), token)


def _bearer_is(authorization: str, token: str) -> bool:
    """Whether an Authorization header carries `token` as its bearer token (in constant time)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def _from_loopback(request: Request) -> bool:
    try:
        return ipaddress.ip_address(request.client.host if request.client else "").is_loopback
    except ValueError:
        return False


def _too_large(request: Request, limit: int) -> bool:
    try:
        return int(request.headers.get("content-length", "0")) > limit
    except ValueError:
        return True


async def capped_body(request: Request, call_next, limit: int):
    """Read the body as it streams, refused (413) the moment it passes `limit` bytes: a chunked
    request has no Content-Length to check first, and the route would read it whole. The body
    read is handed on as the request's cached body (Starlette replays it to the route)."""
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            return _refuse(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    request._body = b"".join(chunks)
    return await call_next(request)


def _refuse(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


async def admin_guard(request: Request, call_next):
    """Middleware of the train app: /admin routes check the token from the headers alone, before
    the body is read (an unauthenticated caller makes the server parse nothing). Constant time."""
    if _route_path(request).startswith("/admin"):
        token = ADMIN_TOKEN["value"]
        if not token:
            return _refuse(403, "admin routes are disabled: set serve.admin_token or ASYNCRL_ADMIN_TOKEN")
        if not _bearer_matches(request, token):
            return _refuse(401, "missing or wrong admin token")
        if _too_large(request, MAX_ADMIN_BODY_BYTES):
            return _refuse(413, f"admin request body over {MAX_ADMIN_BODY_BYTES} bytes")
        return await capped_body(request, call_next, MAX_ADMIN_BODY_BYTES)
    return await call_next(request)


async def reward_guard(request: Request, call_next):
    """Middleware of a reward app: POST /score runs untrusted code and models for its caller, so
    every call carries the token (serve.reward_token / ASYNCRL_REWARD_TOKEN). With none set the
    route is off, unless `serve.reward_local_without_token` opts in to serving loopback callers:
    behind a same-host proxy or a mesh sidecar every caller is loopback. Checked from the headers,
    before the body is read; the body's size is capped as it streams (`capped_body`)."""
    if request.method == "POST":
        token = REWARD_TOKEN["value"]
        if token and not _bearer_matches(request, token):
            return _refuse(401, "missing or wrong reward token")
        if not token and not (REWARD_LOCAL_WITHOUT_TOKEN["value"] and _from_loopback(request)):
            return _refuse(403, "the reward endpoint runs submitted code: it needs a token (set serve.reward_token "
                                "or ASYNCRL_REWARD_TOKEN and send it as a bearer token); on a development machine, "
                                "serve.reward_local_without_token=true serves callers on this machine without one")
        if _too_large(request, MAX_SCORE_BODY_BYTES):
            return _refuse(413, f"score request body over {MAX_SCORE_BODY_BYTES} bytes")
        return await capped_body(request, call_next, MAX_SCORE_BODY_BYTES)
    return await call_next(request)



class BearerKey:
    """ASGI middleware of the policy endpoint: with `API_KEY["value"]` set, every route but the open
    ones (/health: liveness probes carry no key) wants `Authorization: Bearer <key>`, as vLLM's
    `--api-key` does, compared in constant time from the headers alone, before a body is read.
    `refuse()` is the 401 response. (Websocket scopes pass: the endpoint has no websocket route.)"""

    def __init__(self, app, refuse, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.refuse, self.open_paths = app, refuse, open_paths

    async def __call__(self, scope, receive, send):
        key = API_KEY["value"]
        if scope["type"] == "http" and key and _scope_path(scope) not in self.open_paths:
            authorization = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not _bearer_is(authorization, key):
                return await self.refuse()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """A request body over the limit, raised as it is read: FastAPI passes an HTTPException raised
    while it reads a body through (any other error there becomes a 400), so the app's handler for
    this class answers 413 and nothing parses the body."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes")
        self.limit = limit


class BodyLimit:
    """ASGI middleware: a request body over `BODY_LIMIT["value"]` bytes is refused with 413 before it
    is parsed: at once when its declared length is over (the body is never read), else (a chunked
    body) as soon as the bytes read pass the limit. `refuse(exc)` is the 413 response. The limit is
    read per request from this module (see ADMIN_TOKEN on why not a copy)."""

    def __init__(self, app, refuse):
        self.app, self.refuse = app, refuse

    async def __call__(self, scope, receive, send):
        limit = BODY_LIMIT["value"]
        if scope["type"] != "http" or not limit:
            return await self.app(scope, receive, send)
        try:
            declared = int(dict(scope.get("headers") or []).get(b"content-length", b"0"))
        except ValueError:
            declared = limit + 1
        if declared > limit:
            return await self.refuse(BodyTooLarge(limit))(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)
