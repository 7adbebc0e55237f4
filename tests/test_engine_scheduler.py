"""Algorithm 1 over external engines (roles/scheduling/engines.py), by hand.

Prefill is priced at 1 ms per computed token (no fixed cost, no refit), so
every TTFT below is worked out in the comments; decode at 10 ms + 2 ms per
request in the batch.
"""

from __future__ import annotations

import json
import math

import pytest

from roles.scheduling.config import SchedulerConfig
from roles.scheduling.engines import EngineDecision, EngineScheduler
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PolynomialPrefillEstimator
from roles.scheduling.state import Rejection

MS_PER_TOKEN = {"n": 1e-3}


def make(engines=("a", "b"), **cfg) -> EngineScheduler:
    config = SchedulerConfig(**{"ttft_slo_s": 10.0, "tbt_slo_s": 0.1,
                                "residual_half_life_s": 1e9, **cfg})
    sched = EngineScheduler(config, PolynomialPrefillEstimator(MS_PER_TOKEN),
                            DecodeEstimator(0.01, 0.002, 0.0))
    for name in engines:
        sched.add_engine(name)
    return sched


def test_the_engine_holding_the_prefix_wins():
    sched = make()
    d = sched.schedule("r1", 1000, {"a": 900}, now=0.0)
    # a: computes 100 tokens = 0.1 s; b: 1000 tokens = 1.0 s.
    assert isinstance(d, EngineDecision)
    assert (d.engine, d.prefix_tokens) == ("a", 900)
    assert d.t_queue == 0.0 and d.predicted_ttft_s == pytest.approx(0.1)
    # Alone in a's batch: 10 + 2 ms.
    assert d.predicted_tbt_s == pytest.approx(0.012)


def test_a_whole_prompt_hit_still_computes_its_last_token():
    d = make().schedule("r1", 256, {"a": 256}, now=0.0)
    assert d.prefix_tokens == 255 and d.t_prefill == pytest.approx(0.001)


@pytest.mark.parametrize("queued, engine", [(2, "a"), (3, "b")])
def test_hot_prefix_spills_to_a_less_loaded_engine(queued, engine):
    sched = make(engines=("a",))
    for i in range(queued):  # 400-token prompts, no hit: 0.4 s each, FIFO
        assert sched.schedule(f"q{i}", 400, {}, now=0.0).engine == "a"
    sched.add_engine("b")
    d = sched.schedule("hot", 1100, {"a": 1000}, now=0.0)
    # a: queue 0.4 * queued + 100 new tokens (0.1 s): 0.9 s with 2 queued, 1.3 s with 3;
    # b: no queue, recomputes all 1100 tokens: 1.1 s.
    assert d.engine == engine
    assert d.predicted_ttft_s == pytest.approx(0.9 if engine == "a" else 1.1)
    if engine == "b":
        # b caches the prefix while serving it; the next copy goes to whichever is freer.
        sched.on_first_token("b", "hot", now=1.1)
        d2 = sched.schedule("hot2", 1100, {"a": 1000, "b": 1000}, now=1.1)
        # a at 1.1 s: 1.2 s booked less 1.1 s done = 0.1 s queued + 0.1 s; b: 0.1 s.
        assert d2.engine == "b" and d2.predicted_ttft_s == pytest.approx(0.1)


def _learn_residuals(sched: EngineScheduler, residuals: list[float]) -> None:
    """One 100-token request (model TTFT 0.1 s) at a time on an idle engine,
    its first token ``r`` later than predicted."""
    for i, r in enumerate(residuals):
        t = 100.0 * i
        d = sched.schedule(f"learn{i}", 100, {}, now=t)
        assert d.predicted_ttft_s == pytest.approx(0.1 + sched.ttft_residuals.median("a", 0, t))
        sched.on_first_token(d.engine, d.request_id, now=t + 0.1 + r)
        sched.on_finished(d.engine, d.request_id, now=t + 0.2)


def test_admission_adds_the_quantile_residual():
    sched = make(engines=("a",), ttft_slo_s=1.0, residual_min_samples=4, admit_quantile=0.9)
    _learn_residuals(sched, [0.0] * 6 + [0.4] * 4)
    now = 1000.0
    # Median residual 0, 0.9-quantile 0.4: admitted while model + 0.4 <= 1.0 s.
    assert sched.ttft_admit_limit("a", 0, now) == pytest.approx(0.6)
    ok = sched.schedule("ok", 550, {}, now=now)
    assert isinstance(ok, EngineDecision) and ok.predicted_ttft_s == pytest.approx(0.55)
    sched.on_failed("a", "ok", now)
    no = sched.schedule("no", 650, {}, now=now)
    assert isinstance(no, Rejection)
    assert (no.reason, no.limit_s) == ("ttft_slo", pytest.approx(0.6))
    assert no.predicted_ttft_s == pytest.approx(0.65)
    # Retry-After: how far over the limit, at least the configured minimum.
    assert no.retry_after_s == sched.config.min_retry_after_s


