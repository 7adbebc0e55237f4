"""Load reports (heartbeats) of simulated nodes, as the real nodes compose them.

A report holds only what the node itself can know: its queue (and how long
its running request has computed) and what it measured, never the
simulator's noise-free times. The prefill figure is the real prefill node's
(roles/prefill/service.py `load()`): queued prompt tokens over its measured
rate of computed tokens; the decode figures are the real batcher's
(roles/decode/batcher.py `load()`): the sequences it holds with their
remaining tokens, and its recent measured steps.
"""
from __future__ import annotations

from roles.scheduling import DecodeStep, NodeReport, RunningSeq

from .records import DecodeNode, PrefillNode


def prefill_report(node: PrefillNode, now: float) -> NodeReport:
    """The node's queued prefill seconds as it estimates them, and which requests
    that figure holds (queued, waiting for a pull, or running)."""
    ids = frozenset(r.rid for r in node.queue) | (
        {node.running.rid} if node.running is not None else set())
    # As the real node says it: how long its running request has computed.
    running = {node.running.rid: max(0.0, now - node.running.prefill_start)} \
        if node.running is not None else {}
    if node.tokens_per_s is None:
        # nothing measured yet: no figure, only which requests it holds
        return NodeReport(at=now, queued_prefill_s=None, prefill_requests=ids,
                          prefill_running_s=running)
    # As the real node counts them: whole prompts (the cached prefix too), the
    # running one in full until it is done, over a rate of *computed* tokens.
    # With a high hit rate that overstates the backlog; it is what the
    # conductor is told.
    tokens = sum(r.t.input_length for r in node.queue)
    if node.running is not None:
        tokens += node.running.t.input_length
    return NodeReport(at=now, queued_prefill_s=tokens / node.tokens_per_s,
                      prefill_requests=ids, prefill_running_s=running)


def decode_report(dn: DecodeNode, now: float) -> NodeReport:
    """Batch, context, per-sequence remaining tokens and the last measured steps."""
    seqs = {r.rid: RunningSeq(r.context, r.tokens_left) for r in (*dn.running, *dn.joining)}
    steps = tuple(DecodeStep(*s) for s in dn.recent_steps)
    times = sorted(s[3] for s in dn.recent_steps)
    return NodeReport(at=now, batch_size=len(dn.running), context_tokens=dn.context,
                      recent_tbt_s=times[len(times) // 2] if times else None,
                      decode_sequences=seqs, decode_steps=steps)
