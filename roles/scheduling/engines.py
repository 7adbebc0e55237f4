"""Algorithm 1 over a fleet of external engines (vLLM and the like).

Each engine is a colocated node whose KV cache cannot be moved to another
engine: a request's choices are "this engine, with the prefix it holds" for
every live engine, never a transfer.  Per live, non-stale engine:

    predicted TTFT = queue wait + prefill(prompt - its prefix hit) + median residual

- queue wait: the prefill work this scheduler booked there and has not seen
  a first token for (FIFO, as PrefillNodeState counts a prefill node's
  bookings), plus the requests the engine's /metrics says are waiting that
  this scheduler did not send, each priced as an uncached request of the
  mean prompt length routed lately;
- prefill: the engine's own fit on its observed prefills once it has one,
  else the fleet-wide fit every engine feeds (a copy of the conductor's
  prior, so a new engine is priced as the others run);
- the residual: ResidualModel keyed by engine and load level, the same
  model the conductor keeps for its own nodes.

Among the engines that admit the request (model + the admission-quantile
residual <= TTFT SLO, and its predicted TBT, its DecodeEstimator at its
running batch + 1, <= TBT SLO) the one with the least predicted TTFT plus
the cost of what its blocks would evict there (cache_pressure.py; zero
while the engine's cache has room, or its size is unknown) wins.  Hot
prefixes spill by this pricing alone: once the holder's queue costs more
than recomputing the prefix elsewhere and the cached work the copy pushes
out, another engine wins and caches it (the paper's Section 6.2,
replication by demand).

Nothing here does I/O or reads a clock: ``now`` is always an argument.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from typing import Collection, Mapping, Sequence

from .attainment import AdmissionQuantile, met_slos
from .cache_pressure import ReuseShare, blocks_evicted, eviction_seconds, new_blocks
from .config import SchedulerConfig
from .engine_state import EngineDecision, EngineRequest, EngineState
from .estimators import DecodeEstimator, PrefillEstimator
from .residuals import ResidualModel, load_level
from .state import PendingPrefill, Rejection

# For a prompt no engine holds, predicted TTFTs within this share of each
# other are a tie (broken by load, then by turn).
TIE_SHARE = 0.1
# Prompt lengths of recently routed requests: what a request another client
# sent is priced as (its prompt is not known to us).
RECENT_PROMPTS = 64


class EngineScheduler:
    """Chooses an engine per request, admits against the SLOs, learns from feedback."""

    def __init__(self, config: SchedulerConfig, prefill_prior: PrefillEstimator,
                 decode_prior: DecodeEstimator) -> None:
        self.config = config
        # The fleet-wide fit (fed by every engine) and what a new engine starts from.
        self.prefill_est = prefill_prior.fork()
        self.decode_prior = decode_prior
        self.engines: dict[str, EngineState] = {}
        self.ttft_residuals = ResidualModel(config.residual_half_life_s, config.admit_quantile,
                                            config.residual_min_samples)
        # Its admission quantile, steered by admitted requests' outcomes.
        self.admission = AdmissionQuantile(config.admit_quantile, config.slo_attainment)
        self.ttft_residuals.quantile = self.admission.quantile
        self.recent_prompts: deque[int] = deque(maxlen=RECENT_PROMPTS)
        self.reuse = ReuseShare()
        self.rejections: dict[str, int] = {}
        self._ttft_errors = [0, 0.0, 0.0]  # count, sum, sum of |predicted - actual|

    # ---- fleet membership ---------------------------------------------
    def add_engine(self, name: str) -> EngineState:
        """Start scheduling onto ``name`` (a re-add starts it afresh)."""
        state = EngineState(name, self.prefill_est.fork(), copy.deepcopy(self.decode_prior))
        self.engines[name] = state
        return state

    def remove_engine(self, name: str) -> None:
        self.engines.pop(name, None)
        self.ttft_residuals.forget_node(name)

    def mark_dead(self, name: str) -> None:
        """A dead engine takes nothing; what it held in flight is lost with it."""
        state = self.engines.get(name)
        if state is not None and state.alive:
            state.alive = False
            state.requests.clear()
            state.queue.pending.clear()

    def mark_alive(self, name: str) -> None:
        state = self.engines.get(name)
        if state is not None:
            state.alive = True

    def set_stale(self, name: str, stale: bool) -> None:
        """A stale engine (its KV events went quiet) is not chosen: its hits are unknown."""
        if name in self.engines:
            self.engines[name].stale = stale

    # ---- pricing -------------------------------------------------------
    def estimator_for(self, state: EngineState) -> PrefillEstimator:
        """The engine's own fit once it has refitted, else the fleet-wide one
        (an engine priced by a stale copy of the prior would never be chosen
        to gather the samples that correct it)."""
        return state.prefill_est if state.prefill_est.fitted_since_fork() else self.prefill_est

    def typical_prompt(self, default: int) -> int:
        return round(sum(self.recent_prompts) / len(self.recent_prompts)) \
            if self.recent_prompts else default

    def queue_s(self, state: EngineState, now: float, prompt_tokens: int) -> float:
        """Seconds before a request sent now starts its prefill at ``state``."""
        for rid in [rid for rid, r in state.requests.items()
                    if not r.observed and r.first_token_at is None
                    and _expected_end(state.queue.pending[rid]) <= now]:
            # A non-streamed response shows no first token: its prefill
            # counts as done when predicted.
            self._started(state, rid, now)
        est = self.estimator_for(state)
        foreign = state.foreign_waiting * est.seconds(self.typical_prompt(prompt_tokens), 0)
        return state.queue.queue_time(now) + foreign

    def tbt_s(self, state: EngineState, prompt_tokens: int) -> float:
        """The engine's predicted TBT with this request in its batch."""
        # Everything at the engine now runs beside it once it decodes.
        foreign = state.foreign_running + state.foreign_waiting
        batch = state.in_flight() + 1
        context = sum(r.prompt_tokens for r in state.requests.values()) + prompt_tokens \
            + foreign * self.typical_prompt(prompt_tokens)
        return state.decode_est.seconds(batch, context)

    def ttft_admit_limit(self, name: str, level: int, now: float) -> float:
        """The highest predicted TTFT (model + median residual) admitted: the
        SLO less the spread between the admission quantile and the median."""
        r = self.ttft_residuals
        return max(0.0, self.config.ttft_slo_s - (r.bound(name, level, now)
                                                  - r.median(name, level, now)))

    # ---- the decision --------------------------------------------------
    def schedule(self, request_id: str, prompt_tokens: int, prefix_tokens: Mapping[str, int],
                 now: float, streamed: bool = True,
                 among: Collection[str] | None = None,
                 block_keys: Sequence[int] = (), block_size: int = 0,
                 cached_blocks: Mapping[str, int] | None = None
                 ) -> EngineDecision | Rejection:
        """Book ``request_id`` on the engine with the least predicted TTFT
        that admits it, or refuse it.  ``prefix_tokens``: leading prompt
        tokens each engine holds (engines missing from it hold none);
        ``streamed``: its first token will be reported (on_first_token);
        ``among``: the engines that may serve it (those serving its model;
        None: all); ``block_keys``: chained keys of the prompt's full blocks
        of ``block_size`` tokens, with which a request queued behind one
        still prefilling its prefix at an engine is priced as reusing it
        there (``pending_prefix_tokens``); ``cached_blocks``: blocks of
        ``block_size`` tokens each engine's cache holds now (its KV events),
        with which what the request's blocks would evict there is priced
        (engines missing from it: not priced)."""
        if prompt_tokens <= 0:
            raise ValueError("prompt_tokens must be > 0")
        cfg = self.config
        best: tuple[EngineDecision, int, float] | None = None
        refused: tuple[str, EngineDecision, float] | None = None
        held_by: dict[str, int] = {}
        for name, state in self.engines.items():
            if not state.alive or state.stale or (among is not None and name not in among):
                continue
            level = load_level(state.in_flight())
            held = max(prefix_tokens.get(name, 0),
                       self.pending_prefix_tokens(state, block_keys, block_size))
            # At least the last prompt token is computed: it makes the first output token.
            prefix = max(0, min(held, prompt_tokens - 1))
            held_by[name] = held
            t_queue = self.queue_s(state, now, prompt_tokens)
            t_prefill = self.estimator_for(state).seconds(prompt_tokens, prefix)
            model = t_queue + t_prefill
            ttft = model + self.ttft_residuals.median(name, level, now)
            tbt = self.tbt_s(state, prompt_tokens)
            cached = None if cached_blocks is None else cached_blocks.get(name)
            eviction = self.eviction_s(state, prompt_tokens, held, block_size, cached)
            decision = EngineDecision(request_id, name, prefix, ttft, tbt, t_queue, t_prefill,
                                      eviction)
            limit = self.ttft_admit_limit(name, level, now)
            if cfg.reject and ttft > limit:
                why = ("ttft_slo", decision, limit)
            elif cfg.reject and tbt > cfg.tbt_slo_s:
                why = ("tbt_slo", decision, cfg.tbt_slo_s)
            else:
                if best is None or self._before(decision, state, best[0]):
                    best = (decision, level, model)
                continue
            if refused is None or ttft < refused[1].predicted_ttft_s:
                refused = why
        self.reuse.add(prompt_tokens, max(held_by.values(), default=0))
        if best is None:
            if refused is None:
                return self._reject(request_id, "no_engine", math.inf, math.inf, 1.0)
            reason, d, limit = refused
            retry = d.predicted_ttft_s - limit if reason == "ttft_slo" else 1.0
            return self._reject(request_id, reason, d.predicted_ttft_s, d.predicted_tbt_s,
                                retry, limit)
        decision, level, model = best
        new = new_blocks(prompt_tokens, held_by[decision.engine], block_size) \
            if block_size > 0 else 0
        self._book(decision, prompt_tokens, level, model, now, streamed, tuple(block_keys), new)
        return decision

    def eviction_s(self, state: EngineState, prompt_tokens: int, held_tokens: int,
                   block_size: int, cached_blocks: int | None) -> float:
        """Expected recompute later requests pay for what this prompt's new
        blocks evict at ``state`` (cache_pressure.py).  Its cache holds what
        its events reported plus the new blocks of our requests still
        queued or prefilling there (not reported until computed)."""
        if state.capacity_blocks is None or cached_blocks is None or block_size <= 0:
            return 0.0
        storing = new_blocks(prompt_tokens, held_tokens, block_size)
        pending = sum(state.requests[rid].new_blocks for rid in state.queue.pending)
        evicted = blocks_evicted(state.capacity_blocks, cached_blocks + pending, storing)
        return eviction_seconds(self.estimator_for(state), evicted, block_size,
                                self.reuse.share(), self.typical_prompt(prompt_tokens))

    def _before(self, d: EngineDecision, state: EngineState, best: EngineDecision) -> bool:
        """``d`` beats ``best``: a lower cost (predicted TTFT + eviction).
        For a prompt neither holds any of, costs within TIE_SHARE of each
        other (their fits differ by less than they err) are a tie, won by
        fewer requests in flight, then by the engine chosen longest ago: new
        prefixes spread over the engines' caches instead of filling one."""
        cold = d.prefix_tokens == 0 and best.prefix_tokens == 0
        near = abs(d.cost_s - best.cost_s) <= TIE_SHARE * min(d.cost_s, best.cost_s)
        if not (cold and near):
            return d.cost_s < best.cost_s
        other = self.engines[best.engine]
        return (state.in_flight(), state.chosen_at) < (other.in_flight(), other.chosen_at)

    def load_of(self, name: str) -> int:
        """Requests in flight at ``name`` (ours and others'): the order in
        which engines are asked for work that is not a generation."""
        state = self.engines.get(name)
        return state.in_flight() if state is not None else 0

    @staticmethod
    def pending_prefix_tokens(state: EngineState, block_keys: Sequence[int],
                              block_size: int) -> int:
        """Leading prompt tokens that requests of ours still queued or
        prefilling at ``state`` will have cached there before a request
        sent now starts (an engine runs its waiting requests in order): its
        KV events report a prefix only once computed, and a request sent
        meanwhile would be priced as recomputing it."""
        if not block_keys or block_size <= 0:
            return 0
        best = 0
        for rid in state.queue.pending:
            ahead = state.requests[rid].block_keys
            n, most = 0, min(len(ahead), len(block_keys))
            while n < most and ahead[n] == block_keys[n]:
                n += 1
            best = max(best, n)
        return best * block_size

    def _book(self, d: EngineDecision, prompt_tokens: int, level: int, model: float,
              now: float, streamed: bool, block_keys: tuple[int, ...] = (),
              new_blocks: int = 0) -> None:
        state = self.engines[d.engine]
        state.chosen_at = now
        by_prior = not self.estimator_for(state).fitted_since_fork()
        pending = state.queue.pending
        # Its prediction holds the prior's error if its own price or that of
        # any work booked ahead of it came from the prior.
        prior_in_ttft = by_prior or any(p.priced_by_prior for p in pending.values())
        pending[d.request_id] = PendingPrefill(d.t_prefill, now, expected_start=now + d.t_queue,
                                               priced_by_prior=by_prior)
        state.requests[d.request_id] = EngineRequest(prompt_tokens, d.prefix_tokens, now, model,
                                                d.predicted_ttft_s, level, prior_in_ttft, streamed,
                                                block_keys, new_blocks)
        self.recent_prompts.append(prompt_tokens)

    def _reject(self, request_id: str, reason: str, ttft: float, tbt: float, retry: float,
                limit: float = math.inf) -> Rejection:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        retry = min(self.config.max_retry_after_s, max(self.config.min_retry_after_s, retry))
        return Rejection(request_id, reason, ttft, tbt, retry, limit)

    # ---- feedback ------------------------------------------------------
    def _started(self, state: EngineState, request_id: str, now: float) -> EngineRequest | None:
        """Move a request from the queue to decoding at ``now``."""
        req = state.requests.get(request_id)
        if req is None or req.first_token_at is not None:
            return None
        state.queue.pending.pop(request_id, None)
        req.first_token_at = now
        others = [r for r in state.requests.values() if r is not req]
        req.batch = 1 + state.foreign_running + sum(1 for r in others if r.first_token_at)
        req.context_tokens = req.prompt_tokens + sum(r.prompt_tokens for r in others
                                                     if r.first_token_at)
        return req

    def on_first_token(self, engine: str, request_id: str, now: float) -> None:
        """The first token came back: refit the engine's prefill time on the
        part of the TTFT after the request could start (FIFO: after the
        previous first token there), and record the TTFT residual."""
        state = self.engines.get(engine)
        booking = state.queue.pending.get(request_id) if state else None
        req = self._started(state, request_id, now) if state else None
        if req is None or booking is None:
            return
        service = now - max(req.sent_at, state.last_first_token_at)
        state.last_first_token_at = now
        if booking.estimate_s > 0:
            state.queue.late_ratios.append(service / booking.estimate_s)
        if service > 0:
            state.prefill_est.observe(req.prompt_tokens, req.prefix_tokens, service)
            self.prefill_est.observe(req.prompt_tokens, req.prefix_tokens, service)
        actual = req.ttft_s = now - req.sent_at
        errors = self._ttft_errors
        errors[0] += 1
        errors[1] += req.predicted_ttft_s - actual
        errors[2] += abs(req.predicted_ttft_s - actual)
        self.ttft_residuals.add(engine, req.level, actual - req.model_ttft_s, now,
                                priced_by_prior=req.priced_by_prior)

    def on_finished(self, engine: str, request_id: str, now: float,
                    mean_tbt_s: float | None = None, tokens: int = 0) -> None:
        """The request ended; ``mean_tbt_s``: the mean of its ``tokens``'
        intervals as streamed, which the engine's decode model is fitted on."""
        state = self.engines.get(engine)
        if state is None:
            return
        req = state.requests.get(request_id)
        if req is not None and req.first_token_at is None:
            self._started(state, request_id, now)
        req = state.requests.pop(request_id, None)
        if req is not None and mean_tbt_s is not None and mean_tbt_s > 0 and tokens > 1:
            state.decode_est.observe(req.batch, req.context_tokens + tokens // 2, mean_tbt_s)
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
                   now: float, capacity_blocks: int | None = None) -> None:
        """The engine's own load figures (all its clients).  What exceeds the
        requests this scheduler has there is other clients' work.
        ``capacity_blocks``: the most blocks its prefix cache holds, where
        it says."""
        state = self.engines.get(engine)
        if state is None:
            return
        if capacity_blocks is not None:
            state.capacity_blocks = capacity_blocks
        state.running, state.waiting, state.kv_usage, state.metrics_at = \
            running, waiting, kv_usage, now
        queued = len(state.queue.pending)
        # Ours without a first token may be waiting or prefilling (running):
        # every figure above them is someone else's.
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
                "decode_coeffs": [s.decode_est.c0, s.decode_est.c_batch, s.decode_est.c_ctx],
                "decode_scale": s.decode_est.scale}
        return {"engines": engines, "rejections": dict(self.rejections),
                "reuse_share": round(self.reuse.share(), 4),
                "ttft_error": {"count": n, "mean_s": total / n if n else 0.0,
                               "mean_abs_s": total_abs / n if n else 0.0},
                "ttft_residuals": {k: dataclasses.asdict(v)
                                   for k, v in self.ttft_residuals.stats(now).items()},
                "residuals_priced_by_prior": self.ttft_residuals.prior_skipped,
                "admission": dataclasses.asdict(self.admission.stats())}


def _expected_end(p: PendingPrefill) -> float:
    start = p.expected_start if p.expected_start is not None else p.sent_at
    return start + p.estimate_s
