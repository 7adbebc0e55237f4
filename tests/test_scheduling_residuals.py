"""The residual model: weighted quantiles, ageing, the fallback chain, priors."""
import math

import pytest

from roles.scheduling.residuals import (CLUSTER, ResidualModel, load_level, log_ratio,
                                        weighted_quantile)


def test_weighted_quantile_equal_weights():
    s = [(3.0, 1.0), (1.0, 1.0), (4.0, 1.0), (2.0, 1.0)]
    # cumulative weights 1, 2, 3, 4 of 4 over sorted values 1, 2, 3, 4
    assert weighted_quantile(s, 0.5) == 2.0      # first with cum >= 2
    assert weighted_quantile(s, 0.51) == 3.0     # first with cum >= 2.04
    assert weighted_quantile(s, 0.9) == 4.0      # first with cum >= 3.6
    assert weighted_quantile(s, 0.25) == 1.0


def test_weighted_quantile_uneven_weights_and_empty():
    s = [(1.0, 1.0), (2.0, 1.0), (10.0, 6.0)]
    # total 8: the median target 4 is reached only at 10 (cum 1, 2, 8)
    assert weighted_quantile(s, 0.5) == 10.0
    assert weighted_quantile(s, 0.25) == 2.0     # target 2 reached at 2
    assert weighted_quantile([], 0.9) == 0.0
    assert weighted_quantile([(5.0, 0.0)], 0.5) == 0.0


def test_half_life_decay_moves_the_median():
    m = ResidualModel(half_life_s=10.0, quantile=0.9, min_samples=1)
    m.add("p0", None, 1.0, now=0.0)
    m.add("p0", None, 5.0, now=10.0)
    m.add("p0", None, 5.0, now=10.0)
    m.add("p0", None, 1.0, now=0.0)
    # at t=10 weights: 1.0 -> 0.5 each (total 1), 5.0 -> 1 each (total 2):
    # median target 1.5 > 1, so the median is 5
    assert m.median("p0", None, now=10.0) == 5.0
    # at t=0 (no age for the old ones; the new ones are not older than 0)
    # all weigh 1: cum 1, 2 reaches target 2 at value 1
    assert m.median("p0", None, now=0.0) == 1.0
    st = m.stats(now=10.0)["p0"]
    assert st.samples == 4 and st.weight == pytest.approx(3.0)


def test_fallback_chain_cluster_node_level():
    m = ResidualModel(half_life_s=60.0, quantile=0.9, min_samples=3)
    assert m.median("a", 1, now=0.0) == 0.0 and m.key_for("a", 1) is None
    # one sample on node b: the cluster holds 1 (< min): no residual yet
    m.add("b", 0, 0.5, now=0.0)
    assert m.key_for("a", 1) is None and m.median("a", 1, now=0.0) == 0.0
    # node a, level 1: three samples -> its own level key
    for r in (0.1, 0.2, 0.3):
        m.add("a", 1, r, now=0.0)
    assert m.key_for("a", 1) == ("a", 1)
    assert m.median("a", 1, now=0.0) == 0.2
    # node a at level 2 has none: falls back to node a (3 samples)
    assert m.key_for("a", 2) == ("a",)
    assert m.median("a", 2, now=0.0) == 0.2
    # node c has none: falls back to the cluster (4 samples 0.1 .. 0.5 at
    # levels 0 and 1)
    assert m.key_for("c", 1) == CLUSTER
    assert m.median("c", 1, now=0.0) == 0.2     # cum 1, 2 of 4 -> 0.2
    assert m.bound("c", 1, now=0.0) == 0.5      # target 3.6 -> last
    # at level 0 the cluster holds one sample of that load or lighter (b's)
    assert m.key_for("c", 0) is None and m.median("c", 0, now=0.0) == 0.0
    m.forget_node("a")
    assert m.key_for("a", 1) == CLUSTER
    # the cluster below min_samples: nothing at all
    few = ResidualModel(half_life_s=60.0, min_samples=3)
    few.add("a", 0, 1.0, now=0.0)
    few.add("b", 0, 1.0, now=0.0)
    assert few.key_for("a", 0) is None and few.bound("a", 0, now=0.0) == 0.0


