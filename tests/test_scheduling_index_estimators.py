"""Global cache index events/gaps/resync and the estimator fits."""
import random

import pytest

from roles.scheduling import (DecodeEstimator, FlopsPrefillEstimator, GlobalCacheIndex,
                              ModelShape, PolynomialPrefillEstimator, TransferEstimator,
                              fit_polynomial)
from roles.scheduling.estimators import prior_anchors


def test_longest_prefix_per_node():
    ix = GlobalCacheIndex()
    ix.add("a", [1, 2, 3, 4])
    ix.add("b", [1, 2])
    ix.add("c", [2, 3, 4])  # no leading block: no prefix
    ix.add("d", [1, 3, 4])  # hole at block 1: prefix is 1 block
    assert ix.longest_prefix_per_node([1, 2, 3, 4, 5]) == {"a": 4, "b": 2, "d": 1}
    assert ix.longest_prefix_per_node([9, 1]) == {}
    assert ix.longest_prefix_per_node([]) == {}


def test_prefix_matches_brute_force():
    rng = random.Random(1)
    ix = GlobalCacheIndex()
    held = {}
    for n in range(70):  # beyond one 64-bit word of slots
        ks = {k for k in range(40) if rng.random() < 0.9}
        held[f"n{n}"] = ks
        ix.add(f"n{n}", ks)
    keys = list(range(40))
    want = {}
    for n, ks in held.items():
        i = 0
        while i < len(keys) and keys[i] in ks:
            i += 1
        if i:
            want[n] = i
    assert ix.longest_prefix_per_node(keys) == want


def test_events_gap_and_resync():
    ix = GlobalCacheIndex()
    assert ix.apply_events("a", 0, [1, 2, 3], [])
    assert ix.apply_events("a", 1, [4], [2])
    assert ix.holders(2) == [] and ix.holders(4) == ["a"]
    assert ix.apply_events("a", 1, [99], [])  # duplicate batch: ignored
    assert ix.holders(99) == []
    assert not ix.apply_events("a", 5, [5], [])  # gap: applied, marked
    assert "a" in ix.needs_resync and ix.holders(5) == ["a"]
    ix.resync("a", [1, 7], next_seq=6)
    assert ix.needs_resync == set()
    assert sorted(k for k in (1, 3, 4, 5, 7) if ix.holders(k)) == [1, 7]
    assert ix.blocks_on("a") == 2
    assert ix.apply_events("a", 6, [8], [])


def test_blocks_from_a_reply_are_added_only_ahead_of_the_batch_that_reports_them():
    idx = GlobalCacheIndex()
    assert not idx.add_ahead("a", 1, [5])               # never synced: nothing known
    idx.resync("a", [1], next_seq=3)                    # batches 1 and 2 are in the snapshot
    assert not idx.add_ahead("a", 2, [5])               # batch 2 already covered
    assert idx.add_ahead("a", 3, [5, 6])                # batch 3 still to come
    assert idx.holders(5) == ["a"] and idx.blocks_on("a") == 3
    assert idx.apply_events("a", 3, stored=[5, 6], evicted=[]) # the batch itself: no change
    assert idx.blocks_on("a") == 3
    # Batch 4 evicted 7 before the reply that stored it was read: the reply adds nothing.
    assert idx.apply_events("a", 4, stored=[], evicted=[7])
    assert not idx.add_ahead("a", 4, [7])
    assert idx.holders(7) == []
    # A node waiting for a resync takes nothing from replies either.
    assert not idx.apply_events("a", 9, stored=[], evicted=[])   # a gap
    assert not idx.add_ahead("a", 10, [8])
    assert idx.holders(8) == []


def test_remove_node_frees_slot():
    ix = GlobalCacheIndex()
    ix.add("a", [1, 2])
    ix.add("b", [1])
    ix.remove_node("a")
    assert ix.holders(1) == ["b"] and ix.holders(2) == [] and len(ix) == 1
    ix.add("c", [2])  # reuses a's slot without inheriting its keys
    assert ix.holders(1) == ["b"] and ix.holders(2) == ["c"]
    assert ix.longest_prefix_per_node([1, 2]) == {"b": 1}


def test_polynomial_fit_recovers_coefficients():
    true = {"c0": 0.01, "n": 2e-4, "n2": 3e-9, "np": 1e-9, "p": 1e-6}
    est = PolynomialPrefillEstimator(true)
    samples = [(n, p, est.seconds(n + p, p)) for n in (100, 1000, 4000, 8000, 16000)
               for p in (0, 2000, 8000)]
    fit = fit_polynomial(samples)
    for k, v in true.items():
        assert fit[k] == pytest.approx(v, rel=1e-3, abs=1e-12)


