"""A colocated node's two kinds of work on one compute thread, priced by hand.

While a colocated node decodes it alternates one prefill chunk of
``interleave_tokens`` and one decode step: a prefill gets chunk / (chunk +
step) of the wall time for as long as the node's replies are predicted to
step, all of it outside, and a decode sequence's interval holds a chunk for
as long as prefill work is queued there.
"""
import math

import pytest

from roles.scheduling import (DecodeEstimator, NodeReport, PolynomialPrefillEstimator, Rejection,
                              ScheduleRequest, Scheduler, SchedulerConfig, TransferEstimator)

BS = 64
STEP = 0.016      # the decode step, whatever the batch
PER_TOKEN = 1e-3  # prefill seconds per computed token: a 64-token chunk is 0.064 s


def sched(tbt_slo_s=1.0):
    s = Scheduler(SchedulerConfig(policy="load_balance", kv_bytes_per_token=1000,
                                  ttft_slo_s=30.0, tbt_slo_s=tbt_slo_s,
                                  queue_from_bookings=False, per_node_prefill_fit=False),
                  PolynomialPrefillEstimator({"n": PER_TOKEN}), TransferEstimator(1e9),
                  DecodeEstimator(STEP, 0.0, 0.0))
    s.add_prefill_node("c0", interleave_tokens=BS)
    s.add_decode_node("c0", page_budget=10_000, page_tokens=BS)
    return s


