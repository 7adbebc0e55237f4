"""The replay client: open-loop, streaming, bounded in count and time.

Each request is sent at its arrival time (never earlier; a late send is
recorded as ``send_lag_s``) to ``/v1/completions`` with token-id prompts,
``stream: true``, ``ignore_eos`` (so the trace's output length is what runs)
and ``logprobs: 0`` — the only portable way to learn how many tokens a
streamed chunk carries, since a server may hold back tokens that do not yet
form whole characters and send several in one chunk.  Every token of a chunk
is stamped with the chunk's arrival time, as any streaming client sees it.

Statuses: ``ok``; ``rejected`` (HTTP 429, the paper's early rejection);
``error`` (any other HTTP status, a stream error event, a connection
failure); ``timeout`` (``request_timeout_s`` elapsed, or the run's
``max_duration_s`` ended while it was in flight); ``not_sent`` (its arrival
time was past ``max_duration_s``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import aiohttp
import orjson
import uvloop

from mooncaked.benchserve.workload import ReplayRequest
from mooncaked.simulate.metrics import paper_tbt

STATUSES = ("ok", "rejected", "error", "timeout", "not_sent")
# Fields of the conductor's per-request trace (GET /admin/requests/{id}) we keep.
SERVER_FIELDS = ("prefill_node", "decode_node", "policy", "cached_tokens", "local_hit_tokens",
                 "fetched_tokens", "prefill_queue_s", "prefix_load_s", "prefill_compute_s",
                 "kv_transfer_wait_s", "ttft_s", "e2e_s", "predicted_ttft_s", "predicted_tbt_s",
                 "tbt_s", "predicted_queue_s", "predicted_prefill_s", "schedule_s", "reserve_s",
                 "first_layer_sent_s", "prefill_rpc_s", "prefill_node_s",
                 "prefill_compute_cpu_s", "prefill_batched_ahead_s",
                 "prefill_batched_behind_s",
                 "prefill_gave_way_s", "prefill_thread_wait_s")


@dataclass
class ReplayConfig:
    url: str = ""
    model: str = ""                 # "" = the first model of GET /v1/models
    max_duration_s: float = 600.0   # whole run: no send after it, in-flight cancelled at it
    request_timeout_s: float = 300.0
    server_traces: bool = True      # fetch the conductor's /admin/requests/{id}-0 per request
    api_key: str = ""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        self.url = self.url.rstrip("/")
        if not self.max_duration_s > 0:
            raise ValueError("max_duration_s must be > 0")
        if not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")


@dataclass
class RequestResult:
    index: int
    trace_index: int
    scheduled_s: float              # planned send time, from the replay start
    prompt_tokens: int
    max_tokens: int
    shared_prefix_tokens: int = 0   # most a cache could give (workload.shared_prefix_tokens)
    status: str = "not_sent"
    http_status: int = 0
    sent_s: float = 0.0             # actual send time, from the replay start
    send_lag_s: float = 0.0
    ttft_s: Optional[float] = None  # send -> first token
    e2e_s: Optional[float] = None   # send -> end of stream
    token_times_s: list[float] = field(default_factory=list)  # send -> each token
    completion_tokens: int = 0
    cached_tokens: int = 0          # usage.prompt_tokens_details.cached_tokens
    request_id: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    error: str = ""
    reject_s: Optional[float] = None       # send -> the rejection's answer
    retry_after: str = ""                  # the rejection's Retry-After header
    server: dict[str, Any] = field(default_factory=dict)

    # ---- per-request metrics (the paper's and vLLM's definitions) ----------
    @property
    def intervals_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tbt_s(self) -> Optional[float]:
        """The paper's TBT: mean of the longest 10% of token intervals."""
        if self.status != "ok":
            return None
        return paper_tbt(self.intervals_s)

    @property
    def tpot_s(self) -> Optional[float]:
        """vLLM's TPOT: (E2E - TTFT) / (output tokens - 1)."""
        if self.status != "ok" or self.completion_tokens < 2:
            return None
        assert self.e2e_s is not None and self.ttft_s is not None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tbt_s"] = self.tbt_s
        out["tpot_s"] = self.tpot_s
        return out


async def discover_model(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}/v1/models: HTTP {resp.status}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