def test_online_refit_moves_towards_observations():
    # Least squares: the prior's tenth of a sample against 19 pulls by ~0.5%.
    est = PolynomialPrefillEstimator({"n": 1e-3}, refit_every=8)
    alone = PolynomialPrefillEstimator({"n": 1e-3}, refit_every=8, prior_weight=0)
    for n in range(1000, 20000, 1000):
        est.observe(n, 0, 2e-3 * n)
        alone.observe(n, 0, 2e-3 * n)
    assert est.seconds(10_000, 0) == pytest.approx(20.0, rel=0.01)
    assert alone.seconds(10_000, 0) == pytest.approx(20.0, rel=1e-3)
    with pytest.raises(ValueError, match="unknown terms"):
        PolynomialPrefillEstimator({"n3": 1.0})


def _prefills_with_two_slow_starts():
    """Prefills exactly on t = 3 ms + 0.1 ms/token + 1e-8 n^2 + 2e-8 n p, but
    the first two 1,040-token ones took 330 and 260 ms (start-up)."""
    true = PolynomialPrefillEstimator({"c0": 3e-3, "n": 1e-4, "n2": 1e-8, "np": 2e-8})
    samples = [(1040, 0, 0.33), (1030, 0, 0.26)]
    for n in (1, 5, 20, 50, 120, 300, 1040):
        for p in ((0, 128, 1024) if n < 1000 else (0,)):
            samples += [(n, p, true.seconds(n + p, p))] * 3
    return true, samples


def test_least_absolute_fit_is_not_pulled_by_a_few_far_off_prefills():
    true, samples = _prefills_with_two_slow_starts()
    cold = true.seconds(1040, 0)                                  # 117.8 ms
    lsq = PolynomialPrefillEstimator(fit_polynomial(samples))
    lad = PolynomialPrefillEstimator(fit_polynomial(samples, least_absolute=True))
    assert lsq.seconds(1040, 0) > 1.05 * cold                     # least squares: pulled up
    assert lad.seconds(1040, 0) == pytest.approx(cold, rel=0.01)
    assert lad.seconds(5 + 128, 128) == pytest.approx(true.seconds(133, 128), rel=0.01)


def test_online_refit_uses_the_least_absolute_fit_when_asked():
    true, samples = _prefills_with_two_slow_starts()
    est = PolynomialPrefillEstimator({"n": 1e-3}, refit_every=len(samples), least_absolute=True)
    for n, p, t in samples:
        est.observe(n + p, p, t)
    assert est.fork().seconds(1040, 0) == pytest.approx(true.seconds(1040, 0), rel=0.01)


def test_flops_estimator_matches_paper_formula():
    shape = ModelShape()
    est = FlopsPrefillEstimator(shape, gpu_flops=8 * 312e12, efficiency=1.0)
    n, p = 8192, 4096
    flops = 80 * (4 * (n * n - p * p) * 8192 + 22 * (n - p) * 8192 ** 2)
    assert est.seconds(n, p) == pytest.approx(flops / (8 * 312e12))
    assert shape.kv_bytes_per_token == 327_680
    # 128k tokens of LLaMA3-70B KV ~ 40 GiB, as in the paper
    assert 128 * 1024 * shape.kv_bytes_per_token / 2**30 == pytest.approx(40.0)


def test_transfer_and_decode_estimators():
    t = TransferEstimator(1e9)
    assert t.seconds("a", 2e9, now=0.0) == pytest.approx(2.0)
    assert t.reserve("a", 2e9, now=0.0) == pytest.approx(2.0)
    assert t.seconds("a", 1e9, now=1.0) == pytest.approx(2.0)  # 1 s wait + 1 s
    t.observe("a", 3e9, 1.0)  # faster than the default, one size: bandwidth 3 GB/s, no latency
    assert (t.bw("a"), t.latency_s("a")) == (pytest.approx(3e9), 0.0)
    d = DecodeEstimator.from_hardware(ModelShape(), hbm_Bps=8 * 2.0e12, efficiency=1.0,
                                      per_seq_s=0.0)
    # weights 141 GB over 16 TB/s ~ 8.8 ms per step
    assert d.seconds(1, 0) == pytest.approx(70.6e9 * 2 / 16e12)
    assert d.seconds(0, 0) == 0.0


def test_a_transfers_fixed_cost_is_not_taken_for_low_bandwidth():
    """Pulls of 1-8 MB, each 10 ms of RPCs and setup plus the bytes at 2 GB/s:
    the fit finds both, and a 20 MB pull is priced 10 + 10 ms.  (Bandwidth
    learned as bytes / time priced it at 40 ms: 1 MB in 10.5 ms looks like
    95 MB/s.)"""
    t = TransferEstimator(1e9)
    for mb in (1, 2, 4, 8):
        t.observe("a", int(mb * 1e6), 0.010 + mb * 1e6 / 2e9)
    assert t.latency_s("a") == pytest.approx(0.010)
    assert t.bw("a") == pytest.approx(2e9)
    assert t.seconds("a", int(20e6), now=0.0) == pytest.approx(0.020)
    # The NIC is booked for the bytes only: the next pull waits 10 ms, not 20.
    assert t.reserve("a", int(20e6), now=0.0) == pytest.approx(0.020)
    assert t.seconds("a", int(2e6), now=0.0) == pytest.approx(0.010 + 0.010 + 0.001)