def test_choice_adds_the_median_residual():
    # (Aged by a half-life of 1e9 s, 4 samples weigh a little under 4: 3 are trusted.)
    sched = make(engines=("a",), residual_min_samples=3)
    _learn_residuals(sched, [0.3] * 4)
    sched.add_engine("b")
    # a: 0.1 s + its median residual 0.3 s; b (no residuals of its own: the
    # cluster's, 0.3 s) 0.2 s + 0.3 s.
    d = sched.schedule("r", 200, {"a": 100}, now=1000.0)
    assert d.engine == "a" and d.predicted_ttft_s == pytest.approx(0.4)


def test_rejections_name_the_reason_prediction_and_limit():
    sched = make(engines=("a",), ttft_slo_s=1.0, tbt_slo_s=0.015)
    assert sched.schedule("r1", 100, {}, now=0.0).engine == "a"   # TBT 10 + 2 = 12 ms
    assert sched.schedule("r2", 100, {}, now=0.0).engine == "a"   # 10 + 2*2 = 14 ms
    no = sched.schedule("r3", 100, {}, now=0.0)                    # 10 + 2*3 = 16 ms
    assert (no.reason, no.limit_s) == ("tbt_slo", 0.015)
    assert no.predicted_tbt_s == pytest.approx(0.016)
    too_long = sched.schedule("r4", 2000, {}, now=0.0)
    # 0.2 s queued (r1, r2) + 2.0 s: TTFT is checked first.
    assert (too_long.reason, too_long.predicted_ttft_s) == ("ttft_slo", pytest.approx(2.2))
    assert too_long.limit_s == pytest.approx(1.0)
    assert too_long.retry_after_s == pytest.approx(1.2)
    sched.mark_dead("a")
    none = sched.schedule("r5", 100, {}, now=0.0)
    assert none.reason == "no_engine" and math.isinf(none.predicted_ttft_s)
    assert sched.rejections == {"tbt_slo": 1, "ttft_slo": 1, "no_engine": 1}


def test_dead_and_stale_engines_are_skipped():
    sched = make()
    sched.mark_dead("a")
    assert sched.schedule("r1", 1000, {"a": 900}, now=0.0).engine == "b"
    sched.mark_alive("a")
    sched.set_stale("b", True)
    assert sched.schedule("r2", 1000, {"b": 900}, now=0.0).engine == "a"


def test_death_forgets_the_engines_bookings():
    sched = make(engines=("a",))
    sched.schedule("r1", 1000, {}, now=0.0)
    sched.mark_dead("a")
    sched.mark_alive("a")
    assert sched.schedule("r2", 100, {}, now=0.0).t_queue == 0.0
    sched.on_first_token("a", "r1", now=1.0)   # a late answer for a forgotten request: ignored
    assert "r1" not in sched.engines["a"].requests


def test_waiting_requests_other_clients_sent_are_queue():
    sched = make(engines=("a",))
    sched.on_metrics("a", running=1, waiting=2, kv_usage=0.5, now=0.0)
    d = sched.schedule("r1", 500, {"a": 0}, now=0.0)
    # Two foreign waiting requests priced as this one uncached (nothing routed
    # yet): 2 * 0.5 s, each step with a decode step of the running one (18 ms
    # at a batch of 4), then 0.5 s of its own.
    assert d.t_queue == pytest.approx(1.036) and d.predicted_ttft_s == pytest.approx(1.536)
    # In its batch: the foreign running and waiting ones and itself: 10 + 2*4 ms.
    assert d.predicted_tbt_s == pytest.approx(0.018)
    sched.add_engine("b")
    d2 = sched.schedule("r2", 500, {}, now=0.0)
    assert d2.engine == "b"
    # Our own requests in the figures are not counted twice.
    sched.on_metrics("a", running=1, waiting=3, kv_usage=0.5, now=0.1)
    assert (sched.engines["a"].foreign_waiting, sched.engines["a"].foreign_running) == (2, 1)


