"""What the engine scheduler learns from what its engines did.

The first answer of an engine step refits the engine's prefill model on
the step's time (every request it prefilled, after it could start), and
each request's first token adds its TTFT residual; its finish feeds
the engine's decode model and, with whether it met both SLOs, the admission
quantile; the engine's /metrics say what other clients have there;
``status`` shows what was learned.  A mixin of EngineScheduler
(engines.py), which holds the state these methods update; nothing here
does I/O or reads a clock.
"""
from __future__ import annotations

import dataclasses

from .attainment import met_slos
from .engine_state import EngineRequest, EngineState


class EngineFeedback:
    def _started(self, state: EngineState, request_id: str, now: float) -> EngineRequest | None:
        """Move a request from the queue to decoding at ``now``."""
        req = state.requests.get(request_id)
        if req is None or req.first_token_at is not None:
            return None
        state.queue.pending.pop(request_id, None)
        req.first_token_at = now
        req.tokens_out = max(1, req.tokens_out)
        others = [r for r in state.requests.values() if r is not req]
        req.batch = 1 + state.foreign_running + sum(1 for r in others if r.first_token_at)
        req.context_tokens = req.prompt_tokens + sum(r.prompt_tokens for r in others
                                                     if r.first_token_at)
        return req

    def on_first_token(self, engine: str, request_id: str, now: float) -> None:
        """The first token came back: the first of its engine step's to come
        back measures the step (``_measure_step``), and its TTFT residual is
        recorded."""
        state = self.engines.get(engine)
        req = state.requests.get(request_id) if state else None
        if req is None or request_id not in state.queue.pending:
            return   # not ours, or its first token already came (pending: none yet)
        if not req.step_measured:
            self._measure_step(state, req.step_leader or request_id, now)
        self._started(state, request_id, now)
        actual = req.ttft_s = now - req.sent_at
        errors = self._ttft_errors
        errors[0] += 1
        errors[1] += req.predicted_ttft_s - actual
        errors[2] += abs(req.predicted_ttft_s - actual)
        self.ttft_residuals.add(engine, req.level, actual - req.model_ttft_s, now,
                                priced_by_prior=req.priced_by_prior)

    def _measure_step(self, state: EngineState, leader: str, now: float) -> None:
        """Refit the engine's prefill time on the step led by ``leader``
        (its requests still booked: the leader, if not yet answered, and
        those that joined it), whose first token came back at ``now``.

        The step ran from when it could start (the leader sent, the step
        before it answered: FIFO) until now, and prefilled its requests
        together; a request booked behind other work there paid less of
        its fixed part (``overlap_s``: it overlapped that work).  Each
        request's prefill alone is then its predicted time alone scaled by
        what the step took over what it was predicted to take; the
        requests' own answers, which come back within moments of each
        other, measure nothing more."""
        members = [rid for rid in state.queue.pending
                   if (state.requests[rid].step_leader or rid) == leader
                   and not state.requests[rid].step_measured]
        if not members:
            return
        reqs = [state.requests[rid] for rid in members]
        for r in reqs:
            r.step_measured = True
        first = min(r.sent_at for r in reqs)
        service = now - max(first, state.last_first_token_at)
        state.last_first_token_at = now
        booked = sum(state.queue.pending[rid].estimate_s for rid in members)
        if booked > 0 and not any(r.overlap_s for r in reqs):
            # What a late prefill still needs is judged by how late whole
            # prefills ran: a step booked as marginal work only (its fixed
            # part overlapping work ahead) can run many times its few
            # booked milliseconds, a ratio that would price every late
            # request as seconds of work left.
            state.queue.late_ratios.append(service / booked)
        est = self.estimator_for(state)
        alone = [est.seconds(r.prompt_tokens, r.prefix_tokens) for r in reqs]
        together = sum(t - r.overlap_s for r, t in zip(reqs, alone))
        if service <= 0 or together <= 0:
            return
        # The prefill models learn the speed of an engine beside idle
        # neighbours: the measured time divided by the slowdown learned for
        # the busy level it ran at.  The step also feeds that slowdown,
        # unless the prediction it is compared with is an unfitted prior's.
        busy_level = state.requests[members[0]].busy_level
        slowdown = self.contention.slowdown(state.machine, busy_level, now)
        if est.fitted_since_fork():
            self.contention.add(state.machine, busy_level, service, together, now)
        scale = service / (together * slowdown)
        for r, t in zip(reqs, alone):
            state.prefill_est.observe(r.prompt_tokens, r.prefix_tokens, t * scale)
            self.prefill_est.observe(r.prompt_tokens, r.prefix_tokens, t * scale)

    def on_tokens(self, engine: str, request_id: str, tokens: int) -> None:
        """``tokens`` of the request's output have streamed back: how far
        its decode is, which says when it frees its KV blocks."""
        state = self.engines.get(engine)
        req = state.requests.get(request_id) if state else None
        if req is not None:
            req.tokens_out = tokens

    def on_finished(self, engine: str, request_id: str, now: float,
                    mean_tbt_s: float | None = None, tokens: int = 0,
                    median_tbt_s: float | None = None) -> None:
        """The request ended; ``mean_tbt_s`` / ``median_tbt_s``: the mean and
        the median of its ``tokens``' intervals as streamed, which the
        engine's TBT and bare decode step are fitted on."""
        state = self.engines.get(engine)
        if state is None:
            return
        req = state.requests.get(request_id)
        if req is not None and req.first_token_at is None:
            self._started(state, request_id, now)
        req = state.requests.pop(request_id, None)
        if req is not None and tokens > 0:
            self.recent_outputs.append(tokens)
        if req is not None and mean_tbt_s is not None and mean_tbt_s > 0 and tokens > 1:
            state.decode_est.observe(req.batch, req.context_tokens + tokens // 2, mean_tbt_s)
        if req is not None and median_tbt_s is not None and median_tbt_s > 0 and tokens > 1:
            state.step_est.observe(req.batch, req.context_tokens + tokens // 2, median_tbt_s)
        if req is not None and req.observed and req.ttft_s is not None:
            intervals = [mean_tbt_s] if mean_tbt_s is not None and tokens > 1 else []
            self.ttft_residuals.quantile = self.admission.observe(met_slos(
                req.ttft_s, intervals, self.config.ttft_slo_s, self.config.tbt_slo_s))

    def on_failed(self, engine: str, request_id: str, now: float) -> None:
        """The request ended without an answer worth learning from."""
        state = self.engines.get(engine)
        if state is not None:
            state.requests.pop(request_id, None)
            state.queue.pending.pop(request_id, None)

    def on_metrics(self, engine: str, running: int, waiting: int, kv_usage: float,
                   now: float, capacity_blocks: int | None = None,
                   sampled_from: float | None = None) -> None:
        """The engine's own load figures (all its clients).  What exceeds the
        requests this scheduler has there is other clients' work.
        ``capacity_blocks``: the most blocks its prefix cache holds, where
        it says; ``sampled_from``: when the figures were asked for (they
        hold the engine as it was at some instant between then and
        ``now``; None: ``now``)."""
        state = self.engines.get(engine)
        if state is None:
            return
        if capacity_blocks is not None:
            state.capacity_blocks = capacity_blocks
        state.running, state.waiting, state.kv_usage, state.metrics_at = \
            running, waiting, kv_usage, now
        asked = now if sampled_from is None else min(sampled_from, now)
        # Ours without a first token may be waiting or prefilling (running):
        # every figure above them is someone else's.  A first token that came
        # back after the figures were asked for may have come after the
        # engine counted its request as waiting: still ours, not another
        # client's (counted as one, it would be priced as a whole uncached
        # prefill until the next poll).
        queued = sum(1 for r in state.requests.values()
                     if r.first_token_at is None or r.first_token_at >= asked)
        state.foreign_waiting = max(0, waiting - queued)
        state.foreign_running = max(0, running + waiting - len(state.requests)
                                    - state.foreign_waiting)

    # ---- status --------------------------------------------------------
    def status(self, now: float) -> dict:
        """The learned state, for /admin/status."""
        n, total, total_abs = self._ttft_errors
        engines = {}
        for name, s in self.engines.items():
            est = self.estimator_for(s)
            engines[name] = {
                "alive": s.alive, "stale": s.stale, "booked": len(s.queue.pending),
                "decoding": s.ours_decoding(), "running": s.running, "waiting": s.waiting,
                "kv_usage": s.kv_usage, "foreign_running": s.foreign_running,
                "foreign_waiting": s.foreign_waiting, "capacity_blocks": s.capacity_blocks,
                "queue_s": round(s.queue.queue_time(now), 6),
                "own_prefill_fit": s.prefill_est.fitted_since_fork(),
                "prefill_coeffs": getattr(est, "coeffs", None),
                # What a prefill behind work of ours there leaves out, and
                # the most prompt tokens one of its steps prefills.
                "prefill_fixed_s": est.step_fixed_s(), "step_tokens": s.step_tokens,
                "decode_coeffs": [s.decode_est.c0, s.decode_est.c_batch, s.decode_est.c_ctx],
                "decode_scale": s.decode_est.scale,
                "step_coeffs": [s.step_est.c0, s.step_est.c_batch, s.step_est.c_ctx],
                "step_scale": s.step_est.scale}
        return {"engines": engines, "rejections": dict(self.rejections),
                "reuse_share": round(self.reuse.share(), 4),
                "ttft_error": {"count": n, "mean_s": total / n if n else 0.0,
                               "mean_abs_s": total_abs / n if n else 0.0},
                "contention": {k: dataclasses.asdict(v)
                               for k, v in self.contention.stats(now).items()},
                "ttft_residuals": {k: dataclasses.asdict(v)
                                   for k, v in self.ttft_residuals.stats(now).items()},
                "residuals_priced_by_prior": self.ttft_residuals.prior_skipped,
                "admission": dataclasses.asdict(self.admission.stats())}
