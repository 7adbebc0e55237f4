"""Decode-side pricing: the TBT a request would see on each decode node.

A reply's mean token interval, as a client scores it, from the decode
node's predicted step at the load it will have when the request joins,
scaled by the learned TBT log-ratio, plus the hand-off of its first
interval and, on a colocated node, the prefill chunks interleaved between
steps.  As for prefill, the choice reads the residuals' medians (the
decode node with the least typical TBT is the request's) and admission
their admission quantile (that node's bound is what the SLO is checked
against).  A colocated node that prefills a request decodes it too while
its TBT there is admitted: the local route moves no KV.  A mixin
of Scheduler (scheduler.py), which holds the residual models
(``tbt_residuals``, ``handoff_residuals``) and ``load_level()`` these
methods read; nothing here blocks, sleeps or does I/O.
"""
from __future__ import annotations

import math

from .nodes import NodeBookings
from .state import DecodeNodeState, ScheduleRequest


class DecodePricing(NodeBookings):
    def select_decode(self, req: ScheduleRequest, now: float | None = None,
                      join_in_s: float = 0.0) -> tuple[DecodeNodeState | None, float]:
        """The decode node with the least predicted TBT (``_decode_choice``)
        and that TBT."""
        best, tbt, _, _ = self._decode_choice(req, now, join_in_s, None)
        return best, tbt

    def tbt_ratio(self, node: str, now: float, level: int | None = None,
                  typical: bool = False) -> float:
        """What the node's predicted step is scaled by at admission:
        exp(admit_quantile of its TBT log-ratio residuals); 1 with none.
        ``typical``: by their median instead (what the choice reads)."""
        lvl = self.load_level() if level is None else level
        r = self.tbt_residuals
        return math.exp(r.median(node, lvl, now) if typical else r.bound(node, lvl, now))

    @staticmethod
    def handoff_key(decode_node: str, prefill_node: str | None) -> str:
        """Hand-offs are learned per decode node and per kind: from its own
        prefill (a colocated node starts decoding as it samples the first
        token) or from another node's (a round trip through the conductor)."""
        return f"{decode_node}~local" if decode_node == prefill_node else decode_node

    def handoff_s(self, node: str, now: float, level: int | None = None,
                  prefill_node: str | None = None, typical: bool = False) -> float:
        """What a reply's first interval takes beyond a step on decode node
        ``node`` after a prefill on ``prefill_node``, at admission: the
        admit-quantile of those hand-off residuals (0 with none; never below
        0, a hand-off cannot be quicker than no hand-off).  ``typical``:
        their median (what the choice reads)."""
        lvl = self.load_level() if level is None else level
        key = self.handoff_key(node, prefill_node)
        r = self.handoff_residuals
        return max(0.0, r.median(key, lvl, now) if typical else r.bound(key, lvl, now))

    def _interleaved_prefill_s(self, node: str, now: float, join_in_s: float, step_s: float,
                               output_tokens: int) -> float:
        """What prefill chunks add to the mean token interval of a reply of
        ``output_tokens`` joining colocated ``node`` in ``join_in_s``: the
        node alternates a step and a chunk while prefill work is queued, so
        the first queue / chunk intervals (at most all of them) each hold a
        chunk.  0 on a node that does not prefill."""
        p = self.prefill.get(node)
        chunk = self.chunk_s(node, step_s)
        if p is None or not p.alive or chunk <= 0:
            return 0.0
        share = chunk / (chunk + step_s) if step_s > 0 else 1.0
        queued = p.queue_time(now, self.progress_fn(node, now=now)) - join_in_s * share
        intervals = max(1, output_tokens - 1)
        return chunk * min(intervals, max(0.0, queued) / chunk) / intervals

    @staticmethod
    def mean_interval(step_s: float, ratio: float, handoff_s: float, output_tokens: int) -> float:
        """The mean token interval (the TBT a client scores a reply by) of a
        reply of ``output_tokens``: its first interval is a step plus the
        hand-off, the others a step each scaled by the learned ``ratio``.  A
        long reply's TBT is its steps'; a short reply's mostly its hand-off."""
        intervals = max(1, output_tokens - 1)
        return (step_s + handoff_s + (intervals - 1) * step_s * ratio) / intervals

    def _decode_choice(self, req: ScheduleRequest, now: float | None = None, join_in_s: float = 0.0,
                       prefill_node: str | None = None
                       ) -> tuple[DecodeNodeState | None, float, float, float]:
        """The prefill node itself when it decodes too and admits the
        request's TBT there (the local route: no KV crosses the network);
        else the least typical TBT among live decode nodes with pages for the
        request: (node, the mean interval of its reply from the model's
        interval scaled by the node's learned ``tbt_ratio`` plus its
        hand-off, both at the admission quantile, the model's step, the
        prefill chunks it adds per interval on a colocated node; the model's
        interval is the sum of the last two).  The node is chosen on the
        same interval at the residuals' medians.

        With `now`, TBT is predicted from the load each node will have when
        the request joins it, `join_in_s` (its predicted TTFT) from now; the
        paper's prediction-based early rejection. Without, from the current
        batch plus this request.
        """
        tokens = req.prompt_tokens + req.expected_output_tokens
        best, best_tbt, best_step, best_chunks = None, math.inf, math.inf, 0.0
        best_typical = math.inf
        for d in self.decode.values():
            chunks = 0.0
            if not d.alive or not d.accepting or d.free_pages < d.pages_for(tokens):
                continue
            if now is None:
                tbt = self.decode_est.seconds(d.batch_size + 1, d.context_tokens + tokens)
            elif self.config.reject_on_current_load:
                load = self.current_decode_load(d.node_id)
                tbt = self.decode_est.seconds(load.batch + 1,
                                              load.context_tokens + req.prompt_tokens + 1)
            else:
                tbt = self._tbt_at_join(d.node_id, now + join_in_s, req.prompt_tokens)
                chunks = self._interleaved_prefill_s(d.node_id, now, join_in_s, tbt,
                                                     req.expected_output_tokens)
            if now is None:
                scaled = typical = tbt
            else:
                scaled, typical = (self.mean_interval(
                    tbt + chunks, self.tbt_ratio(d.node_id, now, typical=median),
                    self.handoff_s(d.node_id, now, prefill_node=prefill_node, typical=median),
                    req.expected_output_tokens) for median in (False, True))
            if now is not None and d.node_id == prefill_node and (
                    scaled <= self.config.tbt_slo_s or req.expected_output_tokens <= 1):
                # The node that prefills the request decodes it when its TBT
                # is admitted there: another node's decode adds a reservation
                # round trip and the whole prompt's KV stream to the TTFT and
                # to both nodes' cores, and saves nothing the SLO scores.
                return d, scaled, tbt, chunks
            if typical < best_typical:
                best, best_tbt, best_step, best_chunks = d, scaled, tbt, chunks
                best_typical = typical
        return best, best_tbt, best_step, best_chunks