def test_a_first_token_back_while_the_figures_were_asked_for_is_not_another_clients():
    sched = make(engines=("a",))
    for rid in ("r1", "r2", "r3"):
        sched.schedule(rid, 500, {}, now=0.0)
    # Asked for at 1.0, answered at 1.05; r1's first token came back at
    # 1.02, after the engine may have counted it waiting with r2 and r3.
    sched.on_first_token("a", "r1", now=1.02)
    sched.on_metrics("a", running=0, waiting=3, kv_usage=0.1, now=1.05, sampled_from=1.0)
    assert sched.engines["a"].foreign_waiting == 0
    # One that came back before the figures were asked for is not ours then:
    # the third waiting request is another client's.
    sched.on_metrics("a", running=1, waiting=3, kv_usage=0.1, now=1.55, sampled_from=1.5)
    assert sched.engines["a"].foreign_waiting == 1


def test_first_tokens_fit_the_engines_own_prefill_time():
    config = SchedulerConfig(ttft_slo_s=10.0, residual_half_life_s=1e9)
    sched = EngineScheduler(config, PolynomialPrefillEstimator({"n": 1e-3}, refit_every=1,
                                                               window=8),
                            DecodeEstimator(0.01, 0.002, 0.0))
    sched.add_engine("slow")
    for i, n in enumerate([100, 200, 300, 400, 500, 600]):
        t = 10.0 * i
        d = sched.schedule(f"r{i}", n, {}, now=t)
        sched.on_first_token("slow", d.request_id, now=t + 0.002 * n)   # runs at 2 ms/token
        sched.on_finished("slow", d.request_id, now=t + 1.0)
    assert sched.engines["slow"].prefill_est.fitted_since_fork()
    assert sched.schedule("next", 1000, {}, now=100.0).t_prefill == pytest.approx(2.0, rel=0.05)
    # The first five were priced by the unfitted prior: no weight in the residuals.
    assert sched.ttft_residuals.prior_skipped == 5


def test_a_non_streamed_booking_ends_when_predicted():
    sched = make(engines=("a",))
    sched.schedule("r1", 1000, {}, now=0.0, streamed=False)
    assert sched.schedule("r2", 100, {}, now=0.5).t_queue == pytest.approx(0.5)
    sched.on_failed("a", "r2", 0.5)
    # Past r1's predicted end its prefill counts as done (no late floor).
    assert sched.schedule("r3", 100, {}, now=1.5).t_queue == 0.0


def test_finished_streams_fit_the_decode_model_and_status_is_json():
    sched = make(engines=("a",))
    d = sched.schedule("r1", 100, {}, now=0.0)
    sched.on_first_token("a", d.request_id, now=0.1)
    sched.on_finished("a", d.request_id, now=1.0, mean_tbt_s=0.024, tokens=40)
    # Modelled 12 ms at a batch of one: the level follows what was measured.
    assert sched.engines["a"].decode_est.seconds(1, 0) > 0.012
    status = sched.status(now=1.0)
    json.dumps(status)
    assert status["engines"]["a"]["booked"] == 0 and status["ttft_error"]["count"] == 1
    # The prior here has no fixed part; the engine's step budget is the default.
    assert (status["engines"]["a"]["prefill_fixed_s"], status["engines"]["a"]["step_tokens"]) \
        == (0.0, 2048)


def test_a_request_behind_one_prefilling_its_prefix_is_priced_as_reusing_it():
    # "a" books a 1000-token prompt (10 blocks of 100): its KV events will
    # report it only once computed.  "b" shares 8 of those blocks: behind it
    # on engine a it waits 1.0 s and computes 200 tokens (1.2 s); engine b
    # is busy for 1.5 s and would compute all 1000 (2.5 s).
    sched = make()
    keys = list(range(10))
    first = sched.schedule("first", 1000, {}, now=0.0, block_keys=keys, block_size=100)
    assert first.engine == "a"
    sched.schedule("busy-b", 1500, {}, now=0.0, among={"b"})
    d = sched.schedule("next", 1000, {}, now=0.0, block_keys=keys[:8] + [90, 91],
                       block_size=100)
    assert (d.engine, d.prefix_tokens) == ("a", 800)
    assert d.predicted_ttft_s == pytest.approx(1.0 + 0.2)
    # Once "first" has its first token its blocks are the index's to report:
    # only "next", still queued, counts (its 8 blocks of first's 10).
    assert sched.pending_prefix_tokens(sched.engines["a"], keys, 100) == 1000
    sched.on_first_token("a", "first", now=1.0)
    assert sched.pending_prefix_tokens(sched.engines["a"], keys, 100) == 800


