"""``read_json`` (mooncaked/node/errors.py) on bodies that arrive in pieces.

A real aiohttp server on loopback and a raw socket client that sends the
headers and the first half of a body, waits until the server has taken in
that half, then sends the rest: the body must be parsed whole, not as the
part that had arrived (which parsed as malformed JSON, or a truncated
internal message on a lossy link)."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from mooncaked.node.errors import ApiError, read_json

LIMIT = 1 << 20


async def _server(received: asyncio.Event) -> TestServer:
    async def echo(request: web.Request) -> web.Response:
        received.set()      # the handler runs once the headers are in
        try:
            body = await read_json(request, LIMIT)
        except ApiError as exc:
            return web.json_response({"status": exc.status}, status=exc.status)
        return web.json_response({"items": len(body["items"])})

    app = web.Application()
    app.router.add_post("/echo", echo)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _post_in_two_pieces(server: TestServer, body: bytes, chunked: bool,
                              received: asyncio.Event) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    writer.write(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"{framing}\r\nConnection: close\r\n\r\n".encode())
    half = len(body) // 2
    pieces = [body[:half], body[half:]]
    wire = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"] if chunked \
        else pieces
    writer.write(wire[0])
    await writer.drain()
    await asyncio.wait_for(received.wait(), 10)
    await asyncio.sleep(0.2)   # let the server read what has arrived
    for part in wire[1:]:
        writer.write(part)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if b"chunked" in head.lower():
        size, _, rest = payload.partition(b"\r\n")
        payload = rest[:int(size, 16)]
    return status, orjson.loads(payload)


async def _run(body: bytes, chunked: bool) -> tuple[int, dict]:
    received = asyncio.Event()
    server = await _server(received)
    try:
        return await _post_in_two_pieces(server, body, chunked, received)
    finally:
        await server.close()


async def test_a_body_in_two_pieces_is_read_whole():
    body = orjson.dumps({"items": list(range(20_000))})     # ~100 KB
    assert await _run(body, chunked=False) == (200, {"items": 20_000})


async def test_a_chunked_body_in_two_pieces_is_read_whole():
    body = orjson.dumps({"items": list(range(20_000))})
    assert await _run(body, chunked=True) == (200, {"items": 20_000})


async def test_a_chunked_body_over_the_limit_is_413_even_in_pieces():
    body = orjson.dumps({"items": list(range(300_000))})    # ~2 MB
    assert await _run(body, chunked=True) == (413, {"status": 413})
