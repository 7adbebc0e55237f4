"""Engines of one machine slow each other (roles/scheduling/contention.py),
worked out by hand: prefill priced at 1 ms per computed token, measured
prefills of 1x or 3x that."""

from __future__ import annotations

import math

import pytest

from roles.engines.fleet import EngineSpec
from roles.scheduling.config import SchedulerConfig
from roles.scheduling.contention import MachineContention
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.engines import EngineScheduler
from roles.scheduling.estimators import PolynomialPrefillEstimator


def filled(ratios: dict[int, float], n: int = 8, at: float = 0.0) -> MachineContention:
    model = MachineContention(half_life_s=10.0, min_samples=8)
    for level, ratio in ratios.items():
        for _ in range(n):
            model.add("m", level, measured_s=0.1 * ratio, predicted_s=0.1, now=at)
    return model


def test_the_slowdown_is_the_ratio_of_the_busy_median_to_the_alone_median():
    # Alone: measured 1.2x predicted; beside a busy engine: 3.6x.  3.6 / 1.2 = 3.
    model = filled({0: 1.2, 1: 3.6})
    assert model.slowdown("m", 1, now=0.0) == pytest.approx(3.0)
    assert model.slowdown("m", 0, now=0.0) == 1.0
    # Another machine, or a level never seen: no slowdown known.
    assert model.slowdown("other", 1, now=0.0) == 1.0
    assert model.slowdown("m", 2, now=0.0) == 1.0


def test_a_neighbour_never_makes_an_engine_faster():
    assert filled({0: 2.0, 1: 1.0}).slowdown("m", 1, now=0.0) == 1.0


def test_no_slowdown_until_both_windows_hold_enough_weight():
    assert filled({0: 1.0, 1: 3.0}, n=7).slowdown("m", 1, now=0.0) == 1.0
    model = filled({0: 1.0, 1: 3.0}, n=8)
    assert model.slowdown("m", 1, now=0.0) == pytest.approx(3.0)
    # One half-life later the 8 samples weigh 4: not trusted any more.
    assert model.slowdown("m", 1, now=10.0) == 1.0
    # 8 fresh samples at each level: each window holds 8 at weight 0.5 and 8
    # at 1, so the weighted median is the fresh ratio, 2.0 over 1.0.
    for _ in range(8):
        model.add("m", 0, 0.1, 0.1, now=10.0)
        model.add("m", 1, 0.2, 0.1, now=10.0)
    assert model.slowdown("m", 1, now=10.0) == pytest.approx(2.0)


def test_samples_that_say_nothing_are_dropped():
    model = MachineContention(half_life_s=10.0, min_samples=1)
    model.add("m", 0, 0.0, 0.1, now=0.0)
    model.add("m", 0, 0.1, 0.0, now=0.0)
    model.add("m", 0, math.inf, 0.1, now=0.0)
    assert model.stats(0.0) == {}


def test_loopback_engines_are_one_machine():
    assert EngineSpec.parse("http://127.0.0.1:8001").machine == "localhost"
    assert EngineSpec.parse("http://localhost:8002").machine == "localhost"
    assert EngineSpec.parse("http://[::1]:8003").machine == "localhost"
    assert EngineSpec.parse("http://gpu-7:8000").machine == "gpu-7"


def make(machine: str | None) -> EngineScheduler:
    config = SchedulerConfig(ttft_slo_s=10.0, tbt_slo_s=0.1, residual_half_life_s=1e9)
    sched = EngineScheduler(config, PolynomialPrefillEstimator({"n": 1e-3}),
                            DecodeEstimator(0.01, 0.002, 0.0))
    for name in ("a", "b"):
        sched.add_engine(name, machine)
    return sched


def learn(sched: EngineScheduler) -> float:
    """Ten 100-token prefills on ``a`` with ``b`` idle, measured as
    predicted (0.1 s), and ten with ``b`` busy, measured 3x (0.3 s): more
    than the 8 samples' weight a window needs, since they age a little."""
    now = 0.0
    for busy in (False, True):
        if busy:
            assert sched.schedule("hold", 100, {}, now, among={"b"}).engine == "b"
        for i in range(10):
            rid = f"{busy}-{i}"
            sched.schedule(rid, 100, {}, now, among={"a"})
            took = 0.3 if busy else 0.1
            sched.on_first_token("a", rid, now + took)
            sched.on_finished("a", rid, now + took + 0.01)
            now += 1.0
    sched.on_finished("b", "hold", now)
    return now