def test_new_prefixes_spread_over_engines_priced_alike():
    # Neither engine holds any of these prompts and both are idle: the one
    # with fewer requests in flight, then the one chosen longest ago, wins
    # (their fits may differ by less than they err).
    sched = make()
    sched.engines["b"].prefill_est = PolynomialPrefillEstimator({"n": 1.05e-3})
    picks = [sched.schedule(f"r{i}", 100, {}, now=float(i)).engine for i in range(4)]
    assert picks == ["a", "b", "a", "b"]
    # A prompt one engine holds part of is no tie: the holder wins.
    assert sched.schedule("held", 100, {"b": 50}, now=5.0).engine == "b"


def test_a_new_prefix_priced_alike_goes_where_the_cache_has_room():
    # Both price a 200-token prompt neither holds at 0.2 s, with room for
    # its 2 blocks; b runs another client's request, a nothing.  b's cache
    # has 15 blocks free and a's 2: the prompt goes to b, where it leaves
    # room for the next new prefix at both.
    sched = make()
    sched.on_metrics("a", running=0, waiting=0, kv_usage=0.0, now=0.0, capacity_blocks=20)
    sched.on_metrics("b", running=1, waiting=0, kv_usage=0.0, now=0.0, capacity_blocks=20)
    d = sched.schedule("new", 200, {}, now=1.0, block_size=100,
                       cached_blocks={"a": 18, "b": 5})
    assert (d.engine, d.eviction_s) == ("b", 0.0)
    # Where what the caches hold is not known, the one with less in flight.
    assert sched.schedule("unsized", 200, {}, now=2.0).engine == "a"


@pytest.mark.parametrize("queued_tokens, engine", [(550, "a"), (700, "b")])
def test_costs_within_the_tie_share_go_to_the_engine_holding_more(queued_tokens, engine):
    # a holds half the prompt but has work queued; b holds none and is idle.
    sched = make()
    assert sched.schedule("q", queued_tokens, {}, now=0.0).engine == "a"
    d = sched.schedule("r", 1000, {"a": 500}, now=0.0)
    # a: queued 0.55 s + 500 new tokens = 1.05 s, within 10% of b's 1.0 s:
    # a tie, won by the holder (it computes half and stores no second
    # copy); with 0.7 s queued (1.2 s) b is faster by more than the fits err.
    assert d.engine == engine
    assert d.predicted_ttft_s == pytest.approx(1.05 if engine == "a" else 1.0)
    assert {c[0]: (c[1], round(c[2], 6)) for c in d.candidates} == {
        "a": (500, round(queued_tokens / 1000 + 0.5, 6)), "b": (0, 1.0)}


def test_costs_within_the_learned_ttft_spread_go_to_the_engine_holding_more():
    sched = make(residual_min_samples=4, admit_quantile=0.9)
    _learn_residuals(sched, [0.0] * 6 + [0.4] * 4)
    now = 1000.0
    # Median residual 0, 0.9-quantile 0.4: predictions err by up to 0.4 s.
    assert sched.ttft_spread_s("a", 0, now) == pytest.approx(0.4)
    assert sched.ttft_spread_s("b", 1, now) == pytest.approx(0.4)
    holder = sched.schedule("q", 700, {}, now=now).engine
    other = ({"a", "b"} - {holder}).pop()
    # holder: 0.7 s queued + 500 new tokens = 1.2 s; other: 1000 tokens, 1.0 s.
    # 0.2 s apart: more than 10% of 1.0 s, less than the 0.4 s spread.
    d = sched.schedule("r", 1000, {holder: 500}, now=now)
    assert d.engine == holder and d.predicted_ttft_s == pytest.approx(1.2)
    # With 0.4 s more queued there (1.6 s), 0.6 s apart is more than the
    # predictions err: the faster engine wins.
    sched.on_failed(holder, "r", now)
    assert sched.schedule("q2", 400, {}, now=now, among=(holder,)).engine == holder
    d2 = sched.schedule("r2", 1000, {holder: 500}, now=now)
    assert d2.engine == other and d2.predicted_ttft_s == pytest.approx(1.0)


