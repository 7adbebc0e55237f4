"""The one way nodes call each other, and the server side of the same messages.

``InternalClient`` sends a message (``mooncaked.node.messages``) as JSON,
carries the cluster token, applies the timeout policy below and maps every
failure to ``InternalCallError``: the node was unreachable, the call timed
out, the node answered with an error status (``status`` set, with the node's
own error message), or its answer did not decode.  Callers decide what that
means for them (retry, ignore, or ``to_api_error()`` for a caller of ours).

Timeout policy: every call gives up connecting after ``CONNECT_TIMEOUT_S``;
``timeout`` bounds the whole call (None: as long as the callee takes: the
long calls, prefill and CPP start, are bounded by the callee's own deadlines).

On the receiving side, ``read_message`` decodes a request body and answers a
malformed one with 400 naming the field; ``reply`` sends a message back.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable, TypeVar

import aiohttp
import orjson
from aiohttp import web

from mooncaked.node.errors import ApiError, json_response, read_json
from mooncaked.node.messages import Message, MessageError

M = TypeVar("M", bound=Message)
T = TypeVar("T")

CONNECT_TIMEOUT_S = 5.0      # every call: establishing the connection
CONTROL_TIMEOUT_S = 5.0      # small control messages: touch, heartbeats, cache events,
                             # segment lookups, CPP abort (the default)
CANCEL_TIMEOUT_S = 3.0       # best-effort cancels on the way out of a request
RESERVE_TIMEOUT_S = 10.0     # decode page reservation
CPP_PREPARE_TIMEOUT_S = 30.0
PREFETCH_TIMEOUT_S = 60.0    # operator-driven prefix replication
STREAM_READ_TIMEOUT_S = 60.0  # the decode stream may stay silent this long between lines
UNBOUNDED = None             # prefill, CPP start, block leases inside a bounded fetch

_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class InternalCallError(Exception):
    """A node-to-node call that failed.  ``status`` is the HTTP status when the
    node answered with an error, None when it could not be reached, timed out
    or answered something that does not decode; ``detail`` says what went wrong
    (for an error status: the node's own message)."""

    def __init__(self, target: str, what: str, detail: str, status: int | None = None,
                 refused: bool = False, lost: bool = False) -> None:
        self.target = target
        self.what = what
        self.detail = detail
        self.status = status
        # The connection itself could not be made (refused, no route): the
        # node is down, not merely slow, and nothing of the call reached it.
        self.refused = refused
        # The connection broke (reset, closed) before any answer came back:
        # typically a kept-alive connection to a node that was just killed.
        # The node may have received and started the call.
        self.lost = lost
        where = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{what} failed{where}: {detail}")

    def to_api_error(self) -> ApiError:
        """What a caller of ours sees: 503 when the node was busy, else 502."""
        return ApiError(503 if self.status in (503, 429) else 502, str(self))


def _remote_message(body: bytes) -> str:
    """The error message of a node's (OpenAI-style) error body, else the body."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace")[:500]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", data))
    return str(data)


class InternalClient:
    """Calls to other nodes, over one aiohttp session (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, token: str = "") -> None:
        # ``token``: the cluster token, for a session that does not carry it already.
        self.session = session
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._owned = False

    @classmethod
    def open(cls, token: str = "", *, connections: int = 100) -> InternalClient:
        """A client with its own session (``connections``: 0 for no limit); ``close()`` it."""
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=connections))
        client = cls(session, token)
        client._owned = True
        return client

    async def close(self) -> None:
        if self._owned:
            await self.session.close()

    @contextlib.asynccontextmanager
    async def _exchange(self, method: str, url: str, message: Message | None, what: str,
                        timeout: aiohttp.ClientTimeout,
                        check_status: bool = True) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request; every failure leaves as InternalCallError."""
        data = orjson.dumps(message.to_wire()) if message is not None else None
        answered = False
        try:
            async with self.session.request(method, url, data=data, headers=self.headers,
                                            timeout=timeout) as resp:
                answered = True
                if check_status and not 200 <= resp.status < 300:
                    raise InternalCallError(url, what, _remote_message(await resp.read()),
                                            resp.status)
                yield resp
        except _TRANSPORT_ERRORS as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            lost = not refused and not answered and isinstance(
                exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            raise InternalCallError(url, what, f"{type(exc).__name__}: {exc}",
                                    refused=refused, lost=lost) from None

    def _decode(self, url: str, what: str, decode: Callable[[Any], T], body: bytes) -> T:
        try:
            return decode(orjson.loads(body))
        except ValueError as exc:  # not JSON, or a MessageError (a descriptor's ValueError)
            raise InternalCallError(url, what, f"malformed answer: {exc}") from None

    async def call(self, url: str, message: Message | None, decode: Callable[[Any], T], *,
                   what: str, timeout: float | None = CONTROL_TIMEOUT_S, method: str = "POST") -> T:
        """Send ``message`` (None: no body) and ``decode`` the answer (a ``from_wire``)."""
        async with self._exchange(method, url, message, what, _timeout(timeout)) as resp:
            body = await resp.read()
        return self._decode(url, what, decode, body)

    async def send(self, url: str, message: Message, *, what: str,
                   timeout: float | None = CONTROL_TIMEOUT_S, check_status: bool = True) -> None:
        """Send ``message``; the answer's body is not needed.  ``check_status=False``:
        an error status is no failure either (only an unreachable node is)."""
        async with self._exchange("POST", url, message, what, _timeout(timeout),
                                  check_status) as resp:
            await resp.read()

    async def stream(self, url: str, message: Message, decode_line: Callable[[Any], T], *,
                     what: str, read_timeout: float = STREAM_READ_TIMEOUT_S) -> AsyncIterator[T]:
        """Send ``message`` and yield each decoded line of the NDJSON answer."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=read_timeout)
        async with self._exchange("POST", url, message, what, timeout) as resp:
            async for line in resp.content:
                if line.strip():
                    yield self._decode(url, what, decode_line, line)


def _timeout(total: float | None) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_connect=CONNECT_TIMEOUT_S)


# -- the receiving side ------------------------------------------------------------

def bad_message(exc: MessageError) -> ApiError:
    """A malformed internal request: 400, naming the field."""
    return ApiError(400, str(exc), param=exc.field)


async def read_message(request: web.Request, cls: type[M], max_bytes: int,
                       where: str | None = None, **context: Any) -> M:
    """The request's body decoded as ``cls`` (``context``: extra checks its
    ``from_wire`` takes, e.g. ``block_size``); 400 naming the field if it is malformed."""
    body = await read_json(request, max_bytes)
    try:
        return cls.from_wire(body, where, **context)
    except MessageError as exc:
        raise bad_message(exc) from None


def reply(message: Message) -> web.Response:
    return json_response(message.to_wire())
