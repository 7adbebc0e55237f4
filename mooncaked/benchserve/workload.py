"""From a Mooncake-format trace to the requests a replay sends.

A trace hash id stands for 512 prompt tokens.  For small CPU models the
prompt is scaled by ``length_scale``: each hash id becomes
``block_tokens = round(512 * length_scale)`` tokens (the first ones of the
512 that ``kvstore.keys.trace_token_ids`` gives it), so equal hash ids still
give equal token blocks and the sharing structure is kept exactly:
requests sharing k leading hash ids share exactly ``k * block_tokens``
leading prompt tokens (and no more, up to 1/vocab_size^block_tokens chance).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import numpy as np

from kvstore.keys import TRACE_BLOCK_TOKENS, trace_token_ids
from mooncaked.simulate.trace import TraceRequest, load_trace, theoretical_hit_rate

ARRIVALS = ("trace", "rate", "poisson")


@dataclass
class WorkloadConfig:
    trace: str = ""
    max_requests: int = 0          # 0 = every request of the trace (after offset)
    offset: int = 0                # skip the first N requests of the trace
    time_scale: float = 1.0        # arrival = trace timestamp * time_scale (trace mode)
    arrival: str = "trace"         # trace | rate (even gaps) | poisson
    rate: float = 0.0              # requests/s for rate and poisson
    length_scale: float = 1.0      # prompt lengths times this
    output_scale: float = 0.0      # output lengths times this; 0 = length_scale
    max_output_tokens: int = 0     # cap on max_tokens after scaling; 0 = no cap
    vocab_size: int = 256          # synthetic prompt ids are in [reserved, vocab_size)
    reserved_tokens: int = 0       # keep the lowest ids (special tokens) out of prompts
    seed: int = 0                  # Poisson arrivals

    def __post_init__(self) -> None:
        if not self.trace:
            raise ValueError("trace: a trace file is required")
        if self.max_requests < 0:
            raise ValueError("max_requests must be >= 0")
        if self.offset < 0:
            raise ValueError("offset must be >= 0")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}")
        if self.arrival != "trace" and not self.rate > 0:
            raise ValueError("rate must be > 0 with arrival=rate or poisson")
        if not 0 < self.length_scale <= 1:
            raise ValueError("length_scale must be in (0, 1]")
        if self.output_scale < 0:
            raise ValueError("output_scale must be >= 0 (0 = length_scale)")
        if self.max_output_tokens < 0:
            raise ValueError("max_output_tokens must be >= 0")
        if not 0 <= self.reserved_tokens < self.vocab_size:
            raise ValueError("vocab_size must be > reserved_tokens >= 0")

    @property
    def block_tokens(self) -> int:
        """Prompt tokens per trace hash id after scaling (>= 1)."""
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))


@dataclass(frozen=True)
class ReplayRequest:
    index: int                     # position in the replay (0..n-1)
    trace_index: int               # line order in the trace file
    arrival_s: float               # send time, seconds after the replay starts
    prompt: tuple[int, ...]        # token ids
    max_tokens: int
    hash_ids: tuple[int, ...]      # the trace's ids, for cache-hit analysis
    block_tokens: int              # prompt tokens per hash id


def scaled_prompt(hash_ids: tuple[int, ...], input_length: int, block_tokens: int,
                  vocab_size: int, reserved: int = 0) -> np.ndarray:
    """Token ids for a scaled request: ``block_tokens`` per hash id, the last
    block cut so the prompt has ``ceil(input_length * block_tokens / 512)`` ids."""
    full = trace_token_ids(hash_ids, len(hash_ids) * TRACE_BLOCK_TOKENS, vocab_size,
                           reserved=reserved)
    blocks = full.reshape(len(hash_ids), TRACE_BLOCK_TOKENS)[:, :block_tokens].reshape(-1)
    n = max(1, math.ceil(input_length * block_tokens / TRACE_BLOCK_TOKENS))
    return blocks[:n]


def _arrivals(trace: list[TraceRequest], cfg: WorkloadConfig) -> list[float]:
    if cfg.arrival == "trace":
        t0 = trace[0].arrival_s if trace else 0.0
        return [(r.arrival_s - t0) * cfg.time_scale for r in trace]
    if cfg.arrival == "rate":
        return [i / cfg.rate for i in range(len(trace))]
    rng = random.Random(cfg.seed)
    t, out = 0.0, []
    for _ in trace:
        out.append(t)
        t += rng.expovariate(cfg.rate)
    return out


def load_slice(cfg: WorkloadConfig) -> list[TraceRequest]:
    """The trace requests this workload replays (file order kept by load_trace's sort)."""
    limit = cfg.offset + cfg.max_requests if cfg.max_requests else 0
    return load_trace(cfg.trace, limit=limit)[cfg.offset:]


def build_workload(cfg: WorkloadConfig) -> list[ReplayRequest]:
    trace = load_slice(cfg)
    if not trace:
        raise ValueError(f"trace: no requests in {cfg.trace!r} after offset {cfg.offset}")
    b = cfg.block_tokens
    out = []
    for i, (r, at) in enumerate(zip(trace, _arrivals(trace, cfg))):
        prompt = scaled_prompt(r.hash_ids, r.input_length, b, cfg.vocab_size,
                               cfg.reserved_tokens)
        out_len = max(1, math.ceil(r.output_length * (cfg.output_scale or cfg.length_scale)))
        if cfg.max_output_tokens:
            out_len = min(out_len, cfg.max_output_tokens)
        out.append(ReplayRequest(i, r.index, at, tuple(int(t) for t in prompt), out_len,
                                 r.hash_ids, b))
    return out


# Added to a warm-up slice's hash ids: the trace's ids are far below it, so
# a warm-up prompt shares no block with any request it warms the server for.
WARMUP_HASH_OFFSET = 2**40


def warmup_slice(cfg: WorkloadConfig, n: int) -> list[ReplayRequest]:
    """The ``n`` requests that follow ``cfg``'s slice in the trace, with their
    arrival times and lengths (so they warm the kernels, buffers and the
    server's fitted estimators on the shapes the slice will bring) but hash
    ids moved by WARMUP_HASH_OFFSET: no block of theirs is a prefix of any
    request of the slice, so the measured cache hits are the slice's own."""
    if n <= 0:
        return []
    if not cfg.max_requests:
        raise ValueError("warmup_slice: the slice must be bounded (max_requests > 0)")
    after = replace(cfg, offset=cfg.offset + cfg.max_requests, max_requests=n)
    out = []
    for r in build_workload(after):
        ids = tuple(h + WARMUP_HASH_OFFSET for h in r.hash_ids)
        prompt = scaled_prompt(ids, len(r.hash_ids) * TRACE_BLOCK_TOKENS, r.block_tokens,
                               cfg.vocab_size, cfg.reserved_tokens)[:len(r.prompt)]
        out.append(replace(r, prompt=tuple(int(t) for t in prompt), hash_ids=ids))
    return out


def shared_prefix_tokens(reqs: list[ReplayRequest]) -> list[int]:
    """Per request: prompt tokens it shares with some earlier request of the
    replay (its longest run of leading hash ids seen before),
    capped at prompt length - 1 (the last token is always computed).  This is
    the most any cache can give it."""
    # Trace hash ids are chained (an id stands for its whole prefix), as the
    # simulator's theoretical_hit_rate assumes too.
    seen: set[int] = set()
    out = []
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        out.append(min(k * r.block_tokens, len(r.prompt) - 1))
        seen.update(r.hash_ids)
    return out


def theoretical_hit_ratio(reqs: list[ReplayRequest]) -> float:
    """Hit ratio (tokens) of an unbounded, instant cache on the scaled slice
    (the simulator's definition, applied at the scaled block size)."""
    scaled = [TraceRequest(r.index, r.arrival_s, len(r.prompt), r.max_tokens, r.hash_ids)
              for r in reqs]
    return theoretical_hit_rate(scaled, block_size=reqs[0].block_tokens) if reqs else 0.0