def _full_engines(sched: EngineScheduler, reuse_prompts: int = 4) -> None:
    """Both engines' caches hold at most 20 blocks of 100 tokens; first
    ``reuse_prompts`` routed prompts of 1000 tokens, 800 of them held by
    some engine (stated as a's hits, a holding 20 blocks): a reuse share of
    0.8."""
    for name in ("a", "b"):
        sched.on_metrics(name, running=0, waiting=0, kv_usage=0.0, now=0.0, capacity_blocks=20)
    for i in range(reuse_prompts):
        d = sched.schedule(f"seen{i}", 1000, {"a": 800}, now=10.0 * i, block_size=100,
                           cached_blocks={"a": 20, "b": 20})
        sched.on_first_token(d.engine, d.request_id, now=10.0 * i + 0.2)
        sched.on_finished(d.engine, d.request_id, now=10.0 * i + 0.3)
    assert sched.reuse.share() == pytest.approx(0.8)


def test_a_copy_that_evicts_cached_work_needs_a_larger_ttft_gain():
    # Engine a is busy for 1.2 s (6000 tokens, 4800 of them held: the reuse
    # share stays 0.8) and holds 10 of the prompt's 12 blocks: 1.2 + 0.2 s.
    # Engine b is idle and computes all 1200 tokens: 1.2 s, the shorter
    # TTFT.  But b's cache is full (20 of 20): its 12 new blocks evict 12
    # cached ones, 0.8 * 1200 tokens * 1 ms = 0.96 s of recompute later,
    # 2.16 s in all; a stores 2 new blocks into a full cache, 0.16 s: 1.56 s.
    sched = make()
    _full_engines(sched)
    sched.schedule("busy-a", 6000, {"a": 4800}, now=100.0, among={"a"})
    d = sched.schedule("doc", 1200, {"a": 1000}, now=100.0, block_size=100,
                       cached_blocks={"a": 20, "b": 20})
    assert d.engine == "a"
    assert d.predicted_ttft_s == pytest.approx(1.4)
    assert d.eviction_s == pytest.approx(0.16)
    # With room at b (8 of 20 blocks held) the copy still evicts: its 10
    # blocks a holds are copies, each priced as one block pushed out (an
    # engine's cache never gives room back, so they take the room b's next
    # unique prefix would have had); its 2 blocks nobody holds fit the
    # room left.  b: 1.2 + share * 1000 tokens * 1 ms, a: 1.4 + share * 0.2.
    sched.on_failed("a", "doc", now=100.0)
    share = sched.reuse.share()
    d = sched.schedule("doc2", 1200, {"a": 1000}, now=100.0, block_size=100,
                       cached_blocks={"a": 20, "b": 8})
    assert d.engine == "a" and d.eviction_s == pytest.approx(share * 0.2)
    assert dict((e, c) for e, _, _, c in d.candidates) == pytest.approx(
        {"a": 1.4 + share * 0.2, "b": 1.2 + share * 1.0})
    # A prompt nobody holds goes into b's room at no cost (12 new blocks,
    # 8 + 12 of 20), where a's full cache would lose 12.
    sched.on_failed("a", "doc2", now=100.0)
    d = sched.schedule("fresh", 1200, {}, now=100.0, block_size=100,
                       cached_blocks={"a": 20, "b": 8})
    assert (d.engine, d.eviction_s) == ("b", 0.0)


def test_a_copy_into_room_is_made_once_the_holder_queue_costs_more():
    # The holder a is busy for 3.2 s: recomputing the 1000 held tokens at
    # idle b (1.2 s) plus what the copy pushes out (share * 1 s) is sooner
    # than 3.2 + 0.2 s there, so the prefix is copied to b although b's
    # room was all the copy took.
    sched = make()
    _full_engines(sched)
    sched.schedule("busy-a", 16000, {"a": 12800}, now=100.0, among={"a"})
    share = sched.reuse.share()
    d = sched.schedule("hot", 1200, {"a": 1000}, now=100.0, block_size=100,
                       cached_blocks={"a": 20, "b": 0})
    assert d.engine == "b" and d.eviction_s == pytest.approx(share * 1.0)


def test_eviction_counts_blocks_still_being_computed_and_needs_a_size():
    sched = make()
    _full_engines(sched)
    a = sched.engines["a"]
    # 15 of 20 blocks reported; a booked 1000-token prompt will store 10
    # more: a 500-token prompt's 5 new blocks evict 5.  Reuse share: 3200
    # held of 5000 routed (the four seen and "queued"): 0.64 * 500 ms.
    sched.schedule("queued", 1000, {}, now=100.0, among={"a"}, block_size=100,
                   cached_blocks={"a": 15, "b": 0})
    assert sched.eviction_s(a, 500, 0, 100, 15) == pytest.approx(0.32)
    # Unknown cache size: nothing is priced.
    sched.engines["b"].capacity_blocks = None
    assert sched.eviction_s(sched.engines["b"], 500, 0, 100, 20) == 0.0
    assert sched.eviction_s(a, 500, 0, 100, None) == 0.0
    assert sched.status(now=100.0)["engines"]["a"]["capacity_blocks"] == 20


