"""Bookings and node state: what the scheduler knows of each node.

Membership, the cache index feed, the work booked on each prefill node and
its queue as reports correct it, the decode load projected to when a request
joins, and the work of a colocated node's prefill between its decode steps;
the progress of a prefill node that borrows decode cores is yielding.py's.
A mixin of Scheduler (scheduler.py), which holds the state
these methods read; nothing here blocks, sleeps or does I/O.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable

from . import borrowed
from .estimators import PrefillEstimator
from .yielding import YieldingPrefill
from .state import (DecodeLoad, DecodeNodeState, NodeReport, PrefillNodeState, Progress,
                    wall_progress)

# Steps counted between two instants are (t1 - t0) / step; this keeps a
# whole number of steps (2.5 s at 0.1 s) from rounding down to one fewer.
_STEP_EPS = 1e-9
# Finished prefills remembered per node, to recognise them in a report taken before.
RECENTLY_DONE_KEPT = 256
# Rounds of "project the load at this step time, predict the step time".
DECODE_FIXED_POINT_ROUNDS = 4
# Per prefill node: the last (predicted queue, measured batched-behind)
# pairs the batch-wait slope is fitted on (Scheduler.batch_wait_s).
BATCH_WAIT_SAMPLES = 64


class NodeBookings(YieldingPrefill):
    """Scheduler's per-node accounting (see the module docstring)."""

    # ---- membership ---------------------------------------------------
    def add_prefill_node(self, node: str, cache_capacity_blocks: int = 0,
                         yields_to: tuple[str, ...] = (), interleave_tokens: int = 0,
                         interleave_step_ratio: float = 0.0) -> None:
        """``yields_to``: decode nodes whose cores it borrows at idle
        priority (it computes only while they leave one idle).
        ``interleave_*``: a colocated node's prefill chunks while it decodes
        (see ``chunk_s``)."""
        self.prefill[node] = PrefillNodeState(node, cache_capacity_blocks=cache_capacity_blocks,
                                              yields_to=tuple(yields_to),
                                              interleave_tokens=interleave_tokens,
                                              interleave_step_ratio=interleave_step_ratio)
        self._outstanding.setdefault(node, 0)
        if self.config.per_node_prefill_fit and node not in self.node_estimators:
            # A node that comes back keeps what it had learned of itself.
            self.node_estimators[node] = self.prefill_est.fork()

    def add_prefill_group(self, group: str, members: tuple[str, ...],
                          estimator: PrefillEstimator, cache_capacity_blocks: int = 0) -> None:
        """A Chunked Pipeline Parallelism group scheduled as one prefill instance
        with its own estimator (pipeline fill + steady state)."""
        self.prefill[group] = PrefillNodeState(group, cache_capacity_blocks=cache_capacity_blocks,
                                               group_members=tuple(members))
        self._outstanding.setdefault(group, 0)
        self.node_estimators[group] = estimator

    def estimator_for(self, node: str | None) -> PrefillEstimator:
        """The estimator that prices ``node``: its own fit once it has one,
        else the cluster-wide fit.  Until then its own copy would price it
        at whatever the cluster knew when it joined (at start, the prior):
        a node priced slower than the rest is not chosen, and so would never
        gather the samples that correct its price."""
        own = self.node_estimators.get(node) if node else None
        return own if own is not None and own.fitted_since_fork() else self.prefill_est

    def add_decode_node(self, node: str, page_budget: int, page_tokens: int) -> None:
        self.decode[node] = DecodeNodeState(node, page_budget, page_tokens)

    def mark_dead(self, node: str) -> None:
        """A dead node takes no work and its cache leaves the index."""
        if node in self.prefill:
            self.prefill[node].alive = False
        if node in self.decode:
            self.decode[node].alive = False
        self.index.remove_node(node)

    # ---- cache index feed ---------------------------------------------
    def on_events(self, node: str, seq: int, stored: Iterable[int],
                  evicted: Iterable[int]) -> bool:
        """Apply a shard's event batch; False means: ask the node to resync."""
        return self.index.apply_events(node, seq, stored, evicted)

    def on_blocks_ahead(self, node: str, seq: int, keys: Iterable[int]) -> bool:
        """Blocks a finished prefill stored, from its reply, ahead of the
        event batch ``seq`` that reports them (GlobalCacheIndex.add_ahead)."""
        return self.index.add_ahead(node, seq, keys)

    def resync(self, node: str, keys: Iterable[int], next_seq: int | None = None) -> None:
        self.index.resync(node, keys, next_seq)

    def chunk_s(self, node: str, step_s: float | None = None) -> float:
        """Seconds a colocated node's prefill holds its compute thread
        between two decode steps of ``step_s`` seconds: its chunk of
        ``interleave_tokens``, or, where it gives way to waiting steps
        (``interleave_step_ratio``, WorkerNode.give_way), that many
        steps' time if less; the whole chunk without a step.  0 for a node
        that is not colocated."""
        p = self.prefill.get(node)
        if p is None or not p.interleave_tokens:
            return 0.0
        chunk = max(0.0, self.estimator_for(node).seconds(p.interleave_tokens, 0))
        if not step_s or step_s <= 0 or p.interleave_step_ratio <= 0:
            return chunk
        return min(chunk, p.interleave_step_ratio * step_s)

    def interleave(self, node: str) -> tuple[float, float]:
        """A colocated node that is decoding alternates one prefill chunk and
        one decode step on its compute thread: (the chunk's seconds, the
        step's); (0, 0) when ``node`` is not colocated or not decoding."""
        d, p = self.decode.get(node), self.prefill.get(node)
        if d is None or p is None or not p.interleave_tokens or d.batch_size <= 0:
            return 0.0, 0.0
        # The chunk is sized by the step's compute (the model's, for the
        # running batch), not by the reported spacing, which holds chunks.
        chunk = self.chunk_s(node, self.decode_est.seconds(d.batch_size, d.context_tokens))
        return (chunk, self.step_seconds(node)) if chunk > 0 else (0.0, 0.0)

    def modelled_prefill_share(self, node: str) -> float:
        """The cost model's share of wall time a prefill gets on ``node``
        while the node decodes: 1, or on a colocated node that is decoding
        chunk / (chunk + step) (for as long as its decode steps:
        ``own_decode_busy``)."""
        chunk, step = self.interleave(node)
        return chunk / (chunk + step) if chunk > 0 and step > 0 else 1.0

    def own_decode_busy(self, node: str) -> list[borrowed.Interval]:
        """When colocated ``node``'s own decode is predicted to be stepping
        (``decode_busy``): the stretches in which its prefills get
        ``prefill_share`` of its compute thread, all of it outside them.
        Empty for a node that is not colocated."""
        p = self.prefill.get(node)
        if p is None or not p.interleave_tokens or node not in self.decode:
            return []
        return self.decode_busy(node)

    def prefill_wall_s(self, node: str, start: float, work: float, share: float,
                       busy: list[borrowed.Interval] | None = None) -> float:
        """Wall seconds from ``start`` for ``work`` seconds of prefill on a
        node that is not yielding, at ``share`` of the thread while its own
        decode steps (``own_decode_busy``, or ``busy``)."""
        if share >= 1.0 or work <= 0:
            return max(0.0, work)
        spans = self.own_decode_busy(node) if busy is None else busy
        return borrowed.wall_for(spans, start, work, busy_rate=share)

    def prefill_share(self, node: str, now: float | None = None) -> float:
        """The share of wall time a prefill gets on ``node`` while the node
        decodes: the modelled share, and where that is below 1 (a colocated
        node that is decoding) corrected by the median share residual of the
        node's prefills at ``now`` (``share_residuals``: log(modelled /
        measured share), where a prefill's measured share is its compute
        over its compute and the decode steps it gave way to).  The model
        alone when ``now`` is None."""
        share = self.modelled_prefill_share(node)
        if share >= 1.0 or now is None:
            return share
        return min(1.0, share * math.exp(-self.share_residuals.median(node, None, now)))

    def start_waits_s(self, node: str, level: int | None, now: float) -> float:
        """What a request booked on ``node`` at ``now`` will wait for the
        node's compute thread beside the work queued there: one prefill's
        wait for each prefill booked there that has not started (by a report,
        or by its predicted start) and one for its own, each the median wait
        the node's prefills measured at load ``level`` (``start_waits``; 0
        until learned).  On a colocated node that is the decode steps queued
        on the thread ahead of a prefill's chunks, which neither the
        prefills' work nor their share of the thread (the steps run inside
        them) holds: while the node decodes, every prefill ahead adds one."""
        wait = self.start_waits.median(node, level, now)
        state = self.prefill.get(node)
        if wait <= 0 or state is None:
            return 0.0
        waiting = sum(1 for p in state.pending.values() if p.started_at is None
                      and (p.expected_start is None or p.expected_start > now))
        return wait * (waiting + 1)

    def progress_fn(self, node: str, busy: list[borrowed.Interval] | None = None,
                    now: float | None = None) -> Progress:
        """Work ``node`` does between two instants (see PrefillNodeState.queue_time):
        for a yielding node, the gaps of its decode nodes' busy intervals at
        its learned ``yield_share`` (as of ``now``; unscaled when None); for
        a colocated node that is decoding, its ``prefill_share`` of them."""
        if not self.yields(node):
            share = self.prefill_share(node, now)
            if share >= 1.0:
                return wall_progress
            spans = self.own_decode_busy(node) if busy is None else busy
            return lambda start, end: borrowed.progress(spans, start, end, busy_rate=share)
        spans = self.yielded_busy(node) if busy is None else busy
        share = 1.0 if now is None else self.yield_share(node, now)
        return lambda start, end: share * borrowed.progress(spans, start, end)

    def step_seconds(self, node: str) -> float:
        """The decode node's step time as last measured (its reported TBT),
        else the estimator's for its current batch: the pace at which its
        running sequences are expected to finish."""
        d = self.decode[node]
        if d.recent_tbt_s > 0:
            return d.recent_tbt_s
        return self.decode_est.seconds(max(1, d.batch_size), d.context_tokens) or 1e-3

    def predict_decode_load(self, node: str, at: float,
                            step_s: float | None = None) -> DecodeLoad:
        """Batch size and context tokens of a decode node at time `at`.

        Every sequence decodes one token per step of `step_s` seconds
        (default `step_seconds`). A sequence the node reported (as of
        `running_at`) is still in the batch at `at` if it has tokens left
        to generate by then; a booked request not in the report joins at
        its predicted join time, or at the report's time if that report
        came later and did not name it (it is late, not gone), and stays
        for its `output_tokens - 1` decode steps. Context grows by one
        token per step.
        """
        d = self.decode[node]
        step = step_s if step_s is not None else self.step_seconds(node)
        step = max(step, 1e-9)
        batch = context = 0
        running = d.running or {}
        for seq in running.values():
            steps = max(0.0, at - d.running_at) / step + _STEP_EPS
            if seq.remaining_tokens > steps:
                batch += 1
                context += seq.context_tokens + int(steps)
        for rid, b in d.booked.items():
            if rid in running:
                continue
            join = max(b.join_at, d.running_at) if d.running is not None else b.join_at
            if join > at:
                continue
            steps = (at - join) / step + _STEP_EPS
            if b.output_tokens - 1 > steps:
                batch += 1
                context += b.prompt_tokens + int(steps)
        return DecodeLoad(batch, context)

    def current_decode_load(self, node: str) -> DecodeLoad:
        """The decode node's load as it last reported it, less the sequences
        finished since: what "reject on current load" sees. Requests booked
        to it and not in a report yet are not counted."""
        running = self.decode[node].running or {}
        return DecodeLoad(len(running), sum(s.context_tokens for s in running.values()))

    def _tbt_at_join(self, node: str, at: float, prompt_tokens: int) -> float:
        """Predicted step time once a request of `prompt_tokens` joins `node` at `at`.

        Sequences are projected at the measured step time, but a batch that
        grows also slows down and so keeps its sequences longer: the step
        time is raised to the predicted one and the load projected again
        until the two agree (monotone, so a few rounds reach the fixed point).
        """
        step = self.step_seconds(node)
        tbt = step
        for _ in range(DECODE_FIXED_POINT_ROUNDS):
            load = self.predict_decode_load(node, at, step)
            tbt = self.decode_est.seconds(load.batch + 1, load.context_tokens + prompt_tokens + 1)
            if tbt <= step * 1.01:
                break
            step = tbt
        return tbt

    # ---- what the nodes report -----------------------------------------
    def on_prefill_started(self, node: str, request_id: str, now: float) -> None:
        p = self.prefill[node].pending.get(request_id)
        if p is not None:
            p.started_at = now

    def batch_wait_s(self, node: str, t_queue_s: float) -> float:
        """What a request predicted to wait ``t_queue_s`` in ``node``'s queue
        is expected to wait beyond its queue and its own prefill: the work of
        the requests that join its batched pass meanwhile (a pass ends for
        all its requests at once).

        Learned per node as slope x queue: what arrives while a request
        waits grows with the wait.  Seen on a trace of short chats at 4x its
        rate: requests that waited 80 ms or more then waited 11-16 ms more
        (median) for the requests behind them in their pass, 0.10-0.17 x
        their queue, while those that hardly waited met none; on a trace of
        long prompts (not batched) it stays near 0."""
        if t_queue_s <= 0:
            return 0.0
        return self._batch_wait_slope.get(node, 0.0) * t_queue_s

    def _learn_batch_wait(self, node: str, t_queue_s: float, behind_s: float) -> None:
        """One sample of batch_wait_s's slope: the least-absolute-error line
        through 0 over the node's recent samples, i.e. the median of
        behind / queue weighted by the queue (a request that hardly waited
        says little about the slope)."""
        if t_queue_s <= 0:
            return
        samples = self._batch_waits.setdefault(node, deque(maxlen=BATCH_WAIT_SAMPLES))
        samples.append((t_queue_s, max(0.0, behind_s)))
        ratios = sorted((b / q, q) for q, b in samples)
        half, seen = sum(q for q, _ in samples) / 2.0, 0.0
        for ratio, weight in ratios:
            seen += weight
            if seen >= half:
                self._batch_wait_slope[node] = ratio
                break

    def on_transfer_finished(self, source: str, nbytes: int, seconds: float) -> None:
        self.transfer_est.observe(source, nbytes, seconds)

    def on_node_report(self, node: str, report: NodeReport, now: float) -> None:
        """Heartbeat: replace our estimate of the node's load by its own."""
        if node in self.prefill and self.config.queue_from_bookings \
                and report.prefill_requests is not None:
            s = self.prefill[node]
            named = report.prefill_requests
            running = report.prefill_running_s or {}
            worked = (report.prefill_worked_s or {}) if self.yields(node) else {}
            if self.yields(node):
                self._learn_yield_share(node, report, now)
            for rid, p in s.pending.items():
                p.in_report = rid in named
                if rid in worked:
                    # It has done this much of its work; what it does from
                    # here depends on when the decode nodes let it run.
                    p.started_at, p.worked_before_s = report.at, max(0.0, worked[rid])
                elif rid in running:
                    p.started_at = report.at - max(0.0, running[rid])
            # A running request counts what is left of its estimate: counted
            # whole, every report restarted it and a long prefill made the
            # queue look up to its full length too long for its whole run.
            ours = sum(p.remaining_s(report.at) for p in s.pending.values() if p.in_report)
            # Named requests of ours whose answer came after the report was
            # taken are done, not someone else's: only a request this
            # scheduler never booked (another conductor's) calls for the
            # node's own figure, which prices tokens at a rate that short
            # prompts drag down (a fixed cost per request).
            foreign = named - s.pending.keys() - s.recently_done.keys()
            if not foreign or report.queued_prefill_s is None:
                s.reported_queue_s = ours
            else:
                s.reported_queue_s = max(ours, report.queued_prefill_s)
            s.reported_at = report.at
        elif node in self.prefill and report.queued_prefill_s is not None:
            s = self.prefill[node]
            s.reported_queue_s, s.reported_at = report.queued_prefill_s, report.at
            if report.prefill_requests is not None:
                # The node says which requests its figure holds: every other
                # booking (not delivered yet, e.g. still waiting for its decode
                # reservation) stays counted until a report covers it.
                s.pending = {r: p for r, p in s.pending.items()
                             if r not in report.prefill_requests}
            else:
                # No ids: work booked before the report counts as in the figure.
                s.pending = {r: p for r, p in s.pending.items() if p.sent_at > report.at}
        d = self.decode.get(node)
        if d is not None:
            if report.batch_size is not None:
                d.batch_size = report.batch_size
            if report.context_tokens is not None:
                d.context_tokens = report.context_tokens
            if report.free_pages is not None:
                d.free_pages = report.free_pages
            if report.decode_sequences is not None:
                # The node's word replaces ours: a sequence it no longer
                # names has finished there (or not joined yet: then its
                # booking counts it).
                d.running = dict(report.decode_sequences)
                d.running_at = report.at
            if report.decode_steps and max(st.step for st in report.decode_steps) \
                    < d.last_step_seen:
                d.last_step_seen = -1  # the node restarted its step counter
            new_steps = [st for st in report.decode_steps if st.step > d.last_step_seen]
            for st in new_steps:
                # Fit the TBT model on the steps the node measured.
                self.decode_est.observe(st.batch, st.context_tokens, st.seconds)
                d.last_step_seen = max(d.last_step_seen, st.step)
            if report.recent_tbt_s is not None:
                d.recent_tbt_s = report.recent_tbt_s
                # No per-step figures: calibrate on the node's recent TBT.
                if report.batch_size and not report.decode_steps:
                    self.decode_est.observe(report.batch_size, report.context_tokens or 0,
                                            report.recent_tbt_s)