def req(rid, tokens, out=2, base=0):
    base = base or 1000 * (1 + sum(map(ord, rid)))
    return ScheduleRequest(rid, tuple(range(base, base + -(-tokens // BS))), tokens, BS, out)


def test_a_prefill_on_a_decoding_colocated_node_gets_its_share_of_the_thread():
    s = sched()
    # Nothing decoding: the whole thread, 100 tokens = 0.1 s.
    a = s.schedule(req("a", 100, out=1000), now=0.0)
    assert a.predicted_ttft_s == pytest.approx(0.1)
    assert s.prefill_share("c0") == pytest.approx(0.064 / (0.064 + STEP))   # 0.8
    # "a" decodes there from its first token at 0.1 s for 999 steps: "b"
    # waits for a's 0.1 s of work (no decode yet) and computes its own 0.1 s
    # at 0.8 of the wall time.
    b = s.schedule(req("b", 100), now=0.0)
    assert b.t_queue == pytest.approx(0.1) and b.t_prefill == pytest.approx(0.125)
    assert b.predicted_ttft_s == pytest.approx(0.225)


def test_a_short_reply_slows_a_prefill_on_its_node_for_its_steps_only():
    s = sched()
    s.schedule(req("a", 100, out=3), now=0.0)
    # "a" decodes 2 steps from 0.1 s: [0.1, 0.132] at 0.8 of the thread
    # gets 0.0256 s of b's work done, the other 0.0744 s at full speed.
    b = s.schedule(req("b", 100), now=0.0)
    assert b.t_queue == pytest.approx(0.1)
    assert b.t_prefill == pytest.approx(0.032 + 0.0744)
    # What b's measured share is compared with: 0.1 s of work in 0.1064 s.
    assert s.inflight["b"].modelled_share == pytest.approx(0.1 / 0.1064)


def test_a_reply_decoding_where_prefill_is_queued_waits_a_chunk_per_interval():
    s = sched(tbt_slo_s=0.05)
    s.add_prefill_node("p1")        # prefill only: the request is computed there
    a = s.schedule(req("a", 1000), now=0.0)
    assert a.prefill_node == "c0" and a.predicted_ttft_s == pytest.approx(1.0)
    # "b" prefills on idle p1 (0.1 s) and joins c0, which still has
    # 1.0 - 0.1 x 0.8 = 0.92 s of a's work: 14.4 chunks, more than b's 10
    # intervals, so each holds a chunk: 0.016 + 0.064 = 0.080 s > 0.05.
    r = s.schedule(req("b", 100, out=11), now=0.0)
    assert isinstance(r, Rejection) and r.reason == "tbt_slo"
    assert r.predicted_ttft_s == pytest.approx(0.1)
    assert r.predicted_tbt_s == pytest.approx(0.080)
    # A 101-token reply: 14.375 of its 100 intervals hold a chunk, a mean of
    # 0.016 + 0.064 x 14.375 / 100 = 0.0252 s.
    d = s.schedule(req("c", 100, out=101), now=0.0)
    assert d.prefill_node == "p1" and d.decode_node == "c0"
    assert d.predicted_tbt_s == pytest.approx(0.016 + 0.064 * 14.375 / 100)


def test_a_node_not_colocated_is_priced_on_its_own_cores():
    s = sched()
    s.add_prefill_node("p1")
    s.schedule(req("a", 100), now=0.0)
    assert s.prefill_share("p1") == 1.0
    assert s.interleave("p1") == (0.0, 0.0)


def test_hand_offs_are_learned_apart_from_a_nodes_own_prefill_and_from_others():
    # c0 decodes everything; "local" replies were prefilled on c0 itself
    # (their first interval 0.001 s beyond the step), "remote" ones on p1
    # (0.040 s beyond it: a round trip through the conductor).
    s = sched()
    s.add_prefill_node("p1")
    for i in range(12):
        t = i * 0.05
        for where, extra in (("c0", 0.001), ("p1", 0.040)):
            other = "p1" if where == "c0" else "c0"
            s.on_node_report(other, NodeReport(at=t, queued_prefill_s=100.0), t)
            s.on_node_report(where, NodeReport(at=t, queued_prefill_s=0.0), t)
            d = s.schedule(req(f"{where}{i}", 100, out=3), now=t)
            assert (d.prefill_node, d.decode_node) == (where, "c0")
            s.on_prefill_finished(where, d.request_id, now=t, actual_seconds=0.1)
            step = s.inflight[d.request_id].tbt_model_s
            s.on_decode_finished("c0", d.request_id, t, [step + extra, step])
    # (12 samples each, under a second old: trusted; the cluster's mixes both)
    assert s.handoff_s("c0", 0.6, prefill_node="c0") == pytest.approx(0.001)
    assert s.handoff_s("c0", 0.6, prefill_node="p1") == pytest.approx(0.040)


def test_the_tbt_ratio_learns_the_step_not_prefills_that_came_later():
    # "a" was priced with nothing queued on c0 (no chunk in its intervals);
    # while it decoded, two 0.064 s prefills ran there.  Its 5 intervals
    # (one hand-off, four after it) held them: 0.128 / 5 = 0.0256 s each on
    # top of the 0.016 s step, which is what the model's interval is taken
    # to be, so the step's own ratio stays 1 (log-ratio 0) rather than
    # 0.0416 / 0.016 = 2.6.
    s = sched()
    for i in range(10):
        t = i * 1.0
        a = s.schedule(req(f"a{i}", 64, out=6), now=t)
        assert a.predicted_tbt_s == pytest.approx(STEP)
        s.on_prefill_finished("c0", a.request_id, now=t + 0.064, actual_seconds=0.064)
        for j, done in enumerate((t + 0.2, t + 0.3)):
            b = s.schedule(req(f"b{i}-{j}", 64, out=1), now=done - 0.1)
            s.on_prefill_finished("c0", b.request_id, now=done, actual_seconds=0.064)
            s.on_decode_finished("c0", b.request_id, done)
        s.on_decode_finished("c0", a.request_id, t + 0.5,
                             [STEP] + [STEP + 0.128 / 5] * 4)
    assert s.residual_stats(10.0)["tbt_log_ratio"]["c0/0"].samples == 10
    assert s.tbt_ratio("c0", 10.0, level=0) == pytest.approx(1.0, abs=1e-6)


def test_a_chunk_gives_way_after_the_step_ratio_of_the_models_step():
    # Chunks of 128 tokens (0.128 s at 1 ms a token) that give way to a
    # waiting step after 2 steps' time; the model's step is 0.016 s.
    s = Scheduler(SchedulerConfig(policy="load_balance", kv_bytes_per_token=1000,
                                  queue_from_bookings=False, per_node_prefill_fit=False),
                  PolynomialPrefillEstimator({"n": PER_TOKEN}), TransferEstimator(1e9),
                  DecodeEstimator(STEP, 0.0, 0.0))
    s.add_prefill_node("c0", interleave_tokens=128, interleave_step_ratio=2.0)
    s.add_decode_node("c0", page_budget=10_000, page_tokens=BS)
    assert s.chunk_s("c0") == pytest.approx(0.128)           # no step: the whole chunk
    assert s.chunk_s("c0", 0.016) == pytest.approx(0.032)
    assert s.chunk_s("c0", 0.100) == pytest.approx(0.128)    # never more than the chunk
    s.schedule(req("a", 100), now=0.0)                       # "a" decodes on c0
    chunk, step = s.interleave("c0")
    assert chunk == pytest.approx(0.032)
    assert s.prefill_share("c0") == pytest.approx(0.032 / (0.032 + step))


def two_colocated(tbt_slo_s):
    """c0 and c1 both prefill and decode; the step grows 0.01 s a sequence."""
    s = Scheduler(SchedulerConfig(policy="load_balance", kv_bytes_per_token=1000,
                                  ttft_slo_s=30.0, tbt_slo_s=tbt_slo_s,
                                  queue_from_bookings=False, per_node_prefill_fit=False),
                  PolynomialPrefillEstimator({"n": PER_TOKEN}), TransferEstimator(1e9),
                  DecodeEstimator(0.010, 0.010, 0.0))
    for node in ("c0", "c1"):
        s.add_prefill_node(node)
        s.add_decode_node(node, page_budget=10_000, page_tokens=BS)
    s.on_node_report("c1", NodeReport(at=0.0, queued_prefill_s=100.0), 0.0)  # c0 prefills
    return s


def test_the_node_that_prefills_decodes_too_while_its_tbt_is_admitted():
    s = two_colocated(tbt_slo_s=0.1)
    a = s.schedule(req("a", 100, out=8), now=0.0)
    assert (a.prefill_node, a.decode_node) == ("c0", "c0")
    # "b" joins c0 beside "a": a step of 0.01 + 0.01 x 2 = 0.03 s, within the
    # 0.1 s SLO although idle c1 would step in 0.02 s: the KV stays on c0.
    b = s.schedule(req("b", 100, out=8), now=0.0)
    assert (b.prefill_node, b.decode_node) == ("c0", "c0")
    assert b.predicted_tbt_s == pytest.approx(0.03)


def test_a_reply_whose_tbt_the_prefill_node_would_miss_decodes_elsewhere():
    s = two_colocated(tbt_slo_s=0.025)
    s.schedule(req("a", 100, out=8), now=0.0)
    # 0.03 s on c0 is over the 0.025 s SLO: the least TBT, c1's 0.02 s.
    b = s.schedule(req("b", 100, out=8), now=0.0)
    assert (b.prefill_node, b.decode_node) == ("c0", "c1")
    assert b.predicted_tbt_s == pytest.approx(0.02)


def learn_share(s, count, gave_way_s=0.1, now=1.0):
    """``count`` 100-token prefills booked on c0 while it decodes (modelled
    share 0.8), each reporting 0.1 s of compute and ``gave_way_s`` of decode
    steps run inside it."""
    for i in range(count):
        rid = f"learn-{i}"
        s.schedule(req(rid, 100), now=0.0)
        s.on_prefill_finished("c0", rid, now=now, actual_seconds=0.1,
                              actual_gave_way_s=gave_way_s)


def test_the_share_a_decoding_node_gives_its_prefills_is_learned_from_their_replies():
    """Modelled 0.8; measured 0.1 / (0.1 + 0.1) = 0.5: each reply adds the
    residual log(0.8 / 0.5), and with min_samples of them the node's share
    is 0.8 / 1.6 = 0.5: 100 tokens (0.1 s of work) take 0.2 s."""
    s = sched()
    s.schedule(req("a", 100, out=10_000), now=0.0)    # "a" decodes on c0 from 0.1 s on
    learn_share(s, s.config.residual_min_samples)
    assert s.modelled_prefill_share("c0") == pytest.approx(0.8)
    assert s.prefill_share("c0", now=1.0) == pytest.approx(0.5)
    assert s.prefill_share("c0") == pytest.approx(0.8)     # no time given: the model
    b = s.schedule(req("b", 100), now=1.0)
    assert b.t_prefill == pytest.approx(0.2)
    stats = s.residual_stats(1.0)["prefill_share_log_ratio"]
    assert stats["c0"].median == pytest.approx(math.log(0.8 / 0.5))


def test_the_modelled_share_holds_until_enough_replies_say_otherwise():
    s = sched()
    s.schedule(req("a", 100, out=10_000), now=0.0)
    learn_share(s, s.config.residual_min_samples - 1)
    assert s.prefill_share("c0", now=1.0) == pytest.approx(0.8)


def test_a_prefill_booked_while_its_node_did_not_decode_teaches_no_share():
    """Booked on an idle c0 (modelled share 1): its steps came from
    requests that arrived after it, not from what the model priced."""
    s = sched()
    for i in range(12):
        rid = f"idle-{i}"
        s.schedule(req(rid, 100), now=0.0)
        s.on_prefill_finished("c0", rid, now=1.0, actual_seconds=0.1, actual_gave_way_s=0.1)
        s.on_decode_finished("c0", rid, now=1.0)
    assert s.residual_stats(1.0)["prefill_share_log_ratio"] == {}


def test_each_prefill_queued_ahead_adds_the_nodes_learned_wait_for_the_thread():
    """c0's prefills each waited 0.02 s for its compute thread (decode steps
    queued there ahead of them).  A request booked behind prefills that
    have not started waits for their work plus one such wait for each of
    them and its own.  (Their decode starts after their first tokens, past
    the queue priced here: the work runs on the whole thread.)"""
    s = sched()
    for i in range(s.config.residual_min_samples + 1):   # one to age
        rid = f"w{i}"
        s.schedule(req(rid, 100), now=0.0)
        s.on_prefill_finished("c0", rid, now=1.0, actual_seconds=0.1, actual_thread_wait_s=0.02)
        s.on_decode_finished("c0", rid, now=1.0)
    assert s.residual_stats(1.0)["prefill_start_wait_s"]["c0"].median == pytest.approx(0.02)
    a = s.schedule(req("a", 100), now=1.0)
    assert a.t_queue == pytest.approx(0.02)                      # its own wait
    b = s.schedule(req("b", 100), now=1.0)
    assert b.t_queue == pytest.approx(0.1 + 2 * 0.02)            # a's work, a's wait, its own
    c = s.schedule(req("c", 100), now=1.0)
    assert c.t_queue == pytest.approx(0.2 + 3 * 0.02)
    # Past a's predicted start (1.02 s) a waits no more: b, c and a newcomer.
    assert s.start_waits_s("c0", 2, now=1.03) == pytest.approx(3 * 0.02)


def test_no_measured_wait_adds_nothing_to_the_queue():
    s = sched()
    for i in range(s.config.residual_min_samples + 1):   # one to age
        rid = f"w{i}"
        s.schedule(req(rid, 100), now=0.0)
        s.on_prefill_finished("c0", rid, now=1.0, actual_seconds=0.1)
        s.on_decode_finished("c0", rid, now=1.0)
    s.schedule(req("a", 100), now=1.0)
    assert s.schedule(req("b", 100), now=1.0).t_queue == pytest.approx(0.1)
    assert s.residual_stats(1.0)["prefill_start_wait_s"] == {}