def test_finished_streams_fit_the_step_on_the_median_and_the_tbt_on_the_mean():
    # A stream whose few gaps shared a step with a prefill chunk: its mean
    # interval is well above its median.  The TBT (what the client is judged
    # on) follows the mean, the bare decode step the median.
    sched = make(engines=("a",))
    a = sched.engines["a"]
    d = sched.schedule("r1", 100, {}, now=0.0)
    sched.on_first_token("a", d.request_id, now=0.1)
    sched.on_finished("a", d.request_id, now=1.0, mean_tbt_s=0.06, tokens=10,
                      median_tbt_s=0.012)
    # Modelled 12 ms at a batch of one (10 + 2 ms): the mean is 5x that, the
    # median 1x; each level moves by alpha = 0.2 of its ratio.
    assert a.decode_est.scale == pytest.approx(0.8 + 0.2 * 5)
    assert a.step_est.scale == pytest.approx(1.0)
    assert sched.status(now=1.0)["engines"]["a"]["step_scale"] == pytest.approx(1.0)


def test_queued_prefills_each_carry_a_bare_decode_step_not_the_mean_interval():
    # "d" decodes at a; two 100-token prompts (0.1 s each) are queued behind
    # it.  Each step that prefills one also decodes "d": 0.1 s + the bare
    # step (5 ms), so a request sent now starts after 2 x 0.105 = 0.21 s.
    # The mean interval (50 ms) would price it 0.3 s: it counts the
    # prefill chunks a stream's gaps shared a step with a second time.
    sched = make(engines=("a",))
    a = sched.engines["a"]
    a.decode_est = DecodeEstimator(0.05, 0.0, 0.0)
    a.step_est = DecodeEstimator(0.005, 0.0, 0.0)
    sched.schedule("d", 100, {}, now=0.0, max_tokens=100)
    sched.on_first_token("a", "d", now=0.1)
    sched.schedule("q1", 100, {}, now=0.1, max_tokens=10)
    sched.schedule("q2", 100, {}, now=0.1, max_tokens=10)
    decision = sched.schedule("r", 100, {}, now=0.1, max_tokens=10)
    assert decision.t_start == pytest.approx(0.21)
    assert decision.t_queue == pytest.approx(0.21)
    assert decision.predicted_tbt_s == pytest.approx(0.05)


def test_a_prefill_goes_where_it_pushes_no_reply_over_the_tbt_slo():
    # "d" decodes at a: 3 tokens (2 intervals), its first at 0.1 s.  "w"
    # is queued at b (0.1 s of prefill, one token: no interval to stretch).
    # A 300-token prompt at 0.1 s costs 0.3 s at a and 0.1 + 0.3 s at b:
    # a is cheaper by more than the tie share.  But a's bare step with it
    # in the batch is 10 + 2 x 2 = 14 ms, so d's two intervals take 28 ms,
    # a mean of 14 ms; the 0.3 s prefill runs in them: (28 + 300) / 2 =
    # 164 ms, over the 100 ms TBT SLO.  It goes to b.
    sched = make()
    sched.schedule("d", 100, {}, now=0.0, among={"a"}, max_tokens=3)
    sched.on_first_token("a", "d", now=0.1)
    sched.schedule("w", 100, {}, now=0.1, among={"b"}, max_tokens=1)
    a = sched.engines["a"]
    assert sched.tbt_misses_caused(a, 0.1, 0.3, 0.014) == 1
    # 30 ms of prefill: (28 + 30) / 2 = 29 ms, within the SLO.
    assert sched.tbt_misses_caused(a, 0.1, 0.03, 0.014) == 0
    d = sched.schedule("r", 300, {}, now=0.1, max_tokens=10)
    assert (d.engine, d.tbt_misses) == ("b", 0)
    assert d.predicted_ttft_s == pytest.approx(0.4)
    # A reply already over the SLO is not one this prefill makes miss: d
    # has 2 of its 3 tokens after 0.25 s: 0.25 + 14 ms over 2 intervals.
    sched.on_tokens("a", "d", 2)
    assert sched.tbt_misses_caused(a, 0.35, 0.3, 0.014) == 0


