"""Decode load at join time, the TBT fit, and prediction-based early rejection.

Every expectation is worked out by hand in the comments: the prefill
estimator is 1 ms per computed token, so a request's predicted TTFT (and
hence when it joins its decode node) is its prompt length in ms.
"""
import math
from collections import deque

import pytest

from roles.scheduling import (BookedJoin, DecodeEstimator, DecodeLoad, DecodeStep, Decision,
                              NodeReport, PolynomialPrefillEstimator, Rejection, RunningSeq,
                              ScheduleRequest, Scheduler, SchedulerConfig, TransferEstimator,
                              fit_decode)
from roles.scheduling.registry import make_policy

BS = 100


def make_sched(decode=(0.02, 0.001, 0.0), tbt_slo=1.0, ttft_slo=30.0, n_decode=1, **cfg):
    s = Scheduler(SchedulerConfig(policy="load_balance", ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
                                  kv_bytes_per_token=1000, **cfg),
                  PolynomialPrefillEstimator({"n": 1e-3}), TransferEstimator(1e9),
                  DecodeEstimator(*decode))
    s.add_prefill_node("p0")
    for i in range(n_decode):
        s.add_decode_node(f"d{i}", page_budget=10_000, page_tokens=BS)
    return s


def req(rid, tokens, out=8):
    return ScheduleRequest(rid, tuple(range(1000, 1000 + -(-tokens // BS))), tokens, BS, out)


def report_running(s, node, at, seqs, tbt):
    """The node reports its sequences; its measured step time is set
    directly, so that the estimator's level is not calibrated on it and the
    TBT figures below stay the hand-computed ones."""
    s.on_node_report(node, NodeReport(at=at, batch_size=len(seqs),
                                      context_tokens=sum(q.context_tokens for q in seqs.values()),
                                      decode_sequences=seqs), at)
    s.decode[node].recent_tbt_s = tbt


def three_running(s, at=10.0):
    # a: 100 tokens of context, 5 left; b: 200, 20 left; c: 50, 50 left; 0.1 s a step.
    report_running(s, "d0", at, {"a": RunningSeq(100, 5), "b": RunningSeq(200, 20),
                                 "c": RunningSeq(50, 50)}, tbt=0.1)


def test_running_requests_leave_the_batch_when_their_tokens_run_out():
    s = make_sched()
    three_running(s)
    assert s.step_seconds("d0") == 0.1
    # At the report: all three.
    assert s.predict_decode_load("d0", 10.0) == DecodeLoad(3, 350)
    # 1 s = 10 steps later: a (5 left) is done; b at 200+10, c at 50+10.
    assert s.predict_decode_load("d0", 11.0) == DecodeLoad(2, 270)
    # 3 s = 30 steps: b (20 left) is done too; c at 50+30.
    assert s.predict_decode_load("d0", 13.0) == DecodeLoad(1, 80)
    # 6 s = 60 steps: all done.
    assert s.predict_decode_load("d0", 16.0) == DecodeLoad(0, 0)


def test_booked_requests_join_at_their_predicted_ttft():
    s = make_sched()
    three_running(s)
    # x: 300-token prompt at t=10.2 -> TTFT 0.3 s -> joins at 10.5, 8 tokens
    # (7 decode steps: in the batch until 10.5 + 0.7 = 11.2).
    x = s.schedule(req("x", 300), now=10.2)
    assert isinstance(x, Decision) and x.predicted_ttft_s == pytest.approx(0.3)
    assert s.decode["d0"].booked["x"] == BookedJoin(pytest.approx(10.5), 300, 8)
    s.on_prefill_finished("p0", "x", now=10.5, actual_seconds=0.3)  # the prefill queue is empty again
    # y: 200 tokens at t=11.8 -> joins at 12.0.
    s.schedule(req("y", 200), now=11.8)
    assert s.decode["d0"].booked["y"].join_at == pytest.approx(12.0)
    # At 11.0: b, c as above (2, 270) + x, 5 steps in: 300 + 5.  y not yet.
    assert s.predict_decode_load("d0", 11.0) == DecodeLoad(3, 575)
    # At 12.5: only c (50 + 25) and y (5 steps in: 200 + 5); x left at 11.2.
    assert s.predict_decode_load("d0", 12.5) == DecodeLoad(2, 280)
    # The node reports x running (context 303, 4 left): counted once, from the report.
    report_running(s, "d0", 11.0, {"b": RunningSeq(210, 10), "c": RunningSeq(60, 40),
                                   "x": RunningSeq(303, 4)}, tbt=0.1)
    assert s.predict_decode_load("d0", 11.0) == DecodeLoad(3, 573)
    # Finished requests leave both the booking and the reported batch.
    s.on_decode_finished("d0", "x", 11.4)
    assert "x" not in s.decode["d0"].booked and "x" not in s.decode["d0"].running
    assert s.predict_decode_load("d0", 11.0) == DecodeLoad(2, 270)


def test_a_late_booking_joins_after_the_report_that_missed_it():
    s = make_sched()
    s.schedule(req("x", 300), now=0.0)  # joins at 0.3, 8 tokens
    # step time: no measured TBT yet -> the estimator's for the current
    # batch (x booked: 1) = 0.02 + 0.001 = 0.021 s.
    assert s.step_seconds("d0") == pytest.approx(0.021)
    # No report yet: it joined at 0.3 and left after 7 steps (0.447).
    assert s.predict_decode_load("d0", 0.4) == DecodeLoad(1, 300 + 4)
    assert s.predict_decode_load("d0", 5.0) == DecodeLoad(0, 0)
    # A report at 5.0 does not name it: its prefill is late; it joins at 5.0
    # at the earliest, and is counted from there.
    s.on_node_report("d0", NodeReport(at=5.0, batch_size=0, decode_sequences={}), 5.0)
    assert s.predict_decode_load("d0", 5.0) == DecodeLoad(1, 300)
    assert s.predict_decode_load("d0", 5.1, step_s=0.05) == DecodeLoad(1, 302)


def test_tbt_is_predicted_at_the_load_when_the_request_joins():
    # TBT = 0.01 + 0.01 * batch; SLO 45 ms: 3 running + this one = 50 ms.
    s = make_sched(decode=(0.01, 0.01, 0.0), tbt_slo=0.045)
    three_running(s)
    # 100 tokens: TTFT 0.1 s -> joins at 10.1 (1 step: a, b, c still run).
    # Predicted TBT: 0.01 + 0.01 * (3 + 1) = 0.05 > 0.045: rejected.
    soon = s.schedule(req("soon", 100), now=10.0)
    assert isinstance(soon, Rejection) and soon.reason == "tbt_slo"
    assert soon.predicted_tbt_s == pytest.approx(0.05)
    # 2500 tokens: TTFT 2.5 s -> joins at 12.5 (25 steps: a and b are done).
    # Predicted TBT: 0.01 + 0.01 * (1 + 1) = 0.03: accepted, although the
    # batch *now* (3 + 1) would have refused it.
    late = s.schedule(req("late", 2500), now=10.0)
    assert isinstance(late, Decision) and late.predicted_tbt_s == pytest.approx(0.03)
    assert s.decode_est.seconds(3 + 1, 0) > s.config.tbt_slo_s


def test_requests_booked_to_join_count_against_an_idle_node():
    # An idle node with 3 requests booked to join at 0.3 s: the 4th one,
    # joining at 0.3 s too, sees a batch of 3 (+ itself): 0.05 > 0.045.
    s = make_sched(decode=(0.01, 0.01, 0.0), tbt_slo=0.045, ttft_slo=30.0)
    s.prefill["p0"].reported_queue_s = 0.0
    for i in range(3):
        d = s.schedule(req(f"r{i}", 300, out=100), now=0.0)
        assert isinstance(d, Decision)
        # Prefill bookings queue up on the single prefill node: the i-th
        # joins at (i + 1) * 0.3 s.
        assert s.decode["d0"].booked[f"r{i}"].join_at == pytest.approx(0.3 * (i + 1))
    # r3 queues behind 0.9 s of prefill: joins at 1.2 s, when r0..r2 run.
    r3 = s.schedule(req("r3", 300, out=100), now=0.0)
    assert isinstance(r3, Rejection) and r3.reason == "tbt_slo"
    assert r3.predicted_ttft_s == pytest.approx(1.2)
    assert r3.predicted_tbt_s == pytest.approx(0.05)


def test_least_loaded_decode_node_at_join_time_is_chosen():
    s = make_sched(n_decode=2)
    three_running(s)                      # d0 busy
    report_running(s, "d1", 10.0, {"z": RunningSeq(10, 1)}, tbt=0.1)  # d1: one about to end
    d = s.schedule(req("r", 300), now=10.0)
    # joins at 10.3: d0 holds a, b, c (3 steps in); d1's z ended after 1 step.
    assert d.decode_node == "d1"
    assert d.predicted_tbt_s == pytest.approx(0.02 + 0.001 * 1)


def test_decode_fit_recovers_exact_coefficients():
    truth = (0.005, 0.002, 1e-6)
    samples = [(b, k, truth[0] + truth[1] * b + truth[2] * k)
               for b in (1, 2, 4, 8, 16) for k in (100, 2000, 9000)]
    c0, cb, ck = fit_decode(samples, prior=(1.0, 1.0, 1.0), prior_weight=0.0)
    assert (c0, cb, ck) == (pytest.approx(0.005), pytest.approx(0.002), pytest.approx(1e-6))


def test_decode_fit_stays_non_negative_and_near_the_prior_on_one_batch_size():
    # Steps all at batch 4 with 0 context, 30 ms each: c0 and c_batch cannot
    # be told apart; the prior (10 ms + 2.5 ms/seq = 20 ms at batch 4) gets
    # scaled up to the measurement rather than made up, and the prediction
    # at batch 4 matches what was measured.
    samples = [(4, 0, 0.03)] * 40
    c0, cb, ck = fit_decode(samples, prior=(0.01, 0.0025, 0.0), prior_weight=4.0)
    assert min(c0, cb, ck) >= 0.0
    assert c0 + 4 * cb == pytest.approx(0.03, rel=0.05)
    assert c0 > 0 and cb > 0
    # Decreasing step times in the batch cannot give a negative slope.
    c0, cb, _ = fit_decode([(1, 0, 0.05), (8, 0, 0.01)], prior=(0.0, 0.0, 0.0))
    assert cb >= 0.0


def test_online_decode_fit_from_node_reports_skips_steps_seen_before():
    est = DecodeEstimator(0.01, 0.001, 0.0, refit_every=2, prior_weight=0.0)
    s = Scheduler(SchedulerConfig(), PolynomialPrefillEstimator({"n": 1e-4}),
                  TransferEstimator(1e9), est)
    s.add_decode_node("d0", page_budget=100, page_tokens=16)
    # The node measures t = 0.004 + 0.003 b.
    steps = tuple(DecodeStep(i, b, 0, 0.004 + 0.003 * b) for i, b in enumerate((1, 2, 3, 4)))
    s.on_node_report("d0", NodeReport(at=1.0, decode_steps=steps), 1.0)
    assert len(est.samples) == 4
    # The next report repeats the last two steps and adds two: only two are new.
    more = steps[2:] + (DecodeStep(4, 6, 0, 0.022), DecodeStep(5, 8, 0, 0.028))
    s.on_node_report("d0", NodeReport(at=2.0, decode_steps=more), 2.0)
    assert len(est.samples) == 6
    # The fit (every 2 samples) is the measurements', not the 10 ms + 1 ms/seq prior's.
    assert est.seconds(4, 0) == pytest.approx(0.004 + 0.003 * 4)
    # A restarted node counts steps from 0 again: its steps are not ignored.
    s.on_node_report("d0", NodeReport(at=3.0, decode_steps=(DecodeStep(0, 2, 0, 0.01),)), 3.0)
    assert len(est.samples) == 7


def test_learned_ttft_bias_moves_predictions_and_decays():
    s = make_sched(ttft_bias_alpha=0.5, ttft_bias_half_life_s=10.0, ttft_slo=2.0)
    a = s.schedule(req("a", 500), now=0.0)  # predicted 0.5 s
    assert a.predicted_ttft_s == pytest.approx(0.5)
    # It took 1.5 s: the estimators missed 1.0 s -> bias 0.5 * 1.0 = 0.5.
    s.on_prefill_finished("p0", "a", now=1.5, actual_seconds=0.5)
    assert s.ttft_bias(1.5) == pytest.approx(0.5)
    s.on_decode_finished("d0", "a", 1.5)
    b = s.schedule(req("b", 500), now=1.5)
    assert b.predicted_ttft_s == pytest.approx(0.5 + 0.5)
    # b took 1.5 s as well: missed = 1.5 - (1.0 - 0.5) = 1.0; the old bias
    # has decayed for 1.5 s: 0.5 * 0.5 ** 0.15 = 0.4506 -> 0.5*0.4506 + 0.5*1.0.
    s.on_prefill_finished("p0", "b", now=3.0, actual_seconds=0.5)
    assert s.ttft_bias(3.0) == pytest.approx(0.5 * 0.5 * 0.5 ** 0.15 + 0.5)
    s.on_decode_finished("d0", "b", 3.0)
    # Ten seconds without a sample halve it.
    assert s.ttft_bias(13.0) == pytest.approx(s.ttft_bias(3.0) / 2)
    # 1800 tokens: 1.8 s + 0.725 bias > 2.0 SLO now; at t=33 (bias 0.09) it fits.
    assert isinstance(s.schedule(req("c", 1800), now=3.0), Rejection)
    assert isinstance(s.schedule(req("d", 1800), now=33.0), Decision)


def test_without_bias_learning_predictions_are_the_estimators_alone():
    s = make_sched()
    s.schedule(req("a", 500), now=0.0)
    s.on_prefill_finished("p0", "a", now=5.0, actual_seconds=0.5)
    assert s.ttft_bias(5.0) == 0.0
    assert s.estimator_error()["mean_abs_s"] == pytest.approx(4.5)


def test_bad_decode_estimator_and_bias_settings():
    with pytest.raises(ValueError):
        DecodeEstimator(0.01, 0.0, 0.0, refit_every=-1)
    with pytest.raises(ValueError):
        SchedulerConfig(ttft_bias_alpha=1.5)
    with pytest.raises(ValueError):
        fit_decode([], prior=(0.0, 0.0, 0.0))
    assert math.isfinite(DecodeEstimator(0.01, 0.0, 0.0).seconds(1, 0))


def test_admission_keeps_headroom_under_the_slo():
    # 950 tokens: predicted 0.95 s against a 1 s SLO: admitted at fraction 1,
    # refused at 0.9 (limit 0.9 s), with Retry-After >= the minimum.
    assert isinstance(make_sched(ttft_slo=1.0).schedule(req("a", 950), now=0.0), Decision)
    r = make_sched(ttft_slo=1.0, slo_admit_fraction=0.9).schedule(req("a", 950), now=0.0)
    assert isinstance(r, Rejection) and r.reason == "ttft_slo" and r.retry_after_s == 1.0
    with pytest.raises(ValueError):
        SchedulerConfig(slo_admit_fraction=0.0)


def test_bias_leaves_the_prefill_error_to_the_prefill_fit():
    s = make_sched(ttft_bias_alpha=0.5)
    s.schedule(req("a", 500), now=0.0)  # predicted: queue 0 + prefill 0.5
    # The prefill took 1.2 s (not 0.5) and the first token came at 1.5: the
    # refit learns the 0.7 s; only the 0.3 s outside the prefill is bias.
    s.on_prefill_finished("p0", "a", now=1.5, actual_seconds=1.2)
    assert s.ttft_bias(1.5) == pytest.approx(0.5 * 0.3)


def test_each_prefill_node_learns_its_own_bias():
    # load_balance sends each request to the node with the shorter queue.
    s = make_sched(ttft_bias_alpha=0.5)
    s.add_prefill_node("p1")
    s.schedule(req("a", 500), now=0.0)                # p0, predicted 0.5 s
    s.on_prefill_finished("p0", "a", now=1.5, actual_seconds=0.5)   # 1.0 s missed
    s.on_decode_finished("d0", "a", 1.5)
    # p1 has no record yet: it gets the bias over all nodes.
    assert s.ttft_bias(1.5, "p1") == s.ttft_bias(1.5) == pytest.approx(0.5)
    s.schedule(req("b", 500), now=1.5)
    s.on_prefill_finished("p0", "b", now=2.0, actual_seconds=0.5)   # on time: missed 0
    s.on_decode_finished("d0", "b", 2.0)
    # p0's own: 0.5 halved (its sample missed nothing), decayed 0.5 s at 10 s half-life.
    assert s.ttft_bias(2.0, "p0") == pytest.approx(0.5 * 0.5 * 0.5 ** 0.05)
    # ... and its prediction carries its own bias, not another node's.
    s._node_ttft_bias["p1"] = (0.3, 2.0)
    d = s.schedule(req("c", 500), now=2.0)
    assert d.predicted_ttft_s == pytest.approx(0.5 + s.ttft_bias(2.0, d.prefill_node))
    assert s.ttft_bias(2.0, "p1") == pytest.approx(0.3)


def test_the_bias_does_not_learn_the_part_of_a_batched_pass_spent_on_those_ahead():
    s = make_sched(ttft_bias_alpha=1.0)                # the bias is the last sample's
    s.schedule(req("a", 500), now=0.0)                # predicted 0.5 s
    # First token at 1.0 s: 0.5 s its own share of a pass, 0.3 s of the pass
    # spent on the requests ahead of it (whose work its queue estimate held).
    s.on_prefill_finished("p0", "a", now=1.0, actual_seconds=0.5, actual_queue_s=0.0,
                          actual_batched_ahead_s=0.3)
    assert s.ttft_bias(1.0, "p0") == pytest.approx(0.2)
    # Not batched: all 0.5 s beyond its prefill are missed.
    s.schedule(req("b", 500), now=1.0)
    s.on_prefill_finished("p0", "b", now=2.0, actual_seconds=0.5, actual_queue_s=0.0)
    assert s.ttft_bias(2.0, "p0") == pytest.approx(0.5)


@pytest.mark.parametrize("finish, now, bias, error", [
    # First token at 1.2 s: its 0.5 s share, 0.4 s on requests behind it in
    # the pass (not the bias's: batch_wait_s learns it), 0.3 s missed.
    ({"actual_batched_behind_s": 0.4}, 1.2, 0.3, 0.7),
    # First token at 0.5 s, as predicted from the decision; but the request
    # arrived 0.05 s before it (body read, tokenized): its TTFT counted from
    # the arrival is 0.55 s, and the bias learns the 0.05 s.
    ({"actual_ttft_s": 0.55}, 0.5, 0.05, 0.05),
    # No arrival given: counted from the decision, nothing missed.
    ({}, 0.5, 0.0, 0.0),
])
def test_what_the_bias_learns_of_a_first_token_later_than_its_prefill(finish, now, bias, error):
    s = make_sched(ttft_bias_alpha=1.0)
    s.schedule(req("a", 500), now=0.0)                # predicted 0.5 s, no queue
    s.on_prefill_finished("p0", "a", now=now, actual_seconds=0.5, actual_queue_s=0.0, **finish)
    assert s.ttft_bias(now, "p0") == pytest.approx(bias)
    assert s.estimator_error()["mean_abs_s"] == pytest.approx(error)


def _finish_waited(s, rid, now, queue_s, behind_s):
    """A request that was predicted to wait ``queue_s`` (a report says so)
    and met ``behind_s`` of batch-mates behind it."""
    s.on_node_report("p0", NodeReport(at=now, queued_prefill_s=queue_s), now)
    d = s.schedule(req(rid, 100), now=now)
    assert d.t_queue == pytest.approx(queue_s)
    s.on_prefill_finished("p0", rid, now=now + queue_s + 0.1, actual_seconds=0.1,
                          actual_batched_behind_s=behind_s)
    return d


def test_a_queued_request_is_predicted_to_wait_for_the_batch_mates_its_wait_lets_in():
    s = make_sched()
    assert s.batch_wait_s("p0", 0.2) == 0.0            # nothing learned yet
    # Waits (queue, batch-mates behind): (0.1, 0.01), (0.2, 0.04), (0.4, 0.04),
    # (0.05, 0.05): behind / queue = 0.1, 0.2, 0.1, 1.0, weighted by the queue
    # 0.1, 0.2, 0.4, 0.05 (0.75 in all).  By ratio: 0.1 (0.1), 0.1 (0.4: 0.5
    # >= half of 0.75), so the slope is 0.1 (the short wait's 1.0 weighs little).
    for i, (q, b) in enumerate([(0.1, 0.01), (0.2, 0.04), (0.4, 0.04), (0.05, 0.05)]):
        _finish_waited(s, f"w{i}", 10.0 * i, q, b)
    assert s.batch_wait_s("p0", 0.3) == pytest.approx(0.1 * 0.3)
    assert s.batch_wait_s("p0", 0.0) == 0.0            # no wait, no one joins
    # It is part of the prediction: queue 0.3 + prefill 0.1 + 0.03.
    s.on_node_report("p0", NodeReport(at=100.0, queued_prefill_s=0.3), 100.0)
    d = s.schedule(req("x", 100), now=100.0)
    assert d.predicted_ttft_s == pytest.approx(0.3 + 0.1 + 0.03)
    s.on_prefill_finished("p0", "x", now=101.0, actual_seconds=0.1, actual_batched_behind_s=0.0)
    # x waited 0.3 and met no one: 0 (0.3), 0.1 (0.1), 0.1 (0.4: 0.8 >= 0.525): still 0.1.
    assert s.batch_wait_s("p0", 0.3) == pytest.approx(0.03)
    # A request that was predicted no queue says nothing about the slope.
    s.on_node_report("p0", NodeReport(at=102.0, queued_prefill_s=0.0), 102.0)
    s.schedule(req("y", 100), now=102.0)
    s.on_prefill_finished("p0", "y", now=102.2, actual_seconds=0.1, actual_batched_behind_s=0.5)
    assert s.batch_wait_s("p0", 0.3) == pytest.approx(0.03)
    # One more long wait that met no one: 0 (0.3), 0 (0.6: 0.9 >= 0.825): slope 0.
    _finish_waited(s, "z", 110.0, 0.6, 0.0)
    assert s.batch_wait_s("p0", 0.3) == 0.0


def feed_missed(s, samples, start=0.0):
    """Finish one request per sample, each missing ``missed`` seconds beyond
    its measured 0.5 s prefill; returns when the last finished."""
    now = start
    for i, missed in enumerate(samples):
        s.schedule(req(f"m{start}-{i}", 500), now=now)
        now += 0.5 + missed
        s.on_prefill_finished("p0", f"m{start}-{i}", now=now, actual_seconds=0.5,
                              actual_queue_s=0.0)
        s.on_decode_finished("d0", f"m{start}-{i}", now)
    return now


def test_the_median_rule_steps_by_the_spread_of_the_samples():
    s = make_sched(ttft_bias_alpha=0.5, ttft_bias_rule="median", ttft_bias_half_life_s=1e9)
    now = feed_missed(s, [0.010])
    # spread 0.5 x 0 + 0.5 x |0.010 - 0| = 0.005; a step of 0.2 x that, up.
    assert s.ttft_bias(now, "p0") == pytest.approx(0.001)
    now = feed_missed(s, [0.010], start=now)
    # spread 0.5 x 0.005 + 0.5 x |0.010 - 0.001| = 0.007: up by 0.0014.
    assert s.ttft_bias(now, "p0") == pytest.approx(0.0024)
    now = feed_missed(s, [0.0], start=now)
    # spread 0.5 x 0.007 + 0.5 x 0.0024 = 0.0047: down by 0.00094.
    assert s.ttft_bias(now, "p0") == pytest.approx(0.00146)


def test_the_median_rule_is_not_pulled_up_by_a_stall_now_and_then():
    """What the estimators miss is mostly 10 ms, one request in five 200 ms
    (a stall): the median bias stays near 10 ms, the mean goes near 48."""
    samples = ([0.010] * 4 + [0.200]) * 40
    biases = {}
    for rule in ("mean", "median"):
        s = make_sched(ttft_bias_alpha=0.1, ttft_bias_rule=rule, ttft_bias_half_life_s=1e9)
        biases[rule] = s.ttft_bias(feed_missed(s, samples), "p0")
    assert biases["median"] < 0.025
    assert biases["mean"] > 0.04
    with pytest.raises(ValueError, match="ttft_bias_rule"):
        SchedulerConfig(ttft_bias_rule="mode")


def test_queue_from_bookings_uses_own_estimates_of_the_named_requests():
    s = make_sched(queue_from_bookings=True)
    s.schedule(req("a", 1000), now=0.0)   # 1.0 s each by the fitted estimator
    s.schedule(req("b", 500), now=0.0)    # 0.5 s, queued behind a
    s.schedule(req("c", 200), now=0.0)    # 0.2 s, not at the node yet
    # The node names a and b with a figure of 9 s (its own tokens/s guess):
    # the queue is our 1.0 + 0.5 (decayed from the report) + c's 0.2.
    s.on_node_report("p0", NodeReport(at=0.5, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"})), 0.5)
    assert s.prefill["p0"].queue_time(0.5) == pytest.approx(1.5 + 0.2)
    assert s.prefill["p0"].queue_time(1.0) == pytest.approx(1.0 + 0.2)
    # a finishes at 1.2: the node starts b then; 0.5 of named work from 1.2 on.
    s.on_prefill_finished("p0", "a", now=1.2, actual_seconds=1.0)
    assert s.prefill["p0"].queue_time(1.2) == pytest.approx(0.5 + 0.2)
    assert s.prefill["p0"].queue_time(1.5) == pytest.approx(0.2 + 0.2)
    # A request this scheduler did not book (another conductor's): the node's
    # figure covers what we cannot estimate.
    s.on_node_report("p0", NodeReport(at=2.0, queued_prefill_s=3.0,
                                      prefill_requests=frozenset({"b", "c", "other"})), 2.0)
    assert s.prefill["p0"].queue_time(2.0) == pytest.approx(3.0)
    # Without the option, the node's figure is the queue (test_scheduling_core).
    plain = make_sched()
    plain.schedule(req("a", 1000), now=0.0)
    plain.on_node_report("p0", NodeReport(at=0.5, queued_prefill_s=9.0,
                                          prefill_requests=frozenset({"a"})), 0.5)
    assert plain.prefill["p0"].queue_time(0.5) == pytest.approx(9.0)


def test_a_report_taken_before_our_request_finished_is_not_read_as_another_conductors():
    """a finishes at 1.0; the node's report, taken at 0.9, arrives at 1.05 and
    still names a beside b, with its own figure of 9 s (a tokens/s rate that
    short prompts had dragged down).  a is ours and done: the queue is b's
    0.5 s, not the node's 9 s (which it used to be whenever a report and an
    answer crossed, the queue over-predicted by up to the figure's excess)."""
    s = make_sched(queue_from_bookings=True)
    s.schedule(req("a", 1000), now=0.0)   # 1.0 s
    s.schedule(req("b", 500), now=0.0)    # 0.5 s, queued behind a
    s.on_prefill_finished("p0", "a", now=1.0, actual_seconds=1.0)
    s.on_node_report("p0", NodeReport(at=0.9, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"}),
                                      prefill_running_s={"a": 0.9}), 1.05)
    assert s.prefill["p0"].queue_time(1.05) == pytest.approx(0.5 - 0.15)
    # Only RECENTLY_DONE_KEPT finished ids are kept per node.
    from roles.scheduling.scheduler import RECENTLY_DONE_KEPT
    for i in range(RECENTLY_DONE_KEPT + 5):
        s.schedule(req(f"r{i}", 10), now=2.0)
        s.on_prefill_finished("p0", f"r{i}", now=2.0, actual_seconds=0.01)
    assert len(s.prefill["p0"].recently_done) == RECENTLY_DONE_KEPT
    assert "a" not in s.prefill["p0"].recently_done


def test_a_report_naming_the_running_request_counts_only_what_is_left_of_it():
    s = make_sched(queue_from_bookings=True)
    s.schedule(req("a", 1000), now=0.0)   # 1.0 s
    s.schedule(req("b", 500), now=0.0)    # 0.5 s, queued behind a
    # At 0.6 the node says a has computed for 0.4 s (it waited 0.2 s for its
    # decode reservation): 0.6 s of a are left, then b's 0.5.
    s.on_node_report("p0", NodeReport(at=0.6, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"}),
                                      prefill_running_s={"a": 0.4}), 0.6)
    assert s.prefill["p0"].queue_time(0.6) == pytest.approx(0.6 + 0.5)
    # The next report, 0.3 s later, does not restart a's estimate either.
    s.on_node_report("p0", NodeReport(at=0.9, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"}),
                                      prefill_running_s={"a": 0.7}), 0.9)
    assert s.prefill["p0"].queue_time(0.9) == pytest.approx(0.3 + 0.5)
    # a overruns its estimate by 0.3 s and is still running: with no prefill
    # of this node measured yet, as much again is left of it (not 0), and b
    # is still whole.
    s.on_node_report("p0", NodeReport(at=1.5, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"}),
                                      prefill_running_s={"a": 1.3}), 1.5)
    assert s.prefill["p0"].queue_time(1.5) == pytest.approx(0.3 + 0.5)
    # a finishes, b starts: b's 0.5 from then on.
    s.on_prefill_finished("p0", "a", now=1.6, actual_seconds=1.4)
    assert s.prefill["p0"].queue_time(1.6) == pytest.approx(0.5)


def test_bookings_no_report_covers_yet_count_down_from_their_expected_start():
    s = make_sched(queue_from_bookings=True)
    s.schedule(req("a", 1000), now=0.0)   # 1.0 s on an idle node: expected to start at 0
    # 0.2 s later, before any report: 0.8 s of a are left.
    assert s.prefill["p0"].queue_time(0.2) == pytest.approx(0.8)
    d = s.schedule(req("b", 500), now=0.2)
    assert d.t_queue == pytest.approx(0.8)   # b is expected to start at 1.0
    assert s.prefill["p0"].queue_time(0.5) == pytest.approx(0.5 + 0.5)
    # a still unanswered 0.2 s after its estimate ran out is late, and b has
    # not started behind it: with no prefill of this node measured yet, as
    # much again is left of a (0.2), and b is whole.
    assert s.prefill["p0"].queue_time(1.2) == pytest.approx(0.2 + 0.5)
    # A report that names both, a not running yet (it waited for its decode
    # reservation): the node's word wins, both whole, counting down from then.
    s.on_node_report("p0", NodeReport(at=0.6, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"}),
                                      prefill_running_s={}), 0.6)
    assert s.prefill["p0"].queue_time(0.6) == pytest.approx(1.5)
    assert s.prefill["p0"].queue_time(0.7) == pytest.approx(1.4)


def test_a_booking_counts_down_from_its_expected_start_once_the_one_ahead_answered():
    s = make_sched(queue_from_bookings=True)
    s.schedule(req("a", 1000), now=0.0)                 # 1.0 s, starts at 0
    assert s.schedule(req("b", 500), now=0.2).t_queue == pytest.approx(0.8)  # starts at 1.0
    s.on_prefill_finished("p0", "a", now=1.0, actual_seconds=1.0)
    assert s.prefill["p0"].queue_time(1.2) == pytest.approx(0.3)   # b has run 0.2 s
    assert s.prefill["p0"].queue_time(1.4) == pytest.approx(0.1)


def _late_ratios(s, ratios):
    """Prefills of p0 that took ratios[i] x their 1.0 s estimate."""
    for i, r in enumerate(ratios):
        s.schedule(req(f"m{i}", 1000), now=0.0)
        s.on_prefill_finished("p0", f"m{i}", now=0.0, actual_seconds=r)
    assert list(s.prefill["p0"].late_ratios) == pytest.approx(ratios)


def test_a_late_request_keeps_the_rest_its_node_s_late_prefills_took():
    s = make_sched(queue_from_bookings=True)
    _late_ratios(s, [0.9, 1.0, 1.2, 1.5, 2.0])
    node = s.prefill["p0"]
    # 1.1 x its estimate done: those that took longer took 1.2, 1.5, 2.0 x
    # theirs, 0.1, 0.4 and 0.9 more: the median, 0.4 of 1.0 s, is left.
    assert node.late_rest_s(1.0, 1.1) == pytest.approx(0.4)
    assert node.late_rest_s(2.0, 3.2) == pytest.approx(2.0 * (2.0 - 1.6))   # only 2.0 x: 0.8
    # Later than any of them (2.5 x): as much again as it is late, at most its estimate.
    assert node.late_rest_s(1.0, 2.5) == pytest.approx(1.0)
    assert node.late_rest_s(1.0, 2.2) == pytest.approx(1.0)
    assert node.late_rest_s(10.0, 22.0) == pytest.approx(10.0)


def test_a_few_slow_start_up_passes_do_not_set_a_late_requests_rest():
    s = make_sched(queue_from_bookings=True)
    # Two passes right after a start ran 2.5 and 3 x their estimate; the
    # rest were a few percent late.
    _late_ratios(s, [2.5, 3.0, 1.03, 1.05, 1.08, 1.04, 1.06])
    # 1.02 x done: the rests are 0.01, 0.02, 0.03, 0.04, 0.06, 1.48, 1.98 of
    # the estimate; their median 0.04 (their mean, 0.517, is the outliers').
    assert s.prefill["p0"].late_rest_s(1.0, 1.02) == pytest.approx(0.04)
    # An even count: the mean of the middle two.
    assert s.prefill["p0"].late_rest_s(1.0, 1.035) == pytest.approx((0.025 + 0.045) / 2)


def test_the_queue_behind_a_late_request_is_its_rest_and_the_work_booked_after_it():
    s = make_sched(queue_from_bookings=True)
    _late_ratios(s, [0.9, 1.0, 1.2, 1.5, 2.0])
    s.schedule(req("a", 1000), now=10.0)                 # 1.0 s, starts at 10
    d = s.schedule(req("b", 500), now=10.5)
    assert d.t_queue == pytest.approx(0.5)               # a on time: 0.5 s left
    # At 11.1 a has not answered: 0.4 s of it left (above), and b has not
    # started (FIFO): 0.5 more.  Counted as on time, the queue was 0.5 - 0.1.
    assert s.prefill["p0"].queue_time(11.1) == pytest.approx(0.4 + 0.5)
    d = s.schedule(req("c", 100), now=11.1)
    assert d.t_queue == pytest.approx(0.4 + 0.5)
    # a answers: b runs from its expected start (11.0): 0.4 s left at 11.1, then c.
    s.on_prefill_finished("p0", "a", now=11.1, actual_seconds=1.1)
    assert s.prefill["p0"].queue_time(11.1) == pytest.approx(0.4 + 0.1)


def test_a_late_request_named_by_the_node_s_report_is_still_counted():
    s = make_sched(queue_from_bookings=True)
    _late_ratios(s, [1.0, 1.5])
    s.schedule(req("a", 1000), now=10.0)
    s.schedule(req("b", 500), now=10.0)
    s.on_node_report("p0", NodeReport(at=11.0, queued_prefill_s=9.0,
                                      prefill_requests=frozenset({"a", "b"}),
                                      prefill_running_s={"a": 1.0}), 11.0)
    # a has run its whole estimate (1.0 x): those that took longer took 1.5 x.
    assert s.prefill["p0"].queue_time(11.0) == pytest.approx(0.5 + 0.5)
    assert s.prefill["p0"].queue_time(11.2) == pytest.approx(0.3 + 0.5)


def test_a_growing_batch_slows_down_and_keeps_its_sequences_longer():
    # TBT = 0.01 + 0.01 * batch.  Two sequences with 10 tokens left, measured
    # at 10 ms a step.  A 150-token request joins at 0.15 s:
    #  - at 10 ms a step both are gone by then (15 steps): TBT 0.02;
    #  - but at 0.02 s a step they have run 7.5 steps: both still there,
    #    batch 2 + 1: TBT 0.04; at 0.04 s a step (3.75 steps) still there:
    #    0.04 is the fixed point, and the prediction.
    s = make_sched(decode=(0.01, 0.01, 0.0))
    report_running(s, "d0", 0.0, {"a": RunningSeq(0, 10), "b": RunningSeq(0, 10)}, tbt=0.01)
    assert s.predict_decode_load("d0", 0.15) == DecodeLoad(0, 0)
    d = s.schedule(req("r", 150), now=0.0)
    assert d.predicted_ttft_s == pytest.approx(0.15)
    assert d.predicted_tbt_s == pytest.approx(0.04)


def test_bias_with_a_measured_queue_holds_only_the_unexplained_time():
    s = make_sched(ttft_bias_alpha=0.5)
    s.schedule(req("a", 500), now=0.0)  # predicted: queue 0 + prefill 0.5
    # It waited 0.8 s in the node's queue (not predicted), computed 0.5 s and
    # its first token came at 1.4: 0.1 s is neither queue nor prefill.
    s.on_prefill_finished("p0", "a", now=1.4, actual_seconds=0.5, actual_queue_s=0.8)
    assert s.ttft_bias(1.4) == pytest.approx(0.5 * 0.1)


def two_nodes_fitted_each(policy: str, prior_s_per_token: float) -> Scheduler:
    """p0 and p1 with a fit each (refitted every 5 samples), one decode node."""
    s = Scheduler(SchedulerConfig(policy=policy, ttft_slo_s=30.0, tbt_slo_s=1.0,
                                  kv_bytes_per_token=1000, per_node_prefill_fit=True),
                  PolynomialPrefillEstimator({"n": prior_s_per_token}, refit_every=5, window=5),
                  TransferEstimator(1e9), DecodeEstimator(0.02, 0.001, 0.0))
    s.add_prefill_node("p0")
    s.add_prefill_node("p1")
    s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)
    return s


def test_each_prefill_node_is_priced_by_its_own_fit():
    # p1 runs at half p0's speed (a core it borrows): 2 ms a token against 1.
    s = two_nodes_fitted_each("round_robin", prior_s_per_token=1e-3)
    ms_per_token = {"p0": 1e-3, "p1": 2e-3}
    served = {"p0": 0, "p1": 0}
    for i in range(24):
        tokens = 200 + 100 * (i % 6)
        d = s.schedule(req(f"r{i}", tokens), now=float(i))
        # round robin: the nodes take turns, each finishing before the next request
        served[d.prefill_node] += 1
        s.on_prefill_finished(d.prefill_node, f"r{i}", now=i + 0.5,
                              actual_seconds=ms_per_token[d.prefill_node] * tokens)
        s.on_decode_finished("d0", f"r{i}", now=i + 0.6)
    assert served == {"p0": 12, "p1": 12}
    # Each node's fit is its own speed, exactly (noise-free linear samples).
    assert s.estimator_for("p0").seconds(1000, 0) == pytest.approx(1.0)
    assert s.estimator_for("p1").seconds(1000, 0) == pytest.approx(2.0)
    # The cluster-wide fit learned from both (its window holds the last 5).
    assert 1.0 < s.prefill_est.seconds(1000, 0) < 2.0
    # A 1000-token request is predicted 1.0 s on p0 and 2.0 s on p1: the
    # least-TTFT choice (Algorithm 1) takes p0.
    s.policy = make_policy("mooncake")
    d = s.schedule(req("big", 1000), now=100.0)
    assert (d.prefill_node, d.t_prefill) == ("p0", pytest.approx(1.0))
    # A node that joins later starts from the cluster-wide fit.
    s.add_prefill_node("p2")
    assert s.estimator_for("p2").seconds(1000, 0) == s.prefill_est.seconds(1000, 0)
    # Off: one fit for every node.
    one = make_sched()
    one.add_prefill_node("p1")
    assert one.estimator_for("p1") is one.estimator_for("p0") is one.prefill_est


def test_a_node_without_its_own_fit_is_priced_by_the_cluster_fit_not_its_starting_prior():
    """Both nodes join at start, forked from a prior of 2 ms a token; the
    cluster runs at 1 ms.  p0 serves every request (p1 is drained) and learns
    it; p1, with no samples of its own, is priced as the cluster now runs
    (it used to keep the 2 ms prior, so least-TTFT never chose it and it
    never gathered the samples that would correct it)."""
    s = two_nodes_fitted_each("mooncake", prior_s_per_token=2e-3)
    s.prefill["p1"].accepting = False
    for i in range(10):
        tokens = 200 + 100 * (i % 5)
        d = s.schedule(req(f"r{i}", tokens), now=float(i))
        assert d.prefill_node == "p0"
        s.on_prefill_finished("p0", f"r{i}", now=i + 0.5, actual_seconds=1e-3 * tokens)
        s.on_decode_finished("d0", f"r{i}", now=i + 0.6)
    assert s.estimator_for("p0").seconds(1000, 0) == pytest.approx(1.0)
    assert s.estimator_for("p1").seconds(1000, 0) == pytest.approx(1.0)
    # Back in service, p1 is chosen when p0 is busier: 0.5 s queued on p0.
    s.prefill["p1"].accepting = True
    s.schedule(req("busy", 500), now=20.0)
    d = s.schedule(req("next", 500), now=20.0)
    assert d.prefill_node == "p1" and d.t_prefill == pytest.approx(0.5)


def test_a_node_with_a_record_of_small_errors_admits_closer_to_the_slo():
    # TTFT SLO 1 s; before any record the headroom is 10% (admit <= 0.9 s).
    # (No return toward it while idle here: see the test after the next.)
    s = make_sched(ttft_slo=1.0, slo_admit_fraction=0.9, ttft_margin_errors=2.0,
                   ttft_margin_half_life_s=1e9)
    assert s.ttft_admit_limit("p0", 0.0) == pytest.approx(0.9)
    # 16 requests, each predicted 0.1 s (100 tokens at 1 ms) and measured
    # 0.12 s (20 ms off): mean absolute error 0.02, headroom 2 x 0.02 = 0.04.
    for i in range(16):
        s.schedule(req(f"r{i}", 100), now=10.0 * i)
        s.on_prefill_finished("p0", f"r{i}", now=10.0 * i + 0.12, actual_seconds=0.1)
        s.on_decode_finished("d0", f"r{i}", now=10.0 * i + 1.0)
    assert s.ttft_admit_limit("p0", 150.12) == pytest.approx(1.0 - 0.04)
    # A 930-token prompt (0.93 s predicted): refused at 90%, admitted now.
    assert isinstance(s.schedule(req("long", 930), now=500.0), Decision)
    assert isinstance(s.schedule(req("too-long", 970), now=600.0), Rejection)
    # Off (the default): the fraction alone.
    plain = make_sched(ttft_slo=1.0, slo_admit_fraction=0.9)
    for i in range(16):
        plain.schedule(req(f"r{i}", 100), now=10.0 * i)
        plain.on_prefill_finished("p0", f"r{i}", now=10.0 * i + 0.12, actual_seconds=0.1)
        plain.on_decode_finished("d0", f"r{i}", now=10.0 * i + 1.0)
    assert plain.ttft_admit_limit("p0", 150.12) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="ttft_margin_errors"):
        SchedulerConfig(ttft_margin_errors=-1)


def test_errors_of_predictions_the_prior_priced_stay_out_of_the_nodes_record():
    """The cluster starts from a guess of 2 ms a token and runs at 1 ms; the
    node's fit refits after 5 samples.  Requests priced by the guess, and one
    priced by the fit but queued behind work the guess priced, carry the
    guess's error: they must not hold the admit limit down once the fit has
    run (seen after start-up: such errors of 0.1-0.6 s held a node's limit
    near 0.63 s of a 1 s SLO for the next 64 requests)."""
    s = Scheduler(SchedulerConfig(policy="mooncake", ttft_slo_s=1.0, tbt_slo_s=1.0,
                                  kv_bytes_per_token=1000, per_node_prefill_fit=True,
                                  slo_admit_fraction=0.9, ttft_margin_errors=2.0,
                                  ttft_margin_half_life_s=1e9),
                  PolynomialPrefillEstimator({"n": 2e-3}, refit_every=5, window=5),
                  TransferEstimator(1e9), DecodeEstimator(0.02, 0.001, 0.0))
    s.add_prefill_node("p0")
    s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)
    # Six requests at once, priced by the guess (0.1 s each, queued FIFO).
    for i in range(6):
        assert s.schedule(req(f"e{i}", 50), now=0.0).t_prefill == pytest.approx(0.1)
    for i in range(5):   # each took 0.05 s: the fit has run after these five
        s.on_prefill_finished("p0", f"e{i}", now=0.05 * (i + 1), actual_seconds=0.05)
    assert s.estimator_for("p0").seconds(50, 0) == pytest.approx(0.05)
    # Priced by the fit, but queued behind e5, which the guess priced.
    x = s.schedule(req("x", 50), now=0.26)
    assert x.t_prefill == pytest.approx(0.05)
    s.on_prefill_finished("p0", "e5", now=0.3, actual_seconds=0.05)
    s.on_prefill_finished("p0", "x", now=1.2, actual_seconds=0.05)   # 0.8 s late
    for rid in [f"e{i}" for i in range(6)] + ["x"]:
        s.on_decode_finished("d0", rid, now=2.0)

    def serve(i):   # priced by the fit, nothing ahead; first token 20 ms late
        d = s.schedule(req(f"r{i}", 50), now=10.0 * (i + 1))
        s.on_prefill_finished("p0", f"r{i}", now=10.0 * (i + 1) + d.predicted_ttft_s + 0.02,
                              actual_seconds=0.05)
        s.on_decode_finished("d0", f"r{i}", now=10.0 * (i + 1) + 5.0)

    for i in range(15):
        serve(i)
    # 15 errors on record: fewer than the 16 a learned headroom needs.
    assert s.node_mean_abs_error("p0") == 0.0
    assert s.ttft_admit_limit("p0", 200.0) == pytest.approx(0.9)
    serve(15)
    # 16 errors of 20 ms: headroom 2 x 0.02.  (Counted too, the seven above,
    # 0.05-0.8 s off, would put the limit at 0.81.)
    assert s.node_mean_abs_error("p0") == pytest.approx(0.02)
    assert s.ttft_admit_limit("p0", 200.0) == pytest.approx(0.96)
    # The errors are still reported over every request.
    assert len(s.ttft_errors) == 23


def test_a_node_whose_record_refuses_everything_admits_again_after_idle_half_lives():
    """A record bad enough to refuse every request would never be renewed
    (nothing refused finishes): while the node finishes nothing, its learned
    headroom returns halfway to the default one every half-life (5 s)."""
    s = make_sched(ttft_slo=1.0, slo_admit_fraction=0.9, ttft_margin_errors=2.0)
    # 16 requests predicted 0.1 s, each first token 0.5 s late (a cold
    # estimator, a burst): mean absolute error 0.5, headroom 1.0, limit 0.
    for i in range(16):
        s.schedule(req(f"r{i}", 100), now=10.0 * i)
        s.on_prefill_finished("p0", f"r{i}", now=10.0 * i + 0.6, actual_seconds=0.1)
        s.on_decode_finished("d0", f"r{i}", now=10.0 * i + 1.0)
    last = 150.6
    assert s.ttft_admit_limit("p0", last) == pytest.approx(0.0)
    refused = s.schedule(req("at-once", 300), now=last)      # 0.3 s predicted
    assert isinstance(refused, Rejection) and refused.reason == "ttft_slo"
    # Two half-lives later: headroom 0.1 + (1.0 - 0.1) / 4 = 0.325, limit 0.675.
    assert s.ttft_admit_limit("p0", last + 10.0) == pytest.approx(0.675)
    assert isinstance(s.schedule(req("later", 300), now=last + 10.0), Decision)
    # Long idle: back to slo_admit_fraction's 0.9 s.
    assert s.ttft_admit_limit("p0", last + 1000.0) == pytest.approx(0.9)
    # A finished request renews the record and stops the return: the new
    # error (0.3 s predicted, 0.3 s measured) joins the 16 of 0.5 s.
    s.on_prefill_finished("p0", "later", now=last + 10.3, actual_seconds=0.3)
    assert s.ttft_admit_limit("p0", last + 10.3) == pytest.approx(1.0 - 2 * 0.5 * 16 / 17)
    with pytest.raises(ValueError, match="ttft_margin_half_life_s"):
        SchedulerConfig(ttft_margin_half_life_s=0)


def test_of_two_nodes_the_one_whose_predictions_hold_is_chosen_and_admits_more():
    """Node p0's recent TTFTs came 0.2 s later than predicted, p1's 10 ms:
    margins 0.4 s and 0.02 s.  Both are idle and priced alike, so Algorithm
    1 takes the first (p0), whose limit (0.6 s) refuses a 0.8 s prediction;
    the request goes to p1 (limit 0.98 s) instead of being rejected.  A short
    request stays with Algorithm 1's choice."""
    s = Scheduler(SchedulerConfig(policy="mooncake", ttft_slo_s=1.0, tbt_slo_s=1.0,
                                  kv_bytes_per_token=1000, slo_admit_fraction=0.9,
                                  ttft_margin_errors=2.0, ttft_margin_half_life_s=1e9),
                  PolynomialPrefillEstimator({"n": 1e-3}), TransferEstimator(1e9),
                  DecodeEstimator(0.02, 0.001, 0.0))
    for node in ("p0", "p1"):
        s.add_prefill_node(node)
    s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)

    def record(node: str, late_s: float, t: float) -> None:
        # The other node reports a long queue, so the request goes to `node`;
        # it comes `late_s` after its 0.1 s prediction.
        other = "p1" if node == "p0" else "p0"
        s.on_node_report(other, NodeReport(at=t, queued_prefill_s=50.0), t)
        s.on_node_report(node, NodeReport(at=t, queued_prefill_s=0.0), t)
        d = s.schedule(req(f"{node}-{t}", 100), now=t)
        assert isinstance(d, Decision) and d.prefill_node == node
        s.on_prefill_finished(node, d.request_id, now=t + 0.1 + late_s, actual_seconds=0.1)
        s.on_decode_finished("d0", d.request_id, now=t + 1.0)

    for i in range(16):
        record("p0", 0.2, 10.0 * i)
        record("p1", 0.01, 10.0 * i + 5.0)
    assert s.ttft_admit_limit("p0", 500.0) == pytest.approx(0.6)
    assert s.ttft_admit_limit("p1", 500.0) == pytest.approx(0.98)
    for node in ("p0", "p1"):
        s.on_node_report(node, NodeReport(at=500.0, queued_prefill_s=0.0), 500.0)
    d = s.schedule(req("near-the-slo", 800), now=500.0)   # 0.8 s predicted on either
    assert isinstance(d, Decision) and d.prefill_node == "p1"
    assert d.predicted_ttft_s == pytest.approx(0.8)
    short = s.schedule(req("short", 100), now=500.0)      # 0.1 s on p0, 0.9 s on p1
    assert isinstance(short, Decision) and short.prefill_node == "p0"
    s.on_node_report("p0", NodeReport(at=600.0, queued_prefill_s=0.0), 600.0)
    s.on_node_report("p1", NodeReport(at=600.0, queued_prefill_s=0.0), 600.0)
    refused = s.schedule(req("over-both", 990), now=600.0)  # over both limits
    assert isinstance(refused, Rejection) and refused.reason == "ttft_slo"


def test_with_an_error_margin_the_node_whose_predictions_hold_is_chosen():
    def two_nodes(margin):
        s = Scheduler(SchedulerConfig(policy="mooncake", ttft_slo_s=30.0, tbt_slo_s=1.0,
                                      choose_error_margin=margin),
                      PolynomialPrefillEstimator({"n": 1e-3}), TransferEstimator(1e9),
                      DecodeEstimator(0.02, 0.001, 0.0))
        s.add_prefill_node("p0")
        s.add_prefill_node("p1")
        s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)
        # p0's predictions were 0.2 s off, p1's exact; p1 has 0.1 s queued.
        s._node_ttft_errors["p0"] = deque([0.2] * 16)
        s._node_ttft_errors["p1"] = deque([0.0] * 16)
        s.prefill["p1"].reported_queue_s, s.prefill["p1"].reported_at = 0.1, 0.0
        return s
    # By predicted TTFT: p0 (0.5 s) beats p1 (0.1 + 0.5 s).
    assert two_nodes(0.0).schedule(req("a", 500), now=0.0).prefill_node == "p0"
    # With the margin: p0 costs 0.5 + 0.2, p1 0.6 + 0: p1, predicted 0.6 s.
    d = two_nodes(1.0).schedule(req("a", 500), now=0.0)
    assert (d.prefill_node, d.predicted_ttft_s) == ("p1", pytest.approx(0.6))
    with pytest.raises(ValueError):
        SchedulerConfig(choose_error_margin=-1.0)


def finish_at_level(s, rid, level, missed, now):
    """Schedule ``rid`` with ``level`` other requests in flight, finish it
    missing ``missed`` s beyond its measured 0.5 s prefill, then the others
    (which teach nothing); returns the time after."""
    others = [f"{rid}-other{i}" for i in range(level)]
    for other in others:
        s.schedule(req(other, 500), now=now)
    s.schedule(req(rid, 500), now=now)
    now += 0.5 + missed
    s.on_prefill_finished("p0", rid, now=now, actual_seconds=0.5, actual_queue_s=0.0)
    s.on_decode_finished("d0", rid, now)
    for other in others:
        s.on_prefill_finished("p0", other, now=now, actual_seconds=0.0)
        s.on_decode_finished("d0", other, now)
    return now


def test_the_bias_is_learned_per_load_level():
    # Alone a request misses 4 ms, beside one other 10 ms, alternately.  With
    # the mean rule at alpha 0.5 the node's bias settles at 6 ms after an
    # alone one and 8 ms after a busy one (N0 = N1/2 + 2, N1 = N0/2 + 5), so
    # one bias misses every request by 2-4 ms.  Each level's offset is the
    # EWMA of what its requests missed beyond the node's bias as it stood:
    # alone 4 - 8 = -4 ms, busy 10 - 6 = +4 ms, so each level is exact.
    cfg = dict(ttft_bias_alpha=0.5, ttft_bias_half_life_s=1e9)
    levelled, single = make_sched(**cfg, ttft_bias_load_bounds=(1,)), make_sched(**cfg)
    for s in (levelled, single):
        now = 0.0
        for i in range(40):
            now = finish_at_level(s, f"a{i}", 0, 0.004, now)
            now = finish_at_level(s, f"b{i}", 1, 0.010, now)
    assert single.ttft_bias(now, "p0") == pytest.approx(0.008)
    assert levelled.load_level() == 0
    assert levelled.ttft_bias(now, "p0", 0) == pytest.approx(0.004)   # 8 - 4
    now = finish_at_level(levelled, "c", 0, 0.004, now)                # the node now at 6 ms
    assert levelled.ttft_bias(now, "p0", 1) == pytest.approx(0.010)   # 6 + 4
    # The level a decision is made at is the requests in flight then.
    levelled.schedule(req("x", 500), now=now)
    assert levelled.load_level() == 1
    d = levelled.schedule(req("y", 500), now=now)
    assert levelled.inflight["y"].load_level == 1
    assert levelled.inflight["y"].ttft_bias_s == pytest.approx(0.010)
    assert d.predicted_ttft_s == pytest.approx(d.t_queue + d.t_prefill + d.t_transfer + 0.010)


def test_a_load_level_not_seen_for_a_while_returns_to_the_nodes_bias():
    s = make_sched(ttft_bias_alpha=1.0, ttft_bias_half_life_s=10.0, ttft_bias_load_bounds=(1, 3))
    now = finish_at_level(s, "a", 0, 0.004, 0.0)       # node 4 ms, level 0: +4 ms beyond 0
    now = finish_at_level(s, "b", 1, 0.010, now)       # node 10 ms, level 1: beyond the node's
    offset = 0.010 - 0.004 * 0.5 ** (0.51 / 10)        # 4 ms, decayed over b's 0.51 s
    assert s.ttft_bias(now, "p0", 1) == pytest.approx(0.010 + offset)
    assert s.ttft_bias(now, "p0", 2) == s.ttft_bias(now, "p0") == pytest.approx(0.010)  # unseen
    later = now + 10.0                                  # one half-life: both halve
    assert s.ttft_bias(later, "p0", 1) == pytest.approx(0.005 + offset / 2)


def test_load_bounds_must_be_increasing_counts():
    for bad in [(0,), (2, 1), (1, 1)]:
        with pytest.raises(ValueError, match="ttft_bias_load_bounds"):
            SchedulerConfig(ttft_bias_load_bounds=bad)
    assert SchedulerConfig(ttft_bias_load_bounds=[1, 2, 4]).ttft_bias_load_bounds == (1, 2, 4)


def finish_on(s, prefix, count, start, node, measured):
    """``count`` requests scheduled and finished one a second from ``start``,
    each measuring ``measured`` as its TBT; the time of the last finish."""
    for i in range(count):
        d = s.schedule(req(f"{prefix}{i}", 100), now=start + i)
        assert d.decode_node == node
        s.on_decode_finished(node, d.request_id, start + i + 0.5, measured_tbt_s=measured)
    return start + count - 0.5


def test_a_decode_node_learns_how_much_longer_its_tbt_measures_than_predicted():
    # The model says 10 ms a step whatever the load; SLO 100 ms, admitted within 90 ms.
    s = make_sched(decode=(0.01, 0.0, 0.0), tbt_slo=0.1, slo_admit_fraction=0.9,
                   tbt_ratio_quantile=0.9)
    # Fewer than 16 finished requests: the model alone (ratio 1).
    assert s.schedule(req("first", 100), now=0.0).predicted_tbt_s == pytest.approx(0.01)
    s.on_decode_finished("d0", "first", 0.5, measured_tbt_s=None)   # cut short: nothing learned
    t = finish_on(s, "a", 16, 1.0, "d0", measured=0.05)            # ratio 5 each
    assert s.tbt_ratio("d0", t) == pytest.approx(5.0)
    assert s.schedule(req("b", 100), now=t).predicted_tbt_s == pytest.approx(0.05)
    s.on_decode_finished("d0", "b", t, measured_tbt_s=None)
    # 16 more, admitted at ratio 5, measure ratio 10: the last 16 are all 10.
    running = [s.schedule(req(f"c{i}", 100), now=t) for i in range(16)]
    assert [d.predicted_tbt_s for d in running] == pytest.approx([0.05] * 16)
    t += 2
    for d in running:
        s.on_decode_finished("d0", d.request_id, t, measured_tbt_s=0.1)
    refused = s.schedule(req("d", 100), now=t)
    assert isinstance(refused, Rejection) and refused.reason == "tbt_slo"
    assert refused.predicted_tbt_s == pytest.approx(0.1)
    # Refused work teaches it nothing: the ratio goes halfway back to 1 in a
    # half-life (3 s): 5.5, and the request fits again.
    assert s.tbt_ratio("d0", t + 3) == pytest.approx(5.5)
    assert s.schedule(req("e", 100), now=t + 3).predicted_tbt_s == pytest.approx(0.055)
    # 8 finishing at ratio 1 and 8 at 3: of the last 16, the 0.9 quantile
    # (the 15th smallest) is 3.
    running = [s.schedule(req(f"f{i}", 100), now=t + 3) for i in range(16)]
    for i, d in enumerate(running):
        s.on_decode_finished("d0", d.request_id, t + 4, measured_tbt_s=0.01 if i < 8 else 0.03)
    assert s.tbt_ratio("d0", t + 4) == pytest.approx(3.0)


def test_a_decode_node_whose_tbt_measures_long_is_chosen_after_one_that_holds():
    s = make_sched(decode=(0.01, 0.0, 0.0), tbt_slo=0.1, n_decode=2, tbt_ratio_quantile=0.9)
    # Equal predictions go to d0; 16 of them measure 10x what was predicted.
    t = finish_on(s, "a", 16, 0.0, "d0", measured=0.1)
    d = s.schedule(req("b", 100), now=t)
    assert (d.decode_node, d.predicted_tbt_s) == ("d1", pytest.approx(0.01))
    # With the quantile 0 the model's step alone decides: d0 again.
    s.config.tbt_ratio_quantile = 0.0
    assert s.schedule(req("c", 100), now=t).decode_node == "d0"
