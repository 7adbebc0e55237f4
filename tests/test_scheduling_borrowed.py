"""A prefill node that yields its cores to decode nodes (roles/scheduling/borrowed.py
and the Scheduler's price_yielded_work), with hand-computed expectations."""

from __future__ import annotations

import math

import pytest

from roles.scheduling import borrowed
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PolynomialPrefillEstimator
from roles.scheduling.transfer_estimator import TransferEstimator
from roles.scheduling.scheduler import (ARRIVAL_WINDOW_S, YIELD_SHARE_HALF_LIFE_S, Scheduler,
                                        SchedulerConfig)
from roles.scheduling.state import NodeReport, RunningSeq, ScheduleRequest


def test_busy_sets_merge_and_intersect():
    assert borrowed.merge([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert borrowed.intersect([(0, 2), (3, 6)], [(1, 4), (5, 7)]) == [(1, 2), (3, 4), (5, 6)]
    assert borrowed.busy_within([(0, 2), (3, 4)], 1, 3.5) == pytest.approx(1.5)


def test_work_runs_in_the_gaps():
    busy = [(1.0, 2.0), (3.0, 4.0)]
    # 0.5 s of work from 0: done before the first busy stretch.
    assert borrowed.wall_for(busy, 0.0, 0.5) == pytest.approx(0.5)
    # 1.5 s: 1 s before it, 0.5 s after it.
    assert borrowed.wall_for(busy, 0.0, 1.5) == pytest.approx(2.5)
    # Starting inside a busy stretch: waits for its end.
    assert borrowed.wall_for(busy, 1.5, 1.2) == pytest.approx(0.5 + 1.0 + 1.0 + 0.2)
    assert borrowed.wall_for([], 7.0, 0.3) == pytest.approx(0.3)
    assert borrowed.progress(busy, 0.0, 3.5) == pytest.approx(2.0)
    assert borrowed.progress(busy, 0.0, 4.5) == pytest.approx(2.5)
    assert borrowed.progress(busy, 2.0, 1.0) == 0.0


def test_work_runs_at_a_share_of_the_busy_stretches():
    # A colocated node's prefill: a quarter of the thread while its decode
    # steps, all of it outside.
    busy = [(1.0, 2.0), (3.0, 4.0)]
    # 1.5 s from 0: 1 s before the first stretch, 0.25 s in it, 0.25 s after.
    assert borrowed.wall_for(busy, 0.0, 1.5, busy_rate=0.25) == pytest.approx(2.25)
    # Starting inside a stretch: 0.125 s of work by its end, then 1 s of gap.
    assert borrowed.wall_for(busy, 1.5, 1.2, busy_rate=0.25) == pytest.approx(0.5 + 1.0 + 0.3)
    # Ending inside the second stretch: 2.375 - 1 - 0.25 - 1 = 0.125 left at a quarter.
    assert borrowed.wall_for(busy, 0.0, 2.375, busy_rate=0.25) == pytest.approx(3.5)
    assert borrowed.progress(busy, 0.0, 3.5, busy_rate=0.25) == pytest.approx(2.375)
    assert borrowed.progress(busy, 1.5, 1.5, busy_rate=0.25) == 0.0
    # busy_rate 0 is the borrower's: nothing inside busy.
    assert borrowed.wall_for(busy, 0.0, 1.5, busy_rate=0.0) == borrowed.wall_for(busy, 0.0, 1.5)


def test_after_a_point_the_gaps_pass_at_the_idle_rate():
    busy = [(1.0, 2.0)]
    # From 0.5 on, gaps give half their time: 0.5 + (0.5 x 0.5) by 1.0, then
    # 0.25 s left at half rate after the busy stretch: 0.5 s more.
    assert borrowed.wall_for(busy, 0.0, 1.0, after=0.5, idle_rate=0.5) == pytest.approx(2.5)
    assert borrowed.progress(busy, 0.0, 2.5, after=0.5, idle_rate=0.5) == pytest.approx(1.0)
    assert borrowed.idle_share_of_arrivals(2.0, 0.5) == pytest.approx(math.exp(-1.0))
    assert borrowed.idle_share_of_arrivals(0.0, 0.5) == 1.0


def borrowing_cluster(own_nodes: tuple[str, ...] = (), **cfg) -> Scheduler:
    """Decode node d0, prefill nodes ``own_nodes`` with cores of their own
    and b, which yields to d0; 0.05 s per prefill whatever the prompt,
    refitted after every sample."""
    s = Scheduler(SchedulerConfig(policy="mooncake", tbt_slo_s=1.0, per_node_prefill_fit=True,
                                  **cfg),
                  PolynomialPrefillEstimator({"c0": 0.05}, refit_every=1, window=8),
                  TransferEstimator(1e9), DecodeEstimator(0.01, 0.0, 0.0))
    s.add_decode_node("d0", page_budget=1000, page_tokens=16)
    for node in own_nodes:
        s.add_prefill_node(node)
    s.add_prefill_node("b", yields_to=("d0",))
    return s


def scheduler(price: bool) -> Scheduler:
    s = borrowing_cluster(ttft_slo_s=10.0, price_yielded_work=price)
    # d0 decodes one sequence with 20 tokens left at 10 ms a step: busy [0, 0.2].
    s.on_node_report("d0", NodeReport(at=0.0, recent_tbt_s=0.01,
                                      decode_sequences={"x": RunningSeq(100, 20)}), 0.0)
    return s


def request(rid: str) -> ScheduleRequest:
    return ScheduleRequest(rid, (1,), prompt_tokens=8, block_size=16, expected_output_tokens=1)


def test_a_yielding_node_is_priced_after_the_decode_nodes_busy_time():
    s = scheduler(price=True)
    assert s.decode_busy("d0") == [(0.0, pytest.approx(0.2))]
    d = s.schedule(request("r1"), now=0.0)
    # 0.2 s of decode first, then its 0.05 s of work.
    assert d.prefill_node == "b"
    assert d.t_prefill == pytest.approx(0.25)
    # Its queue holds the work, not the wall time: the next one waits for
    # r1's 0.05 s of work, which ends at 0.25, then does its own.
    assert s.prefill["b"].pending["r1"].estimate_s == pytest.approx(0.05)
    d2 = s.schedule(request("r2"), now=0.0)
    assert d2.t_queue + d2.t_prefill == pytest.approx(0.30)
    # Off, the node is priced as any other: 0.05 s, no queue wait but r1's.
    plain = scheduler(price=False)
    assert plain.schedule(request("r1"), now=0.0).t_prefill == pytest.approx(0.05)


def test_a_yielding_node_is_fitted_on_its_cpu_seconds():
    for price, fitted in ((True, 0.02), (False, 0.3)):
        s = scheduler(price)
        for i in range(5):  # the fit needs a sample per term
            s.schedule(request(f"r{i}"), now=0.0)
            s.on_prefill_finished("b", f"r{i}", 0.3, actual_seconds=0.3, actual_work_s=0.02)
        # (the prior, a tenth of a sample, pulls five samples by < 2%)
        assert s.node_estimators["b"].seconds(8, 0) == pytest.approx(fitted, rel=0.02)


def test_work_the_node_reports_done_is_taken_off_its_queue():
    s = scheduler(price=True)
    s.config.queue_from_bookings = True
    s.schedule(request("r1"), now=0.0)
    # At 0.1 (decode busy until 0.2) the node says it spent 0.01 s on r1.
    s.on_node_report("b", NodeReport(at=0.1, queued_prefill_s=0.05, prefill_requests=frozenset({"r1"}),
                                     prefill_running_s={"r1": 0.1},
                                     prefill_worked_s={"r1": 0.01}), 0.1)
    progress = s.progress_fn("b")
    # 0.04 s left at 0.1; by 0.25 it has had 0.05 s of idle core (0.2-0.25).
    assert s.prefill["b"].queue_time(0.1, progress) == pytest.approx(0.04)
    assert s.prefill["b"].queue_time(0.22, progress) == pytest.approx(0.02)


def test_requests_accepted_lately_stand_for_those_still_to_come():
    s = scheduler(price=True)
    for i in range(5):
        s.schedule(ScheduleRequest(f"r{i}", (1,), 8, 16, expected_output_tokens=11), now=0.0)
    # 5 in the window: 0.5 req/s, 10 decode steps of 10 ms each: e^(-0.05).
    rate = 5 / ARRIVAL_WINDOW_S
    assert s.arrival_idle_share("d0", 0.0) == pytest.approx(math.exp(-rate * 0.1))
    assert s.yielded_idle_rate("b", 0.0) == pytest.approx(math.exp(-rate * 0.1))
    # They leave the window: nothing more is expected.
    assert s.arrival_idle_share("d0", ARRIVAL_WINDOW_S + 1) == 1.0
    # A node yielding to no live decode node runs at full rate.
    s.mark_dead("d0")
    assert s.yielded_idle_rate("b", 0.0) == 1.0


def overflow_scheduler(overflow_only: bool) -> Scheduler:
    # TTFT SLO 0.12 s, 0.05 s a prefill: a node admits two queued requests.
    return borrowing_cluster(("a",), ttft_slo_s=0.12, yielding_overflow_only=overflow_only)


def test_a_yielding_node_takes_only_what_the_others_cannot_admit():
    s = overflow_scheduler(overflow_only=True)
    chosen = [s.schedule(request(f"r{i}"), now=0.0) for i in range(5)]
    # r1 on a (0.05 s); r2 on a too (0.10 s, within 0.12) although b is idle;
    # r3 would wait 0.10 s on a (0.15 s): b takes it, then r4 (0.10 s on b).
    assert [getattr(d, "prefill_node", None) for d in chosen[:4]] == ["a", "a", "b", "b"]
    assert chosen[1].predicted_ttft_s == pytest.approx(0.10)
    assert chosen[3].predicted_ttft_s == pytest.approx(0.10)
    # r5: 0.15 s on either: refused, priced as the node with cores of its own.
    assert chosen[4].reason == "ttft_slo"
    assert chosen[4].predicted_ttft_s == pytest.approx(0.15)
    # Chosen like any node, Algorithm 1 puts r2 on the idle borrower.
    plain = overflow_scheduler(overflow_only=False)
    first = plain.schedule(request("r1"), now=0.0).prefill_node
    assert plain.schedule(request("r2"), now=0.0).prefill_node != first


def starving_borrower() -> Scheduler:
    """b alone, yielding to an idle d0 (no busy intervals: the model gives
    b the whole core), 0.2 s of work a prefill, node reports counted."""
    s = Scheduler(SchedulerConfig(policy="mooncake", tbt_slo_s=1.0, ttft_slo_s=1.0,
                                  per_node_prefill_fit=True, price_yielded_work=True,
                                  queue_from_bookings=True),
                  PolynomialPrefillEstimator({"c0": 0.2}, refit_every=1, window=8),
                  TransferEstimator(1e9), DecodeEstimator(0.01, 0.0, 0.0))
    s.add_decode_node("d0", page_budget=1000, page_tokens=16)
    s.add_prefill_node("b", yields_to=("d0",))
    return s


def report_running(s: Scheduler, at: float, running: dict[str, float],
                   worked: dict[str, float]) -> None:
    s.on_node_report("b", NodeReport(at=at, queued_prefill_s=0.0,
                                     prefill_requests=frozenset(running),
                                     prefill_running_s=running, prefill_worked_s=worked), at)


def test_a_borrower_that_gets_less_cpu_than_modelled_is_priced_by_what_it_got():
    s = starving_borrower()
    assert s.schedule(request("r1"), now=0.0).prefill_node == "b"
    # Something the model cannot see takes the core: r1 gets 0.05 s of CPU a second.
    report_running(s, 1.0, {"r1": 1.0}, {"r1": 0.05})
    assert s.yield_share("b", 1.0) == 1.0          # one report: no stretch measured yet
    report_running(s, 2.0, {"r1": 2.0}, {"r1": 0.10})
    assert s.yield_share("b", 2.0) == pytest.approx(0.05)
    # 0.1 s of r1's work left, at 0.05 of the modelled pace: r2 (0.2 s of
    # work) would answer after (0.1 + 0.2) / 0.05 = 6 s: refused.  Priced
    # at the model's pace it was 0.3 s, and at 2.5 s (r1 "done") 0.2 s.
    refused = s.schedule(request("r2"), now=2.0)
    assert refused.reason == "ttft_slo"
    assert refused.predicted_ttft_s == pytest.approx(6.0)
    share = 1 - 0.95 * 0.5 ** (0.5 / YIELD_SHARE_HALF_LIFE_S)   # 0.5 s unmeasured
    assert s.schedule(request("r3"), now=2.5).predicted_ttft_s == pytest.approx(
        (0.1 - share * 0.5 + 0.2) / share)
    # Without measurements it moves back halfway to 1 every half-life.
    assert s.yield_share("b", 12.0) == pytest.approx(1 - 0.95 * 0.5)


def test_the_borrowers_share_is_learned_only_over_one_unchanged_pass():
    s = starving_borrower()
    s.schedule(request("r1"), now=0.0)
    s.schedule(request("r2"), now=0.0)
    report_running(s, 1.0, {"r1": 1.0}, {"r1": 0.05})
    # r1 ended and r2 started in between: the CPU of neither covers the stretch.
    report_running(s, 2.0, {"r2": 0.3}, {"r2": 0.01})
    assert s.yield_share("b", 2.0) == 1.0
    # At full pace it stays 1 (never above); a low measurement is taken at
    # once, a higher one halfway.
    report_running(s, 3.0, {"r2": 1.3}, {"r2": 1.01})
    assert s.yield_share("b", 3.0) == 1.0
    report_running(s, 4.0, {"r2": 2.3}, {"r2": 1.21})
    assert s.yield_share("b", 4.0) == pytest.approx(0.2)
    report_running(s, 5.0, {"r2": 3.3}, {"r2": 1.81})
    before = 1 - 0.8 * 0.5 ** (1.0 / YIELD_SHARE_HALF_LIFE_S)   # 1 s of recovery first
    assert s.yield_share("b", 5.0) == pytest.approx(before + 0.5 * (0.6 - before))
