"""What the scheduler learns from what happened: the feedback half of Scheduler.

When a prefill finishes the prefill estimators are refitted on what the
node measured and the TTFT residual (measured TTFT less the cost model's)
is added to the residual model; when a reply finishes decoding its token
intervals teach the TBT and hand-off residuals, and whether it met both
SLOs steers the admission quantile.  A mixin of Scheduler (scheduler.py),
which holds the state these methods update; nothing here blocks, sleeps or
does I/O: ``now`` is always an argument.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .attainment import met_slos
from .decode_pricing import DecodePricing
from .nodes import RECENTLY_DONE_KEPT
from .residuals import ResidualStats, log_ratio
from .state import Decision, ScheduleRequest

# Finished prefills remembered per colocated node (OutcomeLearning._chunks_between).
PREFILLS_DONE_KEPT = 512


@dataclass
class Inflight:
    """A request the scheduler placed, from its decision until it leaves decode."""

    decision: Decision
    req: ScheduleRequest
    scheduled_at: float
    ttft_model_s: float = 0.0  # the cost model's TTFT, before the residual
    load_level: int = 0        # Scheduler.load_level when it was scheduled
    tbt_model_s: float = 0.0   # the decode model's step, before the residual
    # What prefill chunks were predicted to add to each of its intervals (a
    # colocated decode node); what they did add is counted at its finish.
    tbt_chunks_s: float = 0.0
    first_token_at: float | None = None   # when its prefill finished
    ttft_s: float | None = None           # its TTFT as measured
    # Its prediction, or that of work booked ahead of it, came from an
    # estimator no measurement had refitted yet (the built-in guess or a
    # profile): its error says how wrong that prior was, not how far the
    # fitted predictions stray, so it gets no weight in the residual model.
    priced_by_prior: bool = False
    # The modelled share of its prefill node's compute thread when it was
    # booked (1: the node was not decoding, or yields its cores).
    modelled_share: float = 1.0



class OutcomeLearning(DecodePricing):
    def on_prefill_finished(self, node: str, request_id: str, now: float,
                            actual_seconds: float,
                            actual_prefix_tokens: int | None = None,
                            actual_queue_s: float | None = None,
                            actual_work_s: float | None = None,
                            actual_batched_ahead_s: float = 0.0,
                            actual_batched_behind_s: float | None = None,
                            actual_ttft_s: float | None = None,
                            actual_gave_way_s: float | None = None,
                            actual_thread_wait_s: float | None = None) -> None:
        """Prefill done (first token out): refit, and record the TTFT
        residual (measured minus the cost model's TTFT).

        `actual_ttft_s`: the request's measured TTFT, when the caller counts
        it from earlier than the decision (the HTTP conductor: from the
        request's arrival, before its body was read and tokenized); None:
        from the decision to ``now``.

        `actual_queue_s`, `actual_batched_ahead_s`: what the node measured
        of the request's wait in its queue and in a batched pass behind the
        requests ahead of it; accepted for the callers' sake, learned from by
        nothing here (the residual is the whole TTFT's).

        `actual_work_s`, the CPU seconds its compute took: what a node that
        yields its cores (``yields_to``) is fitted on, since its wall time
        holds whatever the decode nodes ran meanwhile.

        `actual_batched_behind_s`: the part spent on the requests behind it
        in the pass (0: none; None: not measured, nothing learned): what
        batch_wait_s is fitted on.

        `actual_gave_way_s`: the decode steps a colocated node ran inside
        the prefill (None: not measured).  Booked while the node decoded,
        the prefill's measured share of the thread (its compute over its
        compute and those steps) teaches the share residuals (prefill_share).
        Its wait for the step on the thread when it began is not part of it:
        that does not grow with the prefill's length.

        `actual_thread_wait_s`: that wait, what the node measured between
        submitting the prefill's chunks to the thread and their compute
        starting (None: not measured); it teaches ``start_waits``
        (NodeBookings.start_waits_s).

        `actual_seconds <= 0` means "no measurement" (cancelled or failed
        prefill): the booking is released but nothing is learned from it.
        """
        done = None
        if node in self.prefill:
            st = self.prefill[node]
            done = st.pending.pop(request_id, None)
            if done is not None:
                st.recently_done[request_id] = None
                while len(st.recently_done) > RECENTLY_DONE_KEPT:
                    del st.recently_done[next(iter(st.recently_done))]
            if done is not None and done.in_report:
                # The node moves on to the next named request now: what is
                # left of the reported work is the rest of the named ones.
                progress = self.progress_fn(node, now=now)
                st.reported_queue_s = sum(p.remaining_s(now, progress=progress)
                                          for p in st.pending.values() if p.in_report)
                st.reported_at = now
        self._outstanding[node] = max(0, self._outstanding.get(node, 0) - 1)
        inf = self.inflight.get(request_id)
        if inf is not None:
            inf.first_token_at = now
        if actual_seconds > 0 and self.chunk_s(node) > 0:
            # A colocated node's prefill ran between its decode steps: what
            # the replies decoding there meanwhile waited on (_chunks_between;
            # appended in time order).
            self._prefills_done.setdefault(node, deque(maxlen=PREFILLS_DONE_KEPT)).append(
                (now, actual_seconds, request_id))
        if inf is None or actual_seconds <= 0:
            return
        # Fit on what happened: the prefix the node really reused (a failed
        # fetch or an eviction makes it shorter than planned), not the plan.
        prefix = inf.decision.prefix_tokens if actual_prefix_tokens is None \
            else actual_prefix_tokens
        fitted = actual_seconds
        if node in self.prefill and self.yields(node) and actual_work_s is not None \
                and actual_work_s > 0:
            fitted = actual_work_s
        if done is not None and done.estimate_s > 0:
            # What a late request's rest is read from (late_rest_s).
            self.prefill[node].late_ratios.append(fitted / done.estimate_s)
        own = self.node_estimators.get(node)
        if own is not None:
            own.observe(inf.req.prompt_tokens, prefix, fitted)
        # A node's own fit also feeds the cluster-wide one (what prices a node
        # without its own fit yet); a CPP group's pipeline times are not a node's.
        group = node in self.prefill and self.prefill[node].group_members
        if own is None or not group:
            self.prefill_est.observe(inf.req.prompt_tokens, prefix, fitted)
        if actual_batched_behind_s is not None and node in self.prefill:
            self._learn_batch_wait(node, inf.decision.t_queue, actual_batched_behind_s)
        if actual_thread_wait_s is not None and actual_thread_wait_s >= 0:
            self.start_waits.add(node, inf.load_level, actual_thread_wait_s, now)
        if actual_gave_way_s is not None and inf.modelled_share < 1.0:
            held = actual_seconds + max(0.0, actual_gave_way_s)
            residual = log_ratio(inf.modelled_share, actual_seconds / held)
            if residual is not None:
                self.share_residuals.add(node, None, residual, now)
        actual_ttft = now - inf.scheduled_at + inf.req.waited_s if actual_ttft_s is None \
            else actual_ttft_s
        inf.ttft_s = actual_ttft
        error = inf.decision.predicted_ttft_s - actual_ttft
        self.ttft_errors.append(error)
        # What the cost model missed for this request; a prior's miss says
        # nothing of the fitted model and gets no weight.
        self.ttft_residuals.add(node, inf.load_level, actual_ttft - inf.ttft_model_s, now,
                                priced_by_prior=inf.priced_by_prior)
        self._ttft_error_count += 1
        self._ttft_error_sum += error
        self._ttft_error_abs_sum += abs(error)

    def residual_stats(self, now: float) -> dict[str, dict[str, ResidualStats]]:
        """The residual model's windows at ``now`` (for status pages)."""
        return {"ttft_s": self.ttft_residuals.stats(now),
                "tbt_log_ratio": self.tbt_residuals.stats(now),
                "handoff_s": self.handoff_residuals.stats(now),
                "prefill_share_log_ratio": self.share_residuals.stats(now),
                "prefill_start_wait_s": self.start_waits.stats(now)}

    def on_decode_finished(self, node: str, request_id: str, now: float,
                           token_intervals: Sequence[float] | None = None) -> None:
        """The request left decode node ``node``; ``token_intervals``: the
        intervals between its tokens as the client got them, when it
        streamed to the end.  The first (the hand-off from prefill to decode)
        teaches the hand-off residuals, in seconds beyond the predicted
        step; the mean of the others the TBT residuals, as a log-ratio."""
        inf = self.inflight.pop(request_id, None)
        if inf is not None and inf.req.block_keys:
            first = inf.req.block_keys[0]
            same = self._inflight_by_first_block.get(first)
            if same is not None:
                same.discard(request_id)
                if not same:
                    del self._inflight_by_first_block[first]
        if token_intervals and inf is not None and inf.decision.decode_node == node:
            # The model's interval: the step, plus the chunks of the prefills
            # that did run on the node while the reply decoded (predicted
            # ones where that is unknown), so the residual is the step's miss
            # and not prefill work that came after the request was priced.
            chunks = inf.tbt_chunks_s if inf.first_token_at is None else \
                self._chunks_between(node, request_id, inf.first_token_at, now,
                                     len(token_intervals))
            step = inf.tbt_model_s + chunks
            if math.isfinite(step):
                key = self.handoff_key(node, inf.decision.prefill_node)
                self.handoff_residuals.add(key, inf.load_level, token_intervals[0] - step, now)
            rest = token_intervals[1:]
            if rest:
                residual = log_ratio(sum(rest) / len(rest), step)
                if residual is not None:
                    self.tbt_residuals.add(node, inf.load_level, residual, now)
        if token_intervals is not None and inf is not None and inf.ttft_s is not None:
            self._set_admit_quantile(self.admission.observe(met_slos(
                inf.ttft_s, token_intervals, self.config.ttft_slo_s, self.config.tbt_slo_s)))
        d = self.decode.get(node)
        if d is None:
            return
        pages, tokens = d.reserved.pop(request_id, (0, 0))
        d.booked.pop(request_id, None)
        if d.running is not None:
            d.running.pop(request_id, None)  # a report older than the finish may name it
        d.free_pages += pages
        d.batch_size = max(0, d.batch_size - 1)
        d.context_tokens = max(0, d.context_tokens - tokens)

    def _chunks_between(self, node: str, request_id: str, start: float, end: float,
                        intervals: int) -> float:
        """Prefill compute per token interval that colocated ``node`` ran
        between ``start`` and ``end`` for requests other than
        ``request_id`` (each prefill counted when it finished)."""
        done = self._prefills_done.get(node)
        if not done or intervals <= 0:
            return 0.0
        work = 0.0
        for at, seconds, rid in reversed(done):   # newest first: stop before start
            if at <= start:
                break
            if at <= end and rid != request_id:
                work += seconds
        return work / intervals

    def estimator_error(self) -> dict[str, float]:
        """Mean and mean-absolute (predicted - actual) TTFT, seconds."""
        n = self._ttft_error_count
        if not n:
            return {"count": 0, "mean_s": 0.0, "mean_abs_s": 0.0}
        return {"count": n, "mean_s": self._ttft_error_sum / n,
                "mean_abs_s": self._ttft_error_abs_sum / n}
