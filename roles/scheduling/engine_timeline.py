"""When a request sent to an engine now would start its prefill: the engine's
next seconds played forward.

An engine such as vLLM runs steps.  Each step advances every running
request's decode by one token and, with what is left of its token budget,
the prefill of the oldest requests it has started (chunked prefill); a
waiting request starts, in arrival order, only once the KV cache has free
blocks for it, and one that does not fit holds back those behind it.  So
two things a FIFO sum of prefill work misses decide when a new request
starts:

- a running request frees its blocks only after its remaining tokens, and
  while the engine prefills, each of its tokens waits for a prefill chunk:
  on a full cache, queued long prompts slow the decodes that would make
  room for them;
- a decode step is part of every step while requests decode, prefill
  steps included.

The model: the prefills the engine has started run one after another at the
prefill model's speed, each plus one decode step when requests decode beside
it, which advances each of them one token (a prompt of the budget's size or
less is one chunk; longer ones advance decodes more, which this leaves out);
a prefill that shares the step of the one before it adds its own work and
no decode step;
with no prefill to run, the engine decodes until a running request finishes
and frees its blocks; a waiting request starts as soon as the blocks free
(not held by running or started requests) cover its need, the oldest first.
A request that needs more than the whole cache starts once nothing else
runs (the engine then runs it alone).  Without a known cache size nothing
waits for room.

Pure arithmetic over seconds from now: nothing here reads a clock.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Decoding:
    """A request past its first token: the blocks it holds until it ends."""

    blocks: int
    tokens_left: int


@dataclass
class Queued:
    """A request not yet past its prefill, in arrival order.

    ``prefill_s``: its prefill work left; ``need_blocks``: free blocks it
    takes to start; ``hold_blocks``: what it holds once started, until it
    ends; ``output_tokens``: tokens it generates (>= 1, the first included);
    ``shares_step``: it is prefilled in the step of the request before it
    (its ``prefill_s`` is what it adds to that step), which carries the
    step's decode step once for both.
    """

    prefill_s: float
    need_blocks: int
    hold_blocks: int
    output_tokens: int
    shares_step: bool = False


def start_after_s(capacity_blocks: int | None, decoding: list[Decoding], queued: list[Queued],
                  need_blocks: int, step_s: float) -> float:
    """Seconds until a request needing ``need_blocks`` free blocks, queued
    behind ``queued``, starts its prefill at an engine running ``decoding``
    with decode steps of ``step_s`` (see the module's model).  The lists are
    not changed."""
    running = [Decoding(d.blocks, max(1, d.tokens_left)) for d in decoding]
    waiting = [Queued(q.prefill_s, q.need_blocks, q.hold_blocks, q.output_tokens, q.shares_step)
               for q in queued]
    started: list[Queued] = []
    t = 0.0
    while True:
        held = sum(d.blocks for d in running) + sum(q.hold_blocks for q in started)
        # Start the waiting requests the free blocks cover, oldest first.
        while waiting and (capacity_blocks is None
                           or held + waiting[0].need_blocks <= capacity_blocks
                           or (not running and not started)):
            q = waiting.pop(0)
            started.append(q)
            held += q.hold_blocks
        if not waiting and (capacity_blocks is None or held + need_blocks <= capacity_blocks
                            or (not running and not started)):
            # Its turn to start has come; the prefills started before it run first.
            decodes = bool(running)
            for q in started:
                t += q.prefill_s + (step_s if decodes and not q.shares_step else 0.0)
                decodes = decodes or q.output_tokens > 1
            return t
        if started:
            q = started.pop(0)
            t += q.prefill_s + (step_s if running and not q.shares_step else 0.0)
            running = _advance(running, 1)
            if q.output_tokens > 1:
                running.append(Decoding(q.hold_blocks, q.output_tokens - 1))
            continue
        # Nothing to prefill and the oldest waiting request does not fit:
        # decode until the next running request ends.
        tokens = min(d.tokens_left for d in running)
        t += tokens * step_s
        running = _advance(running, tokens)


def _advance(running: list[Decoding], tokens: int) -> list[Decoding]:
    """The running requests ``tokens`` decode steps later (those done leave)."""
    return [Decoding(d.blocks, d.tokens_left - tokens) for d in running
            if d.tokens_left > tokens]
