"""Decode load at join time, the TBT fit, and prediction-based early rejection.

Every expectation is worked out by hand in the comments: the prefill
estimator is 1 ms per computed token, so a request's predicted TTFT (and
hence when it joins its decode node) is its prompt length in ms.
"""
import math
import zlib
from collections import deque

import pytest

from roles.scheduling import (BookedJoin, DecodeEstimator, DecodeLoad, DecodeStep, Decision,
                              NodeReport, PolynomialPrefillEstimator, Rejection, RunningSeq,
                              ScheduleRequest, Scheduler, SchedulerConfig, TransferEstimator,
                              fit_decode)
from roles.scheduling.registry import make_policy

BS = 100


def make_sched(decode=(0.02, 0.001, 0.0), tbt_slo=1.0, ttft_slo=30.0, n_decode=1, **cfg):
    # The queue as the node reports it and one fit, unless a test asks otherwise.
    cfg.setdefault("queue_from_bookings", False)
    cfg.setdefault("per_node_prefill_fit", False)
    s = Scheduler(SchedulerConfig(policy="load_balance", ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
                                  kv_bytes_per_token=1000, **cfg),
                  PolynomialPrefillEstimator({"n": 1e-3}), TransferEstimator(1e9),
                  DecodeEstimator(*decode))
    s.add_prefill_node("p0")
    for i in range(n_decode):
        s.add_decode_node(f"d{i}", page_budget=10_000, page_tokens=BS)
    return s


def req(rid, tokens, out=8):
    """A prompt of its own (no prefix shared with another request's)."""
    base = 1000 * (1 + zlib.crc32(rid.encode()))
    return ScheduleRequest(rid, tuple(range(base, base + -(-tokens // BS))), tokens, BS, out)


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


def test_bad_decode_estimator_and_residual_settings():
    with pytest.raises(ValueError):
        DecodeEstimator(0.01, 0.0, 0.0, refit_every=-1)
    with pytest.raises(ValueError):
        SchedulerConfig(admit_quantile=1.0)
    with pytest.raises(ValueError):
        fit_decode([], prior=(0.0, 0.0, 0.0))
    assert math.isfinite(DecodeEstimator(0.01, 0.0, 0.0).seconds(1, 0))


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
    # Each node's fit is its own speed (noise-free linear samples; the
    # prior, a tenth of a sample against a window of five, pulls by < 5%).
    assert s.estimator_for("p0").seconds(1000, 0) == pytest.approx(1.0, rel=0.05)
    assert s.estimator_for("p1").seconds(1000, 0) == pytest.approx(2.0, rel=0.05)
    # The cluster-wide fit learned from both (its window holds the last 5).
    assert 1.0 < s.prefill_est.seconds(1000, 0) < 2.0
    # A 1000-token request is predicted 1.0 s on p0 and 2.0 s on p1: the
    # least-TTFT choice (Algorithm 1) takes p0.
    s.policy = make_policy("mooncake")
    d = s.schedule(req("big", 1000), now=100.0)
    assert (d.prefill_node, d.t_prefill) == ("p0", pytest.approx(1.0, rel=0.05))
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
    # 1 ms a token, not the 2 ms prior (which a window of five samples
    # outweighs but for a pull of a few percent where no sample is).
    assert s.estimator_for("p0").seconds(1000, 0) == pytest.approx(1.0, rel=0.1)
    assert s.estimator_for("p1").seconds(1000, 0) == pytest.approx(1.0, rel=0.1)
    # Back in service, p1 is chosen when p0 is busier: 0.5 s queued on p0.
    s.prefill["p1"].accepting = True
    s.schedule(req("busy", 500), now=20.0)
    d = s.schedule(req("next", 500), now=20.0)
    assert d.prefill_node == "p1" and d.t_prefill == pytest.approx(0.5, rel=0.02)

