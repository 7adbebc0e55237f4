"""HTTP error shapes: every failure a client sees is an OpenAI-style JSON body.

The middleware turns any exception escaping a handler into such a body, so a
client never sees a traceback; the traceback goes to the log instead.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger("mooncaked.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
          502: "bad_gateway", 503: "service_unavailable", 504: "timeout_error"}


class StartupError(Exception):
    """A start-up failure to report as one line (e.g. conductor unreachable)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"),
                      "param": param, "code": code}, "object": "error"}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type="application/json")


def error_response(status: int, message: str, **kw: Any) -> web.Response:
    headers = kw.pop("headers", None)
    return json_response(error_body(status, message, **kw), status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                              headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, headers=None)
    except Exception:  # noqa: BLE001 - the one place that turns bugs into 500s
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal error (see the node's log)")


def require_bearer(request: web.Request, token: str, what: str) -> None:
    """Raise 403 if ``token`` is unset (endpoint disabled), 401 if it does not match."""
    if not token:
        raise ApiError(403, f"{what} is disabled: set a token in the config to enable it")
    if request.headers.get("Authorization", "") != f"Bearer {token}":
        raise ApiError(401, f"{what} needs 'Authorization: Bearer <token>'")


async def read_json(request: web.Request, max_bytes: int) -> Any:
    """Parse a JSON body with a size cap; 413 above it, 400 when malformed."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"request body of {request.content_length} bytes exceeds the "
                            f"limit of {max_bytes}")
    # StreamReader.read(n) returns what has arrived, up to n bytes, not n
    # bytes: a body that comes in several pieces (a large or chunked one, a
    # lossy link) must be read until its end, else it is parsed truncated.
    parts: list[bytes] = []
    size = 0
    while part := await request.content.read(max_bytes + 1 - size):
        parts.append(part)
        size += len(part)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes")
    try:
        return orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None


def internal_auth_middleware(token: str):
    """Guard every ``/internal/`` route of a node (node <-> node and node <->
    conductor calls); admin and API routes are not affected.  With a cluster
    token, a call must carry it; without one, only loopback peers are served
    (a single-machine cluster), so a node reachable from the network is never
    open by default."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/internal/"):
            if token:
                require_bearer(request, token, "internal cluster endpoint")
            elif not _is_loopback(request.remote):
                raise ApiError(403, "internal cluster endpoint: set node.cluster_token on every "
                                    "node to accept calls from other hosts (without it only "
                                    "loopback peers are served)")
        return await handler(request)

    return check


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False  # a Unix socket or an unknown peer: not provably local
    try:
        address = ipaddress.ip_address(remote.split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 on a dual-stack socket
    return address.is_loopback
