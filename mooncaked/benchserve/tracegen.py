"""A small generator of Mooncake-format traces, for users without traces.

Three kinds of traffic, each starting at random times, ``rate`` per second:
Poisson arrivals by default, burstier with ``arrival_cv`` > 1 (gamma
inter-arrival gaps with that coefficient of variation: many short gaps and
a few long ones, the same mean).

- ``chat``: a multi-turn session behind one of ``system_prompts`` shared
  system prompts; turn k+1's prompt is turn k's prompt + its answer + a new
  user message, so it starts with every *full* 512-token block of turn k
  (a partial last block changes once text is appended, so it gets a new id).
  Turns are ``think_time_s`` apart on average.
- ``doc``: a question about one of ``documents`` long documents: the
  document's blocks, then a fresh question.
- ``single``: a one-off request behind a shared system prompt.

System prompts and documents are picked with Zipf-like popularity
(weight 1/rank), so a few are hot.  Output: one JSON object per line,
``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``, sorted
by timestamp; hash ids are chained as in the published traces (an id always
stands for the same whole prefix).  ``annotate`` adds ``kind``, ``session``,
``turn``, ``doc`` and ``system`` fields (ignored by trace readers).
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.keys import TRACE_BLOCK_TOKENS as BLOCK


@dataclass
class TraceGenConfig:
    requests: int = 1000
    rate: float = 1.0               # new sessions / documents questions / one-offs per second
    seed: int = 0
    chat_share: float = 0.5         # share of arrivals that start a chat session
    doc_share: float = 0.3          # share that ask about a document; the rest are one-offs
    system_prompts: int = 4
    system_prompt_tokens: int = 2048  # rounded up to whole 512-token blocks
    turns_mean: float = 4.0         # chat turns per session (geometric, >= 1)
    think_time_s: float = 20.0      # mean gap between a session's turns
    user_tokens_mean: int = 600     # new user text per request (exponential, >= 16)
    output_tokens_mean: int = 200   # answer length (exponential, >= 1)
    documents: int = 10
    document_tokens: int = 16384    # rounded up to whole blocks
    max_input_tokens: int = 131072  # a chat session ends before its prompt would pass this
    arrival_cv: float = 1.0         # coefficient of variation of arrival gaps (1 = Poisson)

    def __post_init__(self) -> None:
        for name in ("requests", "system_prompts", "documents", "user_tokens_mean",
                     "output_tokens_mean", "system_prompt_tokens", "document_tokens",
                     "max_input_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.rate > 0:
            raise ValueError("rate must be > 0")
        if not (0 <= self.chat_share <= 1 and 0 <= self.doc_share <= 1
                and self.chat_share + self.doc_share <= 1):
            raise ValueError("chat_share and doc_share must be in [0, 1] with a sum <= 1")
        if self.turns_mean < 1:
            raise ValueError("turns_mean must be >= 1")
        if self.think_time_s < 0:
            raise ValueError("think_time_s must be >= 0")
        if not self.arrival_cv > 0:
            raise ValueError("arrival_cv must be > 0 (1 = Poisson)")
        if self.max_input_tokens < self.system_prompt_tokens + 2 * BLOCK:
            raise ValueError("max_input_tokens must leave room beyond the system prompt")


class _Ids:
    """Fresh hash ids, in order of first use."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _zipf(rng: random.Random, n: int) -> int:
    return rng.choices(range(n), weights=[1.0 / (i + 1) for i in range(n)])[0]


def _length(rng: random.Random, mean: int, low: int) -> int:
    return max(low, int(rng.expovariate(1.0 / mean)))


def _request(t_s: float, prefix: list[int], prefix_tokens: int, new_tokens: int,
             output: int, ids: _Ids, **note: Any) -> dict[str, Any]:
    """A prompt of ``prefix`` (whole blocks) + ``new_tokens`` fresh tokens."""
    assert prefix_tokens == len(prefix) * BLOCK
    n = prefix_tokens + new_tokens
    hash_ids = prefix + ids.take(_blocks(n) - len(prefix))
    return {"timestamp": int(round(t_s * 1000)), "input_length": n, "output_length": output,
            "hash_ids": hash_ids, **note}


def _gap(rng: random.Random, rate: float, cv: float) -> float:
    """One inter-arrival gap of mean 1/rate: exponential (cv 1, the same
    draws as before arrival_cv existed) or gamma with shape 1/cv^2."""
    if cv == 1.0:
        return rng.expovariate(rate)
    shape = 1.0 / (cv * cv)
    return rng.gammavariate(shape, 1.0 / (rate * shape))