class Replayer:
    """Sends one workload; ``on_event(kind, result)`` gets ``"sent"`` and ``"done"``."""

    def __init__(self, cfg: ReplayConfig,
                 on_event: Callable[[str, RequestResult], None] | None = None) -> None:
        self.cfg = cfg
        self.on_event = on_event or (lambda kind, res: None)
        self.model = cfg.model
        self._traces_ok = cfg.server_traces
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self.headers["Authorization"] = f"Bearer {cfg.api_key}"

    async def run(self, reqs: list[ReplayRequest],
                  shared: list[int] | None = None) -> list[RequestResult]:
        results = [RequestResult(r.index, r.trace_index, r.arrival_s, len(r.prompt), r.max_tokens,
                                 shared[i] if shared else 0) for i, r in enumerate(reqs)]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as http:
            if not self.model:
                self.model = await discover_model(http, self.cfg.url)
            loop = asyncio.get_running_loop()
            start = loop.time()
            deadline = start + self.cfg.max_duration_s
            tasks: list[asyncio.Task] = []
            for req, res in zip(reqs, results):
                if start + req.arrival_s >= deadline:
                    break  # this and every later one stay not_sent
                delay = start + req.arrival_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                res.status = "running"
                res.sent_s = loop.time() - start
                res.send_lag_s = max(0.0, res.sent_s - req.arrival_s)
                self.on_event("sent", res)
                tasks.append(asyncio.create_task(self._one(http, req, res)))
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for res in results:
            if res.status == "running":  # cancelled at the run's deadline
                res.status, res.error = "timeout", "run ended (max_duration_s)"
                self.on_event("done", res)
        return results

    async def _one(self, http: aiohttp.ClientSession, req: ReplayRequest,
                   res: RequestResult) -> None:
        body = {"model": self.model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0,
                "stream_options": {"include_usage": True}}
        # Encoded before the clock starts: a prompt of thousands of token
        # ids takes the stdlib encoder (aiohttp's json=) a millisecond or
        # more on a busy core, which is the client's time, not the server's.
        data = orjson.dumps(body)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._stream(http, data, res, t0), self.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            res.status, res.error = "timeout", f"no end of stream in {self.cfg.request_timeout_s}s"
        except aiohttp.ClientError as exc:
            res.status, res.error = "error", f"{type(exc).__name__}: {exc}"
        if res.status == "running":
            res.status = "error"
            res.error = res.error or "stream ended without [DONE]"
        if res.status == "ok" and res.request_id and self._traces_ok:
            res.server = await self._server_trace(http, res.request_id)
        self.on_event("done", res)

    async def _stream(self, http: aiohttp.ClientSession, data: bytes, res: RequestResult,
                      t0: float) -> None:
        async with http.post(self.cfg.url + "/v1/completions", data=data,
                             headers=self.headers) as resp:
            res.http_status = resp.status
            if resp.status != 200:
                res.status = "rejected" if resp.status == 429 else "error"
                res.error = (await resp.text())[:300]
                if res.status == "rejected":
                    res.reject_s = time.monotonic() - t0
                    res.retry_after = resp.headers.get("Retry-After", "")
                return
            res.request_id = resp.headers.get("x-request-id", "")
            res.prefill_node = resp.headers.get("x-mooncaked-prefill-node", "")
            res.decode_node = resp.headers.get("x-mooncaked-decode-node", "")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                now = time.monotonic() - t0
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    if res.status == "running":
                        res.status = "ok"
                    break
                self._on_chunk(orjson.loads(payload), res, now)
            res.e2e_s = time.monotonic() - t0
        if res.status == "ok" and res.completion_tokens > len(res.token_times_s):
            # Tokens the chunks did not account for (a server without
            # per-chunk logprobs): they arrived by the end of the stream.
            last = res.token_times_s[-1] if res.token_times_s else res.e2e_s
            res.token_times_s += [last] * (res.completion_tokens - len(res.token_times_s))

    @staticmethod
    def _on_chunk(chunk: dict, res: RequestResult, now: float) -> None:
        if "error" in chunk:
            err = chunk["error"]
            res.status = "error"
            res.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        res.request_id = res.request_id or str(chunk.get("id", ""))
        for choice in chunk.get("choices") or []:
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
                n = len(lp["tokens"])
            else:
                n = 1 if choice.get("text") else 0
            res.token_times_s += [now] * n
        if res.token_times_s and res.ttft_s is None:
            res.ttft_s = res.token_times_s[0]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            res.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = int(details.get("cached_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                res.prompt_tokens = int(usage["prompt_tokens"])

    async def _server_trace(self, http: aiohttp.ClientSession, request_id: str) -> dict:
        """The conductor's timing breakdown; a server without it (vLLM) is asked once."""
        try:
            async with http.get(f"{self.cfg.url}/admin/requests/{request_id}-0") as resp:
                if resp.status == 404 and "recent-request" not in await resp.text():
                    # Not our conductor's "evicted from the log" 404: the
                    # server has no such endpoint (vLLM); stop asking.
                    self._traces_ok = False
                if resp.status != 200:
                    return {}
                data = await resp.json()
        except (aiohttp.ClientError, ValueError):
            return {}
        return {k: data[k] for k in SERVER_FIELDS if k in data}


def run_replay(cfg: ReplayConfig, reqs: list[ReplayRequest], shared: list[int] | None = None,
               on_event: Callable[[str, RequestResult], None] | None = None
               ) -> tuple[list[RequestResult], float]:
    """Replay synchronously; returns the results and the run's wall time."""
    t0 = time.monotonic()
    # uvloop, as the servers run: the client shares the machine's cores with
    # them, and every millisecond its own loop adds is counted in the TTFT
    # and token times it measures.
    results = uvloop.run(Replayer(cfg, on_event).run(reqs, shared))
    return results, time.monotonic() - t0
