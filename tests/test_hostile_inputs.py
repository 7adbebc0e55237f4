"""Hostile input at every port of a real local cluster (issue 15): the OpenAI API, every
node's ``/internal/`` routes (with the cluster token, so the bodies reach the handlers),
and every transfer listener.  Each gets a 4xx with a JSON error body or a closed
connection -- never a 5xx, a traceback or a hang (every wait is bounded) -- and greedy
outputs after the barrage equal those from before it."""

from __future__ import annotations

import http.client
import json
import socket
import struct
from urllib.parse import urlsplit

import pytest

from rdma import frames
from tests.cluster_helpers import complete, running_cluster, tokens
from tests.nodes import get_json

pytestmark = pytest.mark.slow  # one real local cluster for the module

TOKEN = "hostile-cluster-token"
XFER_TOKEN = "hostile-transfer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 256 << 10           # conductor.max_request_bytes for this cluster
PROMPTS = [tokens(40, seed=s) for s in (11, 12, 13)]
WAIT_S = 30.0                  # the bound on every reply or close


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    extra = [f"node.cluster_token={TOKEN}", f"transfer.auth_token={XFER_TOKEN}",
             f"conductor.max_request_bytes={MAX_BODY}", "conductor.max_prompt_tokens=1024"]
    with running_cluster(tmp_path_factory.mktemp("hostile"), prefill=1, decode=1, extra=extra) as c:
        c.greedy_before = greedy(c.url)
        yield c