def test_transfers_of_one_size_keep_the_bandwidth_and_learn_the_latency():
    """Three 1 MB pulls of 10.5 ms: slope and intercept cannot be told apart,
    so the bandwidth stays the default (1 GB/s) and the latency is the rest
    (9.5 ms); a 20 MB pull is then 29.5 ms, not 210 ms."""
    t = TransferEstimator(1e9)
    for _ in range(3):
        t.observe("b", int(1e6), 0.0105)
    assert t.bw("b") == pytest.approx(1e9) and t.latency_s("b") == pytest.approx(0.0095)
    assert t.seconds("b", int(20e6), now=0.0) == pytest.approx(0.0295)
    # Noise where a larger pull came out faster keeps the slope too.
    t.observe("b", int(4e6), 0.009)
    assert t.bw("b") == pytest.approx(1e9) and t.latency_s("b") == pytest.approx(0.008375)


def test_decode_estimator_follows_measured_step_times():
    from roles.scheduling.decode_estimator import DecodeEstimator
    from roles.scheduling.estimators import PolynomialPrefillEstimator
    from roles.scheduling.transfer_estimator import TransferEstimator
    from roles.scheduling.scheduler import Scheduler, SchedulerConfig
    from roles.scheduling.state import NodeReport

    est = DecodeEstimator(0.01, 0.001, 0.0)
    sched = Scheduler(SchedulerConfig(), PolynomialPrefillEstimator({"n": 1e-4}),
                      TransferEstimator(1e9), est)
    sched.add_decode_node("d0", page_budget=100, page_tokens=16)
    before = est.seconds(4, 0)
    for i in range(60):  # the node keeps measuring steps 3x slower than modelled
        sched.on_node_report("d0", NodeReport(at=float(i), batch_size=4, context_tokens=0,
                                              recent_tbt_s=3 * before), float(i))
    assert est.seconds(4, 0) == pytest.approx(3 * before, rel=0.01)
    est.observe(0, 0, 1.0)  # an idle node's report teaches nothing
    assert est.seconds(4, 0) == pytest.approx(3 * before, rel=0.01)


def test_a_window_of_one_prompt_shape_keeps_the_prior_for_the_others():
    """A node's measured prior (its start-up figures on this machine), then a
    run of requests that each add 6 tokens to a cached 1,536-token prefix,
    about 5 ms each: the window fixes one combination of the five
    coefficients.  Fitted without the prior, the least-norm answer put
    2.8e-5 s on n^2 and priced a cold 1,536-token prompt at 67 s (every
    long prompt was refused on an idle node)."""
    prior = {"c0": 2.1e-3, "n": 4.9e-5, "n2": 1.93e-8, "np": 3.86e-8}
    est = PolynomialPrefillEstimator(prior, refit_every=8, window=96, least_absolute=True)
    cold = est.seconds(1536, 0)                                   # 122.8 ms
    for i in range(200):
        est.observe(1542, 1536, 5.0e-3 + 1e-4 * (i % 3))
    assert est.fitted_since_fork()
    assert est.seconds(1542, 1536) == pytest.approx(5.1e-3, rel=0.05)   # what it saw
    assert est.seconds(1536, 0) == pytest.approx(cold, rel=0.1)         # what it did not
    assert est.seconds(4096, 0) == pytest.approx(
        PolynomialPrefillEstimator(prior).seconds(4096, 0), rel=0.1)


def test_prior_anchors_fix_every_coefficient_and_carry_the_weight_given():
    prior = {"c0": 1e-3, "n": 2e-5, "n2": 1e-8, "np": 3e-8, "p": 1e-7}
    anchors = prior_anchors(prior, 4096, 2.0)
    # n in {1, 256, 1024, 4096} after p in {0, 2048}: 8 points, 2/8 each.
    assert sorted({(n, p) for n, p, _, _ in anchors}) == [
        (n, p) for n in (1.0, 256.0, 1024.0, 4096.0) for p in (0.0, 2048.0)]
    assert all(w == 0.25 for *_, w in anchors)
    n, p, s, _ = anchors[-1]   # 4096 new after 2048 cached
    assert s == pytest.approx(1e-3 + 2e-5 * 4096 + 1e-8 * 4096 ** 2 + 3e-8 * 4096 * 2048
                              + 1e-7 * 2048)
    fit = fit_polynomial([], anchors=anchors)
    for k, v in prior.items():
        assert fit[k] == pytest.approx(v, rel=1e-6)