def test_a_query_falls_back_only_to_samples_of_its_load_or_lighter():
    # Node a: three residuals at level 0 (0.0, 0.1, 0.2 s) and eight at
    # level 4 under overload (+1.0 s).  min_samples 3.
    m = ResidualModel(half_life_s=60.0, quantile=0.9, min_samples=3)
    for r in (0.0, 0.1, 0.2):
        m.add("a", 0, r, now=0.0)
    for _ in range(8):
        m.add("a", 4, 1.0, now=0.0)
    # Level 1 has no key of its own: node a's samples at levels <= 1 are the
    # three of level 0 (median 0.1, 0.9-quantile 0.2), not the overload's.
    assert m.key_for("a", 1, now=0.0) == ("a",)
    assert m.median("a", 1, now=0.0) == 0.1
    assert m.bound("a", 1, now=0.0) == 0.2
    # Level 5 pools all eleven: cum 3 of 11 at 0.2, so median and bound 1.0
    assert m.key_for("a", 5, now=0.0) == ("a",)
    assert m.median("a", 5, now=0.0) == 1.0
    # An idle node b: the cluster at level 0 holds a's three level-0 samples
    assert m.key_for("b", 0, now=0.0) == CLUSTER
    assert m.bound("b", 0, now=0.0) == 0.2
    # A level unknown to the query (None) reads every sample.
    assert m.median("a", None, now=0.0) == 1.0
    # With only overload samples, an idle node's level-0 query is the cost
    # model alone, not the +1.0 s that would refuse it.
    o = ResidualModel(half_life_s=60.0, quantile=0.9, min_samples=3)
    for _ in range(8):
        o.add("a", 4, 1.0, now=0.0)
    assert o.key_for("a", 0, now=0.0) is None and o.bound("a", 0, now=0.0) == 0.0
    assert o.bound("a", 4, now=0.0) == 1.0


def test_prior_priced_samples_get_no_weight():
    m = ResidualModel(half_life_s=60.0, quantile=0.9, min_samples=1)
    m.add("p", 0, 100.0, now=0.0, priced_by_prior=True)
    assert m.median("p", 0, now=0.0) == 0.0 and m.prior_skipped == 1
    m.add("p", 0, 0.01, now=0.0)
    m.add("p", 0, 100.0, now=0.0, priced_by_prior=True)
    assert m.bound("p", 0, now=0.0) == 0.01


def test_window_is_bounded():
    m = ResidualModel(half_life_s=60.0, min_samples=2, window=4)
    for i in range(10):
        m.add("p", None, float(i), now=0.0)
    assert m.stats(0.0)["p"].samples == 4
    assert m.median("p", None, now=0.0) == 7.0   # window 6..9, target 2 -> 7


def test_tbt_log_ratio_and_levels():
    assert log_ratio(0.2, 0.1) == pytest.approx(math.log(2))
    assert log_ratio(0.0, 0.1) is None and log_ratio(0.1, math.inf) is None
    m = ResidualModel(half_life_s=60.0, quantile=0.9, min_samples=1)
    m.add("d", None, log_ratio(0.2, 0.1), now=0.0)
    # predicted 50 ms scaled by exp(q-quantile log-ratio) = 100 ms
    assert 0.05 * math.exp(m.bound("d", None, 0.0)) == pytest.approx(0.1)
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 7, 8)] == [0, 1, 2, 2, 3, 3, 4]


def test_bad_parameters_rejected():
    with pytest.raises(ValueError):
        ResidualModel(half_life_s=0)
    with pytest.raises(ValueError):
        ResidualModel(quantile=1.0)
    with pytest.raises(ValueError):
        ResidualModel(min_samples=10, window=5)


# ---- the residual model inside the Scheduler --------------------------------

from dataclasses import fields  # noqa: E402

from mooncaked.node.sections import ConductorSection  # noqa: E402
from roles.scheduling import (Rejection, Scheduler, SchedulerConfig, ScheduleRequest,  # noqa: E402
                              scheduler_config)
from roles.scheduling.decode_estimator import DecodeEstimator  # noqa: E402
from roles.scheduling.estimators import PolynomialPrefillEstimator  # noqa: E402
from roles.scheduling.transfer_estimator import TransferEstimator  # noqa: E402

BS = 100


def sched(**cfg):
    cfg.setdefault("queue_from_bookings", False)
    cfg.setdefault("per_node_prefill_fit", False)
    s = Scheduler(SchedulerConfig(policy="load_balance", kv_bytes_per_token=1000,
                                  residual_half_life_s=math.inf, residual_min_samples=4, **cfg),
                  PolynomialPrefillEstimator({"n": 1e-3}), TransferEstimator(1e9),
                  DecodeEstimator(0.01, 0.0, 0.0))
    s.add_prefill_node("p0")
    s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)
    return s