def test_a_full_kv_cache_delays_the_start_until_decoding_requests_finish():
    # Both engines hold 10 blocks of 100 tokens.  At a: a 700-token prompt
    # with max_tokens 100 has its first token at 1.0 s; it holds 8 blocks
    # (800 tokens) until its last token, 99 steps later.  a's step with a
    # second request in its batch: 10 + 2 x 2 = 14 ms, so it releases at
    # 1.0 + 99 x 0.014 = 2.386 s.  A 300-token request at 1.0 s needs 4
    # blocks (its prompt and first output token, 301 tokens): 2 are free at
    # a, so its start waits 1.386 s there: 1.686 s against b's 0.3 s.
    sched = make()
    for name in ("a", "b"):
        sched.on_metrics(name, running=0, waiting=0, kv_usage=0.0, now=0.0, capacity_blocks=10)
    d = sched.schedule("long", 700, {}, now=0.3, among={"a"}, block_size=100, max_tokens=100)
    sched.on_first_token("a", d.request_id, now=1.0)
    a = sched.engines["a"]
    assert sched.start_wait_s(a, 1.0, 300, (), 100) == pytest.approx(1.386)
    d = sched.schedule("short", 300, {}, now=1.0, block_size=100, max_tokens=10)
    assert (d.engine, d.t_start, d.predicted_ttft_s) == ("b", 0.0, pytest.approx(0.3))
    # Only a: its TTFT is the wait for room plus its prefill.
    sched.on_failed("b", "short", now=1.0)
    d = sched.schedule("short2", 300, {}, now=1.0, block_size=100, among={"a"})
    assert d.t_start == pytest.approx(1.386) and d.t_queue == pytest.approx(1.386)
    assert d.predicted_ttft_s == pytest.approx(1.686)
    # Its prefix shared with the running request is mapped, not taken: a
    # 700-token prompt whose first 6 blocks "long" holds needs only 2 more
    # (8 for 701 tokens), which the 2 free blocks cover.
    sched.on_failed("a", "short2", now=1.0)
    a.requests["long"].block_keys = tuple(range(7))
    assert sched.start_wait_s(a, 1.0, 700, tuple(range(6)) + (99,), 100) == 0.0
    assert sched.start_wait_s(a, 1.0, 700, (), 100) == pytest.approx(1.386)
    # Its stream says how far its decode is: 50 tokens back, 50 to go.
    sched.on_tokens("a", "long", 50)
    assert sched.start_wait_s(a, 1.0, 300, (), 100) == pytest.approx(0.7)
    # Unknown cache size: no wait is priced.
    a.capacity_blocks = None
    assert sched.start_wait_s(a, 1.0, 300, (), 100) == 0.0


# A prefill model with a fixed part: 10 ms a prefill + 1 ms per computed token.
STEP_FIXED = {"c0": 0.010, "n": 1e-3}


class RecordedPrefill(PolynomialPrefillEstimator):
    """The fixed prefill model above, recording what it is fed (no refit)."""

    def __init__(self) -> None:
        super().__init__(STEP_FIXED)
        self.fed: list[tuple[int, int, float]] = []

    def observe(self, prompt_tokens: int, prefix_tokens: int, seconds: float) -> None:
        self.fed.append((prompt_tokens, prefix_tokens, seconds))

    def fork(self) -> "RecordedPrefill":
        return RecordedPrefill()


def make_stepped(step_tokens=None) -> EngineScheduler:
    sched = EngineScheduler(SchedulerConfig(ttft_slo_s=10.0, residual_half_life_s=1e9),
                            RecordedPrefill(), DecodeEstimator(0.01, 0.002, 0.0))
    sched.add_engine("a", step_tokens=step_tokens)
    return sched


def test_behind_work_at_the_engine_a_prefill_adds_its_marginal_work():
    sched = make_stepped()
    # r1 finds the engine idle and pays its prefill whole: 10 + 100 ms.
    r1 = sched.schedule("r1", 100, {}, now=0.0)
    assert (r1.overlap_s, r1.step_leader, r1.t_queue) == (0.0, None, 0.0)
    assert r1.t_prefill == pytest.approx(0.11)
    # r2 comes while r1's step runs: it leads the next step, after r1's 100
    # ms left; its fixed 10 ms overlap r1's work.
    r2 = sched.schedule("r2", 100, {}, now=0.01)
    assert (r2.overlap_s, r2.step_leader) == (pytest.approx(0.01), None)
    assert (r2.t_queue, r2.t_prefill) == (pytest.approx(0.1), pytest.approx(0.1))
    # r3 comes while r2's step waits and joins it: 50 ms of its own, after
    # r1's 90 ms left and r2's 100.
    r3 = sched.schedule("r3", 50, {}, now=0.02)
    assert (r3.overlap_s, r3.step_leader) == (pytest.approx(0.01), "r2")
    assert (r3.t_queue, r3.t_prefill) == (pytest.approx(0.19), pytest.approx(0.05))
    assert r3.predicted_ttft_s == pytest.approx(0.24)
    # Once r1's first token is back r2's step runs: r4 leads the next.
    sched.on_first_token("a", "r1", now=0.12)
    r4 = sched.schedule("r4", 10, {}, now=0.13)
    assert (r4.overlap_s, r4.step_leader) == (pytest.approx(0.01), None)
    # With nothing of ours left there, a prefill is whole again.
    for rid in ("r2", "r3", "r4"):
        sched.on_first_token("a", rid, now=0.5)
    assert sched.schedule("r5", 10, {}, now=0.6).t_prefill == pytest.approx(0.02)


