"""The admission quantile steered by admitted requests' outcomes (attainment.py)."""
import math

import pytest

from roles.scheduling import Rejection, Scheduler, SchedulerConfig, ScheduleRequest
from roles.scheduling.attainment import Q_MAX, Q_MIN, AdmissionQuantile, met_slos
from roles.scheduling.engines import EngineScheduler
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PolynomialPrefillEstimator
from roles.scheduling.transfer_estimator import TransferEstimator


def test_each_miss_raises_and_each_success_lowers_the_quantile_by_hand():
    a = AdmissionQuantile(0.9, target=0.95, step=0.02)
    # a miss: + 0.02 * (1 - 0.05) = + 0.019
    assert a.observe(False) == pytest.approx(0.919)
    # a success: - 0.02 * 0.05 = - 0.001
    assert a.observe(True) == pytest.approx(0.918)
    st = a.stats()
    assert st.observed == 2 and st.recent_attainment == 0.5 and st.target == 0.95


def test_misses_at_the_target_share_leave_the_quantile_where_it_is():
    a = AdmissionQuantile(0.8, target=0.95, step=0.02)
    for _ in range(5):          # one miss in 20: + 0.019 - 19 x 0.001 = 0
        a.observe(False)
        for _ in range(19):
            a.observe(True)
    assert a.quantile == pytest.approx(0.8)
    assert a.stats().recent_attainment == pytest.approx(0.95)


def test_the_quantile_stays_between_the_median_and_q_max():
    a = AdmissionQuantile(0.9, target=0.95, step=0.02)
    for _ in range(1000):
        a.observe(True)
    assert a.quantile == Q_MIN == 0.5    # never admits what more likely misses
    for _ in range(1000):
        a.observe(False)
    assert a.quantile == Q_MAX


def test_without_a_target_the_quantile_is_fixed():
    a = AdmissionQuantile(0.9, target=None)
    for met in (False, True, False):
        assert a.observe(met) == 0.9
    assert a.stats().observed == 3


def test_bad_parameters_are_refused():
    for kwargs in ({"start": 1.0, "target": 0.9}, {"start": 0.9, "target": 1.0},
                   {"start": 0.9, "target": 0.9, "step": 0.0}):
        with pytest.raises(ValueError):
            AdmissionQuantile(**kwargs)
    with pytest.raises(ValueError):
        SchedulerConfig(slo_attainment=1.5)


def test_met_slos_judges_the_ttft_and_the_mean_interval():
    assert met_slos(0.9, [0.05, 0.15], 1.0, 0.1)          # mean 0.1: met
    assert not met_slos(0.9, [0.05, 0.16], 1.0, 0.1)      # mean 0.105
    assert not met_slos(1.1, [0.01], 1.0, 0.1)            # TTFT over
    assert met_slos(1.0, [], 1.0, 0.1)                    # one token: TTFT alone


# ---- inside the schedulers ---------------------------------------------------

BS = 100


def sched(**cfg):
    s = Scheduler(SchedulerConfig(policy="load_balance", kv_bytes_per_token=1000,
                                  residual_half_life_s=math.inf, residual_min_samples=4,
                                  queue_from_bookings=False, per_node_prefill_fit=False,
                                  ttft_slo_s=1.0, tbt_slo_s=0.1, **cfg),
                  PolynomialPrefillEstimator({"n": 1e-3}), TransferEstimator(1e9),
                  DecodeEstimator(0.01, 0.0, 0.0))
    s.add_prefill_node("p0")
    s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)
    return s


def req(rid, tokens, out=8):
    return ScheduleRequest(rid, tuple(range(1000, 1000 + -(-tokens // BS))), tokens, BS, out)


def run(s, rid, now, miss):
    """A 100-token request (0.1 s predicted) whose first token comes ``miss``
    s after its prediction, then streams 7 intervals of 0.01 s."""
    d = s.schedule(req(rid, 100), now=now)
    assert not isinstance(d, Rejection)
    s.on_prefill_finished("p0", rid, now=now + 0.1 + miss, actual_seconds=0.1)
    s.on_decode_finished("d0", rid, now + 1.0, [0.01] * 7)


def test_requests_that_all_meet_the_slo_lower_the_admission_quantile():
    # Residuals 0.0, 0.1, ..., 0.7 s (min_samples 4), all within the 1 s SLO.
    # At q = 0.9 the bound is the 0.7 s residual, at the median 0.3 s: a
    # 0.6 s prediction (600 tokens) is refused at 0.9 and admitted once the
    # quantile has come down, without a single miss seen.
    fixed, steered = sched(slo_attainment=None), sched()
    for s in (fixed, steered):
        for i in range(8):
            run(s, f"r{i}", 10.0 * i, 0.1 * i)
    assert fixed.admission.quantile == 0.9
    assert steered.admission.quantile == pytest.approx(0.9 - 8 * 0.02 * 0.05)
    for i in range(8, 400):      # the same outcomes again and again
        run(steered, f"r{i}", 10.0 * i, 0.1 * (i % 8))
    assert steered.admission.quantile == Q_MIN
    assert steered.ttft_residuals.quantile == steered.tbt_residuals.quantile == Q_MIN
    now = 10.0 * 400
    assert isinstance(fixed.schedule(req("x", 600), now=now), Rejection)
    assert not isinstance(steered.schedule(req("x", 600), now=now), Rejection)


def test_misses_raise_the_quantile_and_a_cut_stream_is_not_judged():
    s = sched()
    run(s, "late", 0.0, 1.5)                     # TTFT 1.6 s > 1 s
    assert s.admission.quantile == pytest.approx(0.9 + 0.02 * 0.95)
    d = s.schedule(req("cut", 100), now=10.0)
    s.on_prefill_finished("p0", d.request_id, now=10.1, actual_seconds=0.1)
    s.on_decode_finished("d0", d.request_id, 11.0, None)    # the client left
    assert s.admission.stats().observed == 1


def test_the_engine_scheduler_steers_its_quantile_too():
    s = EngineScheduler(SchedulerConfig(ttft_slo_s=1.0, tbt_slo_s=0.1),
                        PolynomialPrefillEstimator({"n": 1e-3}), DecodeEstimator(0.01, 0.0, 0.0))
    s.add_engine("e0")
    d = s.schedule("a", 100, {"e0": 0}, now=0.0)
    assert d.engine == "e0"
    s.on_first_token("e0", "a", now=0.05)
    s.on_finished("e0", "a", now=1.0, mean_tbt_s=0.2, tokens=8)   # ITL over 0.1 s
    assert s.admission.quantile == pytest.approx(0.9 + 0.02 * 0.95)
    assert s.ttft_residuals.quantile == s.admission.quantile