def req(rid, tokens, out=8):
    return ScheduleRequest(rid, tuple(range(1000, 1000 + -(-tokens // BS))), tokens, BS, out)


STEP = 0.01  # the decode estimator's step in sched()


def finish_missing(s, misses, start=0.0, tbt=None, prior=False):
    """One request of 100 tokens (0.1 s predicted) per miss, alone in flight,
    whose first token comes ``miss`` seconds after its prediction."""
    now = start
    for i, miss in enumerate(misses):
        rid = f"m{start}-{i}"
        d = s.schedule(req(rid, 100), now=now)
        assert d.predicted_ttft_s == pytest.approx(0.1 + s.ttft_residuals.median("p0", 0, now))
        s.inflight[rid].priced_by_prior = prior
        s.on_prefill_finished("p0", rid, now=now + 0.1 + miss, actual_seconds=0.1)
        s.on_decode_finished("d0", rid, now + 1.0, None if tbt is None else [STEP] + [tbt] * 2)
        now += 10.0
    return now


def test_choice_adds_the_median_and_admission_the_quantile():
    s = sched(ttft_slo_s=1.0)
    now = finish_missing(s, [0.1, 0.2, 0.3, 0.4])
    # median 0.2, 0.9-quantile 0.4: limit = SLO less their spread, 0.8
    assert s.ttft_admit_limit("p0", now) == pytest.approx(0.8)
    d = s.schedule(req("ok", 500), now=now)               # 0.5 + 0.4 <= 1.0
    assert d.predicted_ttft_s == pytest.approx(0.7)
    s.on_prefill_finished("p0", "ok", now=now, actual_seconds=0.0)
    s.on_decode_finished("d0", "ok", now)
    r = s.schedule(req("late", 700), now=now)              # 0.7 + 0.4 > 1.0
    assert isinstance(r, Rejection) and r.reason == "ttft_slo"
    assert r.limit_s == pytest.approx(0.8) and r.predicted_ttft_s == pytest.approx(0.9)


def test_the_time_a_request_already_waited_is_predicted_exactly():
    """A request scheduled 0.05 s after it arrived (body read, tokenizing):
    its TTFT, counted from its arrival, is that plus the 0.1 s model; the
    residual learns only what the model missed; admission counts it."""
    s = sched(ttft_slo_s=1.0)
    now = 0.0
    for i in range(4):
        r = ScheduleRequest(f"w{i}", (1000,), 100, BS, 8, waited_s=0.05)
        d = s.schedule(r, now=now)
        assert d.predicted_ttft_s == pytest.approx(0.05 + 0.1)
        # Its decode joins at its first token: 0.1 s from now.
        assert s.decode["d0"].booked[r.request_id].join_at == pytest.approx(now + 0.1)
        # First token 0.12 s after scheduling: 0.17 s after arrival.
        s.on_prefill_finished("p0", r.request_id, now=now + 0.12, actual_seconds=0.1,
                              actual_ttft_s=0.17)
        s.on_decode_finished("d0", r.request_id, now + 1.0)
        now += 10.0
    assert s.ttft_residuals.median("p0", 0, now) == pytest.approx(0.02)
    d = s.schedule(ScheduleRequest("late", (1000,), 100, BS, 8, waited_s=0.9), now=now)
    assert isinstance(d, Rejection) and d.reason == "ttft_slo"
    assert d.predicted_ttft_s == pytest.approx(0.9 + 0.1 + 0.02)
    with pytest.raises(ValueError, match="waited_s"):
        ScheduleRequest("bad", (1000,), 100, BS, 8, waited_s=-1.0)


def test_prior_priced_requests_teach_nothing():
    s = sched(ttft_slo_s=1.0)
    now = finish_missing(s, [0.5] * 6, prior=True)
    assert s.ttft_residuals.key_for("p0", 0) is None
    assert s.ttft_residuals.prior_skipped == 6
    assert s.ttft_admit_limit("p0", now) == pytest.approx(1.0)


def test_tbt_admission_scales_by_the_quantile_log_ratio():
    s = sched(ttft_slo_s=30.0, tbt_slo_s=0.015)
    assert s.tbt_ratio("d0", 0.0) == 1.0
    now = finish_missing(s, [0.0] * 4, tbt=0.02)           # measured 2x the 0.01 s step
    assert s.tbt_ratio("d0", now) == pytest.approx(2.0)
    r = s.schedule(req("x", 100), now=now)
    assert isinstance(r, Rejection) and r.reason == "tbt_slo"
    # 8 tokens, 7 intervals: the first a step (no hand-off learned), the
    # other 6 twice the step: (0.01 + 6 x 0.02) / 7.
    assert r.predicted_tbt_s == pytest.approx(0.13 / 7) and r.limit_s == pytest.approx(0.015)


def test_a_short_reply_is_priced_by_its_hand_off_a_long_one_by_its_steps():
    # Replies whose first interval took 0.05 s (a step of 0.01 s plus a
    # hand-off of 0.04 s) and the rest 0.01 s each: no step residual, a
    # hand-off residual of 0.04 s.  A 2-token reply's one interval is the
    # hand-off (0.05 s > SLO 0.03 s); a 41-token reply's mean is
    # 0.01 + 0.04 / 40 = 0.011 s.
    s = sched(ttft_slo_s=30.0, tbt_slo_s=0.03)
    now = 0.0
    for i in range(4):
        d = s.schedule(req(f"h{i}", 100), now=now)
        s.on_prefill_finished("p0", d.request_id, now=now + 0.1, actual_seconds=0.1)
        s.on_decode_finished("d0", d.request_id, now + 1.0, [0.05, STEP, STEP])
        now += 10.0
    assert s.tbt_ratio("d0", now) == pytest.approx(1.0)
    assert s.handoff_s("d0", now) == pytest.approx(0.04)
    short = s.schedule(req("short", 100, out=2), now=now)
    assert isinstance(short, Rejection) and short.reason == "tbt_slo"
    assert short.predicted_tbt_s == pytest.approx(0.05)
    long = s.schedule(req("long", 100, out=41), now=now)
    assert not isinstance(long, Rejection)
    assert long.predicted_tbt_s == pytest.approx(0.011)


def test_the_simulator_runs_the_conductors_configuration():
    conductor = scheduler_config(ConductorSection())
    default = SchedulerConfig()
    # Every field but the policy's parameters (the policy's own defaults) is
    # the SchedulerConfig default.
    for f in fields(SchedulerConfig):
        if f.name != "policy_params":
            assert getattr(conductor, f.name) == getattr(default, f.name), f.name
    assert conductor.policy_params == {"kvcache_balancing_threshold": 1.0}


def test_trust_ages_with_the_samples_so_a_refusing_window_cannot_last_for_ever():
    # Eight residuals of +2 s at t=0 (min_samples 8, half-life 10 s): trusted
    # then, so admission adds 2 s to every prediction and refuses; refusing
    # brings no new samples.  Their total weight is 8 x 0.5**(t/10): below 8
    # as soon as they age, so the node falls back to the cluster's window
    # (the same samples) and then to the cost model alone (0).
    m = ResidualModel(half_life_s=10.0, quantile=0.9, min_samples=8)
    for _ in range(8):
        m.add("a", 0, 2.0, now=0.0)
    assert m.bound("a", 0, now=0.0) == 2.0
    assert m.key_for("a", 0, now=0.0) == ("a", 0)
    assert m.key_for("a", 0, now=1.0) is None
    assert m.bound("a", 0, now=1.0) == 0.0
    # A fresh sample renews trust only once the aged ones plus it weigh 8:
    # at t=1, 8 x 0.5**0.1 + 1 = 8.46.
    m.add("a", 0, 0.5, now=1.0)
    assert m.key_for("a", 0, now=1.0) == ("a", 0)


def test_the_decode_node_is_chosen_on_median_residuals_and_admitted_on_the_quantile():
    # d0's hand-offs: usually none, one in four 90 ms (median 0, 0.9-quantile
    # 0.09 s); d1's: always 30 ms.  A 2-token reply's TBT is its hand-off
    # plus a step (0.01 s): typically 0.01 s on d0 and 0.04 s on d1, so d0
    # is chosen; its admission bound is 0.01 + 0.09 = 0.1 s, what the
    # request is checked against.  (On the bounds alone, d1 would be chosen.)
    s = sched(ttft_slo_s=30.0, tbt_slo_s=1.0)
    s.add_decode_node("d1", page_budget=10_000, page_tokens=BS)
    for r0, r1 in ((0.0, 0.03), (0.0, 0.03), (0.0, 0.03), (0.09, 0.03)):
        s.handoff_residuals.add("d0", 0, r0, now=0.0)
        s.handoff_residuals.add("d1", 0, r1, now=0.0)
    d = s.schedule(req("short", 100, out=2), now=1.0)
    assert d.decode_node == "d0"
    assert d.predicted_tbt_s == pytest.approx(0.1)