def test_the_fixed_part_overlaps_no_more_than_the_work_ahead():
    sched = make_stepped()
    sched.schedule("r1", 100, {}, now=0.0)
    # 5 ms of r1's 110 left: 5 of the next prefill's fixed 10 ms overlap
    # them, so it is priced as on an idle engine, 10 + 100 ms.
    d = sched.schedule("r2", 100, {}, now=0.105)
    assert (d.t_queue, d.overlap_s) == (pytest.approx(0.005), pytest.approx(0.005))
    assert d.predicted_ttft_s == pytest.approx(0.11)


def test_a_step_past_the_engine_budget_is_not_joined():
    sched = make_stepped(step_tokens=120)
    sched.schedule("r1", 100, {}, now=0.0)
    sched.schedule("r2", 100, {}, now=0.0)
    # r2's step holds 100 of the engine's 120 tokens: 50 more start a step
    # of their own (still behind r1 and r2: 50 ms).
    r3 = sched.schedule("r3", 50, {}, now=0.0)
    assert (r3.step_leader, r3.t_prefill) == (None, pytest.approx(0.05))
    # 20 more fit beside r3, the youngest step's leader now.
    assert sched.schedule("r4", 20, {}, now=0.0).step_leader == "r3"
    with pytest.raises(ValueError):
        sched.add_engine("b", step_tokens=0)


def test_a_step_is_measured_once_and_shared_by_its_requests():
    sched = make_stepped()
    fed = sched.engines["a"].prefill_est.fed
    sched.schedule("r1", 100, {}, now=0.0)
    sched.schedule("r2", 100, {}, now=0.01)
    sched.schedule("r3", 50, {}, now=0.02)      # joins r2's step
    sched.on_first_token("a", "r1", now=0.12)
    # r1's step ran alone from its send: 120 ms against 110 predicted.
    assert fed == [(100, 0, pytest.approx(0.12))]
    # r3's answer comes back first: the step ran from r1's first token,
    # 180 ms, predicted 100 + 50 ms (both behind r1: no fixed part); each
    # of its requests is fed its time alone scaled by 180 / 150.
    sched.on_first_token("a", "r3", now=0.30)
    sched.on_first_token("a", "r2", now=0.301)
    assert fed[1:] == [(100, 0, pytest.approx(0.11 * 1.2)), (50, 0, pytest.approx(0.06 * 1.2))]
    # Each answer still has its own TTFT error: r3 predicted 0.24 s, took 0.28.
    assert sched.status(now=0.31)["ttft_error"]["count"] == 3
    assert sched.engines["a"].requests["r3"].ttft_s == pytest.approx(0.28)


def test_a_step_booked_as_marginal_work_leaves_the_late_ratios_alone():
    sched = make_stepped()
    a = sched.engines["a"]
    sched.schedule("r1", 100, {}, now=0.0)
    sched.schedule("r2", 1, {}, now=0.0)     # behind r1: 1 ms booked
    sched.on_first_token("a", "r1", now=0.11)
    # r2's step took 20 ms against its 1 ms booked: 20x is no measure of how
    # late a whole prefill runs.
    sched.on_first_token("a", "r2", now=0.13)
    assert list(a.queue.late_ratios) == [pytest.approx(1.0)]
    # So a request 10 ms past its 110 ms is priced with the rest whole
    # prefills needed when that late (none: as much again, at most its
    # estimate), not 20x its estimate.
    for rid in ("r1", "r2"):
        sched.on_finished("a", rid, now=0.15)
    sched.schedule("r3", 100, {}, now=0.2)
    d = sched.schedule("r4", 10, {}, now=0.32)
    assert d.t_queue == pytest.approx(0.01)