def test_an_engine_beside_a_busy_neighbour_is_priced_by_the_slowdown_it_learned():
    sched = make("m")
    now = learn(sched)
    assert sched.contention.slowdown("m", 1, now) == pytest.approx(3.0)
    # The prefill model learns the speed of an engine computing alone: a
    # 0.3 s sample beside busy `b` went in as 0.1 s once the slowdown was known.
    alone = [s for _, _, s in sched.engines["a"].prefill_est.samples]
    assert alone[:10] == pytest.approx([0.1] * 10)
    assert alone[10] == pytest.approx(0.3) and alone[-1] == pytest.approx(0.1)
    # ... and a request sent to `a` while `b` decodes is priced at 3x.
    sched.schedule("dec", 50, {}, now, among={"b"})
    sched.on_first_token("b", "dec", now + 0.05)
    d = sched.schedule("x", 100, {}, now + 0.1, among={"a"})
    assert (d.busy_level, d.slowdown) == (1, pytest.approx(3.0))
    assert d.t_prefill == pytest.approx(0.3)


def test_work_goes_where_it_does_not_slow_the_machine():
    # `a` decodes a request; `b` is idle.  A new 100-token prompt neither
    # holds: on `a`, 0.1 s (`b` stays idle); on `b`, 0.3 s beside busy `a`.
    sched = make("m")
    now = learn(sched)
    sched.schedule("dec", 50, {}, now, among={"a"})
    sched.on_first_token("a", "dec", now + 0.05)
    d = sched.schedule("new", 100, {}, now + 0.1)
    assert d.engine == "a" and d.slowdown == 1.0
    priced = {name: ttft for name, _, ttft, _ in d.candidates}
    assert priced["b"] - priced["a"] == pytest.approx(0.2)


def test_engines_on_machines_of_their_own_do_not_learn_a_slowdown():
    # The same history with `a` and `b` on separate machines: `b` being busy
    # is no neighbour of `a`'s, and the idle engine takes the new prompt.
    sched = make(None)
    now = learn(sched)
    assert sched.contention.slowdown("a", 1, now) == 1.0
    sched.schedule("dec", 50, {}, now, among={"a"})
    sched.on_first_token("a", "dec", now + 0.05)
    assert sched.schedule("new", 100, {}, now + 0.1).engine == "b"


def test_an_idle_engine_is_charged_for_slowing_its_busy_neighbour():
    # `a` has 0.4 s of prefill booked; `b` is idle.  A 100-token prompt `a`
    # holds 50 tokens of: on `a`, 0.4 + 0.05 s; on `b`, 0.1 s at the 3x
    # slowdown beside busy `a` = 0.3 s, the sooner first token.  But `b`
    # busy for those 0.3 s (no output expected: nothing finished has
    # generated any) slows `a`'s booked work 3x while it runs: `a` finishes
    # 0.3 * (1 - 1/3) = 0.2 s later (less than 0.4 * (3 - 1)).  b's cost
    # 0.5 s against a's 0.45: the request stays on `a`.
    sched = make("m")
    now = learn(sched)
    assert sched.typical_output() == 0
    sched.schedule("queued", 400, {}, now, among={"a"})
    d = sched.schedule("new", 100, {"a": 50}, now)
    costs = {name: cost for name, _, _, cost in d.candidates}
    assert d.engine == "a" and d.contention_s == 0.0
    assert costs == pytest.approx({"a": 0.45, "b": 0.5})
    # Once `a` is idle, sending work to `b` slows nobody.
    sched.on_failed("a", "new", now)
    sched.on_first_token("a", "queued", now)
    sched.on_finished("a", "queued", now)
    d = sched.schedule("alone", 100, {}, now, among={"b"})
    assert d.contention_s == 0.0 and d.slowdown == 1.0