def generate(cfg: TraceGenConfig, annotate: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(cfg.seed)
    ids = _Ids()
    sys_blocks = _blocks(cfg.system_prompt_tokens)
    systems = [ids.take(sys_blocks) for _ in range(cfg.system_prompts)]
    doc_blocks = _blocks(cfg.document_tokens)
    docs = [ids.take(doc_blocks) for _ in range(cfg.documents)]
    out: list[dict[str, Any]] = []
    t = 0.0
    session = 0
    # Arrivals are generated in time order but chat turns land later: keep
    # generating until `requests` of them start no later than the current
    # arrival time (later turns wait in `pending`), so the first `requests`
    # by timestamp are final.
    pending: list[int] = []
    started = 0
    while started < cfg.requests:
        t += _gap(rng, cfg.rate, cfg.arrival_cv)
        while pending and pending[0] <= t * 1000:
            heapq.heappop(pending)
            started += 1
        kind = rng.random()
        user = _length(rng, cfg.user_tokens_mean, 16)
        output = _length(rng, cfg.output_tokens_mean, 1)
        if kind < cfg.chat_share:
            s = _zipf(rng, cfg.system_prompts)
            session += 1
            full = list(systems[s])       # whole blocks every later turn starts with
            history = 0                   # tokens after `full` carried into the next turn
            turns = 1 + int(rng.expovariate(1.0 / (cfg.turns_mean - 1))) \
                if cfg.turns_mean > 1 else 1
            at = t
            for turn in range(turns):
                new = history + user
                if len(full) * BLOCK + new > cfg.max_input_tokens:
                    break
                req = _request(at, full, len(full) * BLOCK, new, output, ids,
                               **({"kind": "chat", "session": session, "turn": turn,
                                   "system": s} if annotate else {}))
                out.append(req)
                heapq.heappush(pending, req["timestamp"])
                n = req["input_length"]
                full = req["hash_ids"][:n // BLOCK]
                history = n - len(full) * BLOCK + output   # the partial block + the answer
                at += rng.expovariate(1.0 / cfg.think_time_s) if cfg.think_time_s else 0.0
                user = _length(rng, cfg.user_tokens_mean, 16)
                output = _length(rng, cfg.output_tokens_mean, 1)
        elif kind < cfg.chat_share + cfg.doc_share:
            d = _zipf(rng, cfg.documents)
            out.append(_request(t, docs[d], doc_blocks * BLOCK, user, output, ids,
                                **({"kind": "doc", "doc": d} if annotate else {})))
            heapq.heappush(pending, out[-1]["timestamp"])
        else:
            s = _zipf(rng, cfg.system_prompts)
            out.append(_request(t, systems[s], sys_blocks * BLOCK, user, output, ids,
                                **({"kind": "single", "system": s} if annotate else {})))
            heapq.heappush(pending, out[-1]["timestamp"])
    out.sort(key=lambda r: r["timestamp"])
    return out[:cfg.requests]


def write_trace(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def describe(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Averages and the theoretical hit ratio (unbounded instant cache)."""
    from mooncaked.simulate.trace import TraceRequest, theoretical_hit_rate

    reqs = [TraceRequest(i, r["timestamp"] / 1000, r["input_length"], r["output_length"],
                         tuple(r["hash_ids"])) for i, r in enumerate(records)]
    n = len(records) or 1
    span = (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000 if records else 0.0
    gaps = [(b["timestamp"] - a["timestamp"]) / 1000 for a, b in zip(records, records[1:])]
    mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
    sd_gap = math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)) if gaps else 0.0
    return {"requests": len(records),
            "avg_input": sum(r["input_length"] for r in records) / n,
            "avg_output": sum(r["output_length"] for r in records) / n,
            "span_s": span, "rate_rps": (len(records) - 1) / span if span > 0 else 0.0,
            "theoretical_hit_ratio": theoretical_hit_rate(reqs),
            # Of every request's arrival gap: 1 for Poisson arrivals, more when bursty.
            "arrival_gap_cv": sd_gap / mean_gap if mean_gap > 0 else 0.0,
            "max_input": max((r["input_length"] for r in records), default=0),
            "blocks_per_request": math.fsum(len(r["hash_ids"]) for r in records) / n}