def greedy(url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        status, body = complete(url, p, max_tokens=6)
        assert status == 200, body
        out.append(body["choices"][0]["text"])
    return out


def node_url(cluster, name: str) -> str:
    return next(c.url for c in cluster.children if c.name == name)


# -- HTTP ----------------------------------------------------------------------------

def raw_http(url: str, path: str, body: bytes | None, headers: dict | None = None,
             method: str = "POST") -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json",
                                                        **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def oversize_http(url: str, path: str, claimed: int, sent: int, headers: dict | None = None,
                  chunked: bool = False) -> tuple[int, bytes]:
    """POST a body of ``claimed`` bytes (Content-Length) or an unbounded chunked one,
    sending at most ``sent`` bytes of it; the reply must come before the rest."""
    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port), timeout=WAIT_S)
    try:
        head = [f"POST {path} HTTP/1.1", f"Host: {parts.hostname}", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {claimed}")
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        piece = b'{"prompt": "' + b"a" * (64 << 10)
        try:
            done = 0
            while done < sent:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                done += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest: what we want
        reply = b""
        while b"\r\n\r\n" not in reply:
            got = s.recv(65536)
            if not got:
                break
            reply += got
        status_line, _, rest = reply.partition(b"\r\n")
        status = int(status_line.split()[1])
        headers_blob, _, body = rest.partition(b"\r\n\r\n")
        length = next((int(h.split(b":")[1]) for h in headers_blob.split(b"\r\n")
                       if h.lower().startswith(b"content-length:")), None)
        while length is not None and len(body) < length:
            got = s.recv(65536)
            if not got:
                break
            body += got
        return status, body
    finally:
        s.close()


def assert_client_error(status: int, body: bytes, what: str) -> dict:
    assert 400 <= status < 500, f"{what}: HTTP {status}: {body[:300]!r}"
    assert b"Traceback" not in body, what
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"], what
    return err


BAD_BODIES: list[tuple[str, bytes]] = [
    ("truncated JSON", b'{"model": "tiny", "prompt": "x", "max_tokens": '),
    ("garbage bytes", bytes(range(256)) * 4),
    ("empty body", b""),
    ("null", b"null"),
    ("array", b"[]"),
    ("string", b'"prompt"'),
    ("number", b"42"),
    ("deep nesting", b"[" * 100_000),
    ("invalid UTF-8 in a string", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    ("NaN literal", b'{"model": "tiny", "prompt": "x", "temperature": NaN}'),
]

API_FIELDS: list[tuple[str, dict]] = [
    ("prompt object", {"prompt": {"text": "x"}}),
    ("prompt nested lists", {"prompt": [[1, 2], [3, [4]]]}),
    ("prompt negative id", {"prompt": [-1, 5]}),
    ("prompt id past the vocabulary", {"prompt": [10 ** 9]}),
    ("prompt id past 64 bits", {"prompt": [2 ** 70]}),
    ("prompt float ids", {"prompt": [1.5, 2.5]}),
    ("prompt bools", {"prompt": [True, False]}),
    ("prompt lone surrogate", {"prompt": "\ud800 x"}),
    ("max_tokens string", {"prompt": "x", "max_tokens": "8"}),
    ("max_tokens huge", {"prompt": "x", "max_tokens": 10 ** 30}),
    ("max_tokens over the context", {"prompt": "x", "max_tokens": 10 ** 6}),
    ("temperature string", {"prompt": "x", "temperature": "hot"}),
    ("temperature negative", {"prompt": "x", "temperature": -1}),
    ("top_p out of range", {"prompt": "x", "top_p": 5}),
    ("top_k string", {"prompt": "x", "top_k": "many"}),
    ("stop number", {"prompt": "x", "stop": 7}),
    ("stop list of numbers", {"prompt": "x", "stop": [1, 2]}),
    ("n zero", {"prompt": "x", "n": 0}),
    ("n huge", {"prompt": "x", "n": 10 ** 6}),
    ("stream string", {"prompt": "x", "stream": "yes"}),
    ("stream_options string", {"prompt": "x", "stream": True, "stream_options": "x"}),
    ("logprobs huge", {"prompt": "x", "logprobs": 10 ** 6}),
    ("seed string", {"prompt": "x", "seed": "abc"}),
    ("model number", {"model": 5, "prompt": "x"}),
    ("prompt over max_prompt_tokens", {"prompt": [1] * 2000}),
    ("batch of prompts too big", {"prompt": [[1, 2]] * 10_000}),
    ("n times prompts too many", {"prompt": [[1, 2]] * 8, "n": 64}),
    ("best_of huge", {"prompt": "x", "n": 2, "best_of": 10 ** 30}),
    ("presence_penalty string", {"prompt": "x", "presence_penalty": "lots"}),
    ("frequency_penalty huge", {"prompt": "x", "frequency_penalty": 1e308}),
    ("repetition_penalty negative", {"prompt": "x", "repetition_penalty": -1}),
    ("min_p bool", {"prompt": "x", "min_p": True}),
    ("min_tokens huge", {"prompt": "x", "min_tokens": 10 ** 30}),
    ("logit_bias list", {"prompt": "x", "logit_bias": [[1, 5]]}),
    ("logit_bias key past 64 bits", {"prompt": "x", "logit_bias": {str(2 ** 70): 1}}),
    ("logit_bias key of 5000 digits", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}),
    ("logit_bias non-ASCII digits", {"prompt": "x", "logit_bias": {"\u0665": 1}}),
    ("logit_bias negative id", {"prompt": "x", "logit_bias": {"-1": 1}}),
    ("logit_bias value object", {"prompt": "x", "logit_bias": {"5": {"a": 1}}}),
    ("response_format string", {"prompt": "x", "response_format": "json"}),
    ("unknown field", {"prompt": "x", "guided_json": {"type": "object"}}),
]

CHAT_FIELDS: list[tuple[str, dict]] = [
    ("messages string", {"messages": "hi"}),
    ("messages empty", {"messages": []}),
    ("message not an object", {"messages": ["hi"]}),
    ("role number", {"messages": [{"role": 5, "content": "hi"}]}),
    ("role unknown", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("content object", {"messages": [{"role": "user", "content": {"a": 1}}]}),
    ("content parts of a bad type", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
    ("content lone surrogate", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ("max_tokens over the context", {"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 10 ** 6}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("what,body", BAD_BODIES, ids=[w for w, _ in BAD_BODIES])
def test_api_malformed_bodies(cluster, path, what, body):
    assert_client_error(*raw_http(cluster.url, path, body), what)


@pytest.mark.parametrize("what,fields", API_FIELDS, ids=[w for w, _ in API_FIELDS])
def test_api_wrong_types_and_values(cluster, what, fields):
    body = {"model": "tiny", "temperature": 0, **fields}
    data = json.dumps(body, allow_nan=False).encode("utf-8", "surrogatepass")
    err = assert_client_error(*raw_http(cluster.url, "/v1/completions", data), what)
    if what.startswith("max_tokens over"):
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("what,fields", CHAT_FIELDS, ids=[w for w, _ in CHAT_FIELDS])
def test_chat_wrong_types_and_values(cluster, what, fields):
    body = {"model": "tiny", "temperature": 0, **fields}
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    assert_client_error(*raw_http(cluster.url, "/v1/chat/completions", data), what)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_api_oversize_bodies_get_413(cluster, chunked):
    status, body = oversize_http(cluster.url, "/v1/completions", claimed=64 << 20,
                                 sent=2 * MAX_BODY, chunked=chunked)
    assert status == 413, body[:300]
    assert_client_error(status, body, "oversize")


def test_api_wrong_method_and_path(cluster):
    assert_client_error(*raw_http(cluster.url, "/v1/completions", None, method="GET"), "GET")
    assert_client_error(*raw_http(cluster.url, "/v1/nothing-here", b"{}"), "unknown path")


# -- /internal/ (with the cluster token) ----------------------------------------------

INTERNAL_ROUTES = {
    "conductor": ["/internal/nodes/register", "/internal/nodes/heartbeat",
                  "/internal/nodes/deregister", "/internal/cache/snapshot",
                  "/internal/cache/events"],
    "prefill-0": ["/internal/prefill", "/internal/prefill/cancel", "/internal/store/prefetch",
                  "/internal/store/lease", "/internal/store/release"],
    "decode-0": ["/internal/decode/reserve", "/internal/decode/generate",
                 "/internal/decode/touch", "/internal/decode/cancel"],
}
ROUTES = [(node, path) for node, paths in INTERNAL_ROUTES.items() for path in paths]
GENERIC_BODIES = BAD_BODIES + [
    ("empty object", b"{}"),
    ("request_id number", b'{"request_id": 5}'),
    ("request_id huge", json.dumps({"request_id": "r" * 200_000}).encode()),
    ("node_id object", b'{"node_id": {"x": 1}, "role": [], "url": 7}'),
]


@pytest.mark.parametrize("node,path", ROUTES, ids=[p for _, p in ROUTES])
def test_internal_routes_refuse_malformed_bodies(cluster, node, path):
    url = node_url(cluster, node)
    for what, body in GENERIC_BODIES:
        status, raw = raw_http(url, path, body, AUTH)
        if status == 200 and path.endswith("/cancel") and json.loads(raw) == {"cancelled": False}:
            continue  # cancelling a request id nobody holds is a no-op, not an error
        assert_client_error(status, raw, f"{path}: {what}")
    # Without (or with a wrong) token nothing reaches the handler.
    assert raw_http(url, path, b"{}")[0] == 401
    assert raw_http(url, path, b"{}", {"Authorization": "Bearer nope"})[0] == 401


@pytest.mark.parametrize("node,path", ROUTES, ids=[p for _, p in ROUTES])
def test_internal_routes_refuse_oversize_bodies(cluster, node, path):
    # Past every route's own limit (the largest is 64 MiB): refused from the header.
    status, body = oversize_http(node_url(cluster, node), path, claimed=1 << 30, sent=1 << 20,
                                 headers=AUTH)
    assert status == 413, (path, body[:300])
    assert_client_error(status, body, path)


def _grant(pages: list[int]) -> dict:
    return {"pages": pages, "segment": "decode-0", "region": 0}


SEMANTIC = [
    ("decode-0", "/internal/decode/reserve", {"request_id": "h1", "total_tokens": 10 ** 12}),
    ("decode-0", "/internal/decode/reserve", {"request_id": "h2", "total_tokens": -5}),
    ("decode-0", "/internal/decode/generate", {"request_id": "never-reserved", "prompt_len": 4,
                                               "first_token": 1}),
    ("decode-0", "/internal/decode/generate", {"request_id": "x", "prompt_len": -1,
                                               "first_token": 10 ** 9}),
    ("decode-0", "/internal/decode/touch", {"request_id": "never-reserved"}),
    ("prefill-0", "/internal/prefill", {"request_id": "h3", "token_ids": [10 ** 9] * 4,
                                        "block_keys": [], "decode": _grant([0])}),
    ("prefill-0", "/internal/prefill", {"request_id": "h4", "token_ids": [-3, 4],
                                        "block_keys": [], "decode": _grant([0])}),
    ("prefill-0", "/internal/prefill", {"request_id": "h5", "token_ids": [1] * 40,
                                        "block_keys": [1, 2], "decode": _grant([0])}),
    ("prefill-0", "/internal/prefill", {"request_id": "h6", "token_ids": [1, 2],
                                        "block_keys": [], "decode": _grant([2 ** 40])}),
    ("prefill-0", "/internal/prefill", {"request_id": "h7", "token_ids": [1, 2],
                                        "block_keys": [], "decode": _grant([0]),
                                        "sampling": {"logit_bias": {"-3": 1}}}),
    ("prefill-0", "/internal/prefill", {"request_id": "h8", "token_ids": [1, 2],
                                        "block_keys": [], "decode": _grant([0]),
                                        "sampling": {"min_tokens": 9, "max_tokens": 2}}),
    ("prefill-0", "/internal/prefill", {"request_id": "h9", "token_ids": [1, 2],
                                        "block_keys": [], "decode": _grant([0]),
                                        "sampling": {"repetition_penalty": 0}}),
    ("prefill-0", "/internal/store/lease", {"keys": [2 ** 64 + 1], "ttl_s": 5}),
    ("prefill-0", "/internal/store/lease", {"keys": [1], "ttl_s": 10 ** 9}),
    ("prefill-0", "/internal/store/release", {"lease_id": -1}),
    ("prefill-0", "/internal/store/prefetch", {"token_ids": [1] * 16, "block_keys": [],
                                               "source_url": "x"}),
    ("conductor", "/internal/nodes/heartbeat", {"node_id": "no-such-node"}),
    ("conductor", "/internal/cache/events", {"node_id": "no-such-node", "epoch": 1, "seq": 1,
                                             "stored": [1], "evicted": []}),
]


@pytest.mark.parametrize("node,path,body", SEMANTIC, ids=[f"{p}-{i}" for i, (_, p, _) in
                                                          enumerate(SEMANTIC)])
def test_internal_routes_refuse_hostile_values(cluster, node, path, body):
    status, raw = raw_http(node_url(cluster, node), path, json.dumps(body).encode(), AUTH)
    if status == 200 and path == "/internal/decode/generate":
        raise AssertionError(f"{path} streamed for a request it never reserved: {raw[:200]!r}")
    assert_client_error(status, raw, f"{path} {body}")


# -- transfer listeners ----------------------------------------------------------------

def transfer_ports(cluster) -> list[tuple[str, str, int, list[dict]]]:
    out = []
    for name in ("prefill-0", "decode-0"):
        status, raw = raw_http(cluster.url, f"/internal/segments/{name}", None, AUTH, method="GET")
        assert status == 200, raw
        desc = json.loads(raw)
        for nic in desc["nics"]:
            out.append((name, nic["host"], nic["port"], desc["regions"]))
    return out


def closed(s: socket.socket) -> bool:
    """The listener closed the connection (within the socket's timeout)."""
    try:
        while True:
            got = s.recv(65536)
            if not got:
                return True
    except ConnectionResetError:
        return True
    except (TimeoutError, socket.timeout):
        return False


def connect(host: str, port: int, token: str | None = XFER_TOKEN):
    s = socket.create_connection((host, port), timeout=10)
    key = frames.client_handshake(s, token)[0] if token is not None else None
    return s, key


def _header(key, op=frames.OP_WRITE, region=0, offset=0, length=16, seq=1, **kw) -> bytes:
    return frames.pack_header(key, op, region, offset, length, seq, **kw)


def hostile_frames(key: bytes, region_len: int) -> list[tuple[str, bytes]]:
    good = _header(key)
    bad_version = bytearray(good)
    bad_version[4] = 9
    reserved = bytearray(good)
    struct.pack_into("<H", reserved, 6, 0x80)
    return [
        ("truncated header", good[:20]),
        ("bad magic", b"EVIL" + good[4:] + b"x" * 16),
        ("bad version", bytes(bad_version) + b"x" * 16),
        ("reserved flags", bytes(reserved) + b"x" * 16),
        ("bad tag", frames.pack_header(b"wrong-key", frames.OP_WRITE, 0, 0, 16, 1) + b"x" * 16),
        ("bad sequence", _header(key, seq=5) + b"x" * 16),
        ("unknown region", _header(key, region=77) + b"x" * 16),
        ("offset past the region", _header(key, offset=region_len) + b"x" * 16),
        ("range past the region", _header(key, offset=region_len - 8) + b"x" * 16),
        ("offset near 2**64", _header(key, offset=(1 << 64) - 8) + b"x" * 16),
        ("huge length", _header(key, length=1 << 62) + b"x" * 16),
        ("READ past the region", _header(key, op=frames.OP_READ, offset=region_len - 4, length=64)),
        ("response op", _header(key, op=frames.OP_READ_RESP) + b"x" * 16),
        ("QP connect on tcp", _header(key, op=frames.OP_QP_CONNECT, length=8) + b"{}" * 4),
        ("payload cut short", _header(key, length=4096) + b"x" * 100),
    ]


def test_transfer_ports_close_on_hostile_frames(cluster):
    checked = 0
    for name, host, port, regions in transfer_ports(cluster):
        region_len = regions[0]["length"]
        # Before or instead of a handshake.
        for what, data in [("HTTP at the port", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                           ("garbage hello", bytes(range(256))),
                           ("short hello", frames.HELLO_MAGIC + b"\x02")]:
            s = socket.create_connection((host, port), timeout=15)
            s.sendall(data)
            if what == "short hello":
                s.shutdown(socket.SHUT_WR)
            assert closed(s), f"{name}:{port} {what}"
            s.close()
        s = socket.create_connection((host, port), timeout=10)
        with pytest.raises(frames.FrameError, match="authentication"):
            frames.client_handshake(s, "not-the-token")  # its proof does not check out
        s.close()
        # After a good handshake: every frame the listener must refuse.
        s, key = connect(host, port)
        for what, data in hostile_frames(key, region_len):
            if s.fileno() < 0:
                s, key = connect(host, port)
            s.sendall(data)
            if what in ("truncated header", "payload cut short"):
                s.shutdown(socket.SHUT_WR)
            assert closed(s), f"{name}:{port} {what}"
            s.close()
            checked += 1
        # A WRITE without the capability into the decode node's guarded KV
        # region is answered REFUSED (the sender must stop), nothing lands.
        if name == "decode-0":
            s, key = connect(host, port)
            s.sendall(_header(key, length=16) + b"x" * 16)
            ack = frames.recv_bytes(s, frames.HEADER_SIZE)
            assert frames.unpack_header(key, ack)[:2] == (frames.OP_WRITE_ACK, frames.STATUS_REFUSED)
            s.sendall(_header(key, length=16, seq=2, capability=0x1234) + b"x" * 16)
            ack = frames.recv_bytes(s, frames.HEADER_SIZE)
            assert frames.unpack_header(key, ack)[:2] == (frames.OP_WRITE_ACK, frames.STATUS_REFUSED)
            s.close()
    assert checked == 2 * len(hostile_frames(b"k", 1 << 20))
    # The listeners counted what they refused.
    for name in ("prefill-0", "decode-0"):
        _, status = get_json(node_url(cluster, name) + "/admin/status", timeout=WAIT_S)
        assert status["transfer"]["refused_connections"] >= len(hostile_frames(b"k", 1 << 20))


# -- afterwards (keep last in the file: pytest runs tests in file order) ---------------

def test_outputs_after_the_barrage_equal_those_before(cluster):
    assert greedy(cluster.url) == cluster.greedy_before
    for name in ("prefill-0", "decode-0"):
        _, status = get_json(node_url(cluster, name) + "/admin/status", timeout=WAIT_S)
        sizes = status["collections"]
        assert sizes["store_private_pages"] == 0 and sizes["store_pinned_blocks"] == 0, sizes
        assert sizes["transfer_batches"] == 0, sizes
    _, status = get_json(node_url(cluster, "decode-0") + "/admin/status", timeout=WAIT_S)
    assert status["collections"]["decode_seqs"] == 0 and status["collections"]["write_grants"] == 0
