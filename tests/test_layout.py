"""`up --layout`: the layout chooser's decisions from hand-made measurements,
the cache of measurements, and how `up` applies the choice."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import typer
from typer.testing import CliRunner

from model.precision import native_dtype
from mooncaked import launcher, layout_measure
from mooncaked.layout import (COLOCATED, DISAGGREGATED, Layout, Measurements, RequestMix, Slo,
                              candidates, choose, p90_ttft_capacity, score)
from mooncaked.placement import DECODE, PREFILL, default_prefill_nodes, place

TWO = [0, 1]
SLO = Slo(ttft_s=1.0, tbt_s=0.1)


def flat_decode(step_s: float) -> tuple[tuple[int, float], ...]:
    return ((1, step_s), (8, step_s))


def test_an_md1_queue_meets_its_p90_ttft_up_to_a_computed_rate():
    # S = 0.1 s, SLO 1 s: q = 0.9 / (ln 10 * 0.1) = 3.9087, rho = 2q / (1 + 2q) = 0.88659.
    assert p90_ttft_capacity(0.1, 1.0) == pytest.approx(8.8659, rel=1e-4)
    # At that rate the p90 TTFT, S + ln(10) rho S / (2 (1 - rho)), is the SLO.
    rho = 8.8659 * 0.1
    assert 0.1 + math.log(10) * rho * 0.1 / (2 * (1 - rho)) == pytest.approx(1.0, rel=1e-3)
    assert p90_ttft_capacity(1.5, 1.0) == 0.0  # one prefill alone misses it


def test_measurements_fit_a_line_and_amdahl():
    m = Measurements(prefill=((1, 128, 0.05), (1, 512, 0.17), (2, 512, 0.10)),
                     decode=((1, 0.004), (8, 0.011)))
    a, b = m.prefill_line
    assert (a, b) == (pytest.approx(0.01), pytest.approx(0.12 / 384))
    # speedup 1.7 at 2 threads: f = (1 - 1/1.7) / (1 - 1/2) = 0.8235
    assert m.parallel_fraction == pytest.approx(0.8235, rel=1e-3)
    assert m.prefill_s(512, 2) == pytest.approx(0.10)
    assert m.prefill_s(512, 4) == pytest.approx(0.17 * (1 - 0.8235 + 0.8235 / 4), rel=1e-3)
    assert m.decode_line == (pytest.approx(0.003), pytest.approx(0.001))
    assert Measurements.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_fast_decode_and_a_prefill_that_scales_choose_colocated():
    """Decode far under the TBT SLO, prefill twice as fast on two threads:
    one colocated node gives prefill both cores, and its 50 ms chunk between
    decode steps keeps tokens well within 100 ms."""
    m = Measurements(prefill=((1, 128, 0.025), (1, 512, 0.1), (2, 512, 0.05)),
                     decode=flat_decode(1e-5))
    mix = RequestMix(prompt_tokens=1024, cached_fraction=0.5, output_tokens=16)
    choice = choose(TWO, m, mix, SLO)
    assert choice.best.layout == Layout(COLOCATED, 1)
    # Colocated x1, S = 0.05 s (decode steps add ~1e-5 s): its M/D/1 p90 capacity.
    assert choice.best.rate == pytest.approx(p90_ttft_capacity(0.05, 1.0), rel=2e-3)
    assert choice.best.rate == pytest.approx(18.857, rel=2e-3)
    # Disaggregated: 1 prefill core, S = 0.1 s: 8.866/s, the borrower at most doubles it.
    by_name = {s.layout.name(): s.rate for s in choice.scores}
    assert by_name["disaggregated 1P+1D (decode on 1 CPU)"] == pytest.approx(8.8659, rel=1e-3)
    assert by_name["disaggregated 1P+1D (decode on 1 CPU) + borrowing prefill"] < 2 * 8.8659
    assert "cores kept for decode alone (disaggregated 1P+1D" in choice.reason()
    assert "0% of the 100 ms TBT SLO" in choice.reason()
    text = choice.describe()
    assert "layout auto: colocated x1" in text and "18.8" in text


def test_tiny_decode_and_a_long_chunk_choose_disaggregated_with_a_borrower():
    """Decode 2 ms a step, short outputs: the decode core is idle most of the
    time, so a borrower nearly doubles prefill; a colocated node's 200 ms
    chunk between decode steps would break 100 ms TBT above rho = 0.49."""
    m = Measurements(prefill=((1, 128, 0.05), (1, 512, 0.2), (2, 512, 0.2)),
                     decode=flat_decode(0.002))
    mix = RequestMix(1024, 0.5, 16)
    choice = choose(TWO, m, mix, SLO)
    assert choice.best.layout == Layout(DISAGGREGATED, 1, 1, 1, borrow=True)
    by_name = {s.layout.name(): s for s in choice.scores}
    plain = by_name["disaggregated 1P+1D (decode on 1 CPU)"]
    # One prefill core, S = 0.2: q = 0.8 / (ln 10 * 0.2) = 1.7372, rho = 0.77651.
    assert plain.rate == pytest.approx(3.8825, rel=1e-3)
    # The borrower: regular capacity + that of a 1-thread prefill slowed by
    # decode's busy share 1 - exp(-B), B = rate * 16 * 0.002.
    rate = choice.best.rate
    borrowed = 0.2 / math.exp(-rate * 16 * 0.002)
    assert rate == pytest.approx(3.8825 + p90_ttft_capacity(borrowed, 1.0), rel=1e-3)
    # Colocated x2: each node at rate/2, TBT = 2 ms + rho * 200 ms binds at rho ~ 0.49.
    coloc2 = by_name["colocated x2"]
    assert coloc2.limit.binds == "tbt"
    assert coloc2.rate == pytest.approx(2 * 0.49 / 0.2, rel=0.01)
    assert plain.rate < coloc2.rate < rate


def test_decode_near_the_tbt_slo_chooses_disaggregated_without_a_borrower():
    """A 60-90 ms decode step: interleaving a 200 ms prefill chunk pushes
    tokens past 100 ms; disaggregated is bound by decode alone at
    rate = (tbt - d0) / (d1 * tbt * outputs).  The borrower adds nothing
    (decode never idles) and ties lose to fewer processes."""
    m = Measurements(prefill=((1, 128, 0.1), (1, 512, 0.4), (2, 512, 0.2)),
                     decode=((1, 0.06), (8, 0.09)))
    mix = RequestMix(1024, 0.5, 128)
    choice = choose(TWO, m, mix, SLO)
    assert choice.best.layout == Layout(DISAGGREGATED, 1, 1, 1, borrow=False)
    d1 = 0.03 / 7
    d0 = 0.06 - d1
    assert choice.best.rate == pytest.approx((0.1 - d0) / (d1 * 0.1 * 128), rel=1e-3)  # 0.807
    assert choice.best.limit.binds == "tbt"
    by_name = {s.layout.name(): s for s in choice.scores}
    # Colocated x1 (2 threads, chunk C = 0.2 s): at TBT = 0.1 the batch is
    # 12.8 rate, a step D = d0 + a rate (a = 12.8 d1), a prefill waits for a
    # step (S = 0.2 + D) and TBT = D + C rho = D + 0.2 rate (0.2 + D) = 0.1:
    # 0.2 a rate^2 + (a + 0.04 + 0.2 d0) rate + d0 - 0.1 = 0.
    a = 12.8 * d1
    qa, qb, qc = 0.2 * a, a + 0.04 + 0.2 * d0, d0 - 0.1
    expected = (-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa)  # 0.40
    assert by_name["colocated x1"].rate == pytest.approx(expected, rel=0.01)
    assert "push the token spacing past the TBT SLO" in choice.reason()


def test_candidates_and_their_placements():
    assert [c.name() for c in candidates(1)] == ["colocated x1"]
    two = candidates(2)
    assert {c.name() for c in two} == {
        "colocated x1", "colocated x2", "disaggregated 1P+1D (decode on 1 CPU)",
        "disaggregated 1P+1D (decode on 1 CPU) + borrowing prefill"}
    # Every disaggregated candidate gives each prefill node a core of its own.
    for c in candidates(8):
        p = c.placement(range(8))
        if c.kind == DISAGGREGATED:
            assert p.split and len(p.cpus_of(DECODE)) == c.decode_cpus
            assert len(p.cpus_of(PREFILL)) >= c.nodes
            assert len(p.borrowers) == int(c.borrow)
    m = Measurements(prefill=((1, 512, 0.1),), decode=flat_decode(0.001))
    s = score(Layout(COLOCATED, 2), TWO, m, RequestMix(), SLO)
    assert s.placement.of(PREFILL, 1).threads == 1 and s.rate > 0


# --- the cache of measurements -------------------------------------------------

M = Measurements(prefill=((1, 128, 0.03), (1, 512, 0.12), (2, 512, 0.07)),
                 decode=((1, 0.004), (8, 0.01)))


def test_measurements_are_cached_per_model_cpu_and_mix(tmp_path):
    mix = RequestMix()
    key = layout_measure.cache_key("dummy", 2, mix, 1024, "2.x")
    assert key["cpu"] == layout_measure.cpu_model()
    assert layout_measure.load_cached(key, tmp_path) is None
    path = layout_measure.save_cached(key, M, tmp_path)
    assert path.parent == tmp_path and layout_measure.load_cached(key, tmp_path) == M
    for other in (layout_measure.cache_key("tiny", 2, mix, 1024, "2.x"),
                  layout_measure.cache_key("dummy", 4, mix, 1024, "2.x"),
                  layout_measure.cache_key("dummy", 2, RequestMix(prompt_tokens=2048), 1024,
                                           "2.x")):
        assert layout_measure.cache_path(other, tmp_path) != path
        assert layout_measure.load_cached(other, tmp_path) is None
    path.write_text("not json")
    assert layout_measure.load_cached(key, tmp_path) is None


def test_a_checkpoint_is_keyed_by_its_path_and_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    first = layout_measure.model_identity(str(tmp_path))
    assert first.startswith(str(tmp_path.resolve()))
    os.utime(tmp_path / "config.json", ns=(1, 1))
    assert layout_measure.model_identity(str(tmp_path)) != first


def test_cached_or_measure_measures_once(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(M.to_dict()), "")

    monkeypatch.setattr(layout_measure.subprocess, "run", fake_run)
    m, source = layout_measure.cached_or_measure("dummy", 2, RequestMix(), base=tmp_path)
    assert m == M and "measured" in source and len(calls) == 1
    assert calls[0][1:3] == ["-m", "mooncaked.layout_measure"] and "--threads" in calls[0]
    m, source = layout_measure.cached_or_measure("dummy", 2, RequestMix(), base=tmp_path)
    assert m == M and source.startswith("cached in") and len(calls) == 1

    monkeypatch.setattr(layout_measure.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "boom\n"))
    with pytest.raises(RuntimeError, match="boom"):
        layout_measure.cached_or_measure("tiny", 2, RequestMix(), base=tmp_path)


@pytest.mark.slow  # torch, the tiny model, ~1 s
def test_measure_times_the_real_model():
    m = layout_measure.measure("tiny", 2, RequestMix(prompt_tokens=64, output_tokens=4),
                               prefill_chunk=32, repeats=1)
    assert {k for k, _, _ in m.prefill} == {1, 2}
    assert [b for b, _ in m.decode] == list(layout_measure.DECODE_BATCHES)
    assert m.prefill_s(32, 1) > 0 and m.decode_s(1) > 0


# --- `up --layout` --------------------------------------------------------------

def _up(monkeypatch, tmp_path, *args: str, measured: Measurements | None = M):
    """`up ARGS` up to the start of the cluster: (result, the cluster)."""
    seen: dict = {}

    class Recorder(launcher.LocalCluster):
        def start(self, timeout_s: float = 120.0) -> None:
            seen["cluster"] = self
            raise RuntimeError("stop here")

    def fake_measure(model, ncpus, mix, prefill_chunk=1024, base=None, timeout_s=0,
                     dtype="float32"):
        if measured is None:
            raise AssertionError("measured although the layout was given")
        seen["measured_model"] = model
        seen["measured_dtype"] = dtype
        return measured, "hand-made"

    app = typer.Typer(rich_markup_mode=None)
    app.callback()(lambda: None)
    monkeypatch.setattr(launcher, "LocalCluster", Recorder)
    monkeypatch.setattr(launcher, "available_bytes", lambda: 8 << 30)
    monkeypatch.setattr(layout_measure, "cached_or_measure", fake_measure)
    launcher.register(app)
    result = CliRunner().invoke(app, ["up", "--log-dir", str(tmp_path), *args])
    return result, seen.get("cluster"), seen


def test_layout_disaggregated_keeps_the_default_of_before(monkeypatch, tmp_path):
    result, cluster, _ = _up(monkeypatch, tmp_path, "--layout", "disaggregated", measured=None)
    assert result.exit_code == 1, result.output
    cpus = sorted(os.sched_getaffinity(0))
    prefill = default_prefill_nodes(cpus, decode=1)
    assert (cluster.prefill, cluster.decode) == (prefill, 1)
    assert cluster.role_of_workers == ("prefill", "decode")
    assert cluster.placement == place(cpus, prefill, 1, borrow=True)


def test_layout_auto_runs_the_measured_choice(monkeypatch, tmp_path):
    colocated_wins = Measurements(prefill=((1, 512, 0.1), (2, 512, 0.05)),
                                  decode=flat_decode(1e-5))
    result, cluster, seen = _up(monkeypatch, tmp_path, "--set", "model.prefill_chunk=512",
                                measured=colocated_wins)
    assert seen["measured_model"] == "dummy"
    # Measured in the dtype the nodes will compute in ("auto" resolved here).
    assert seen["measured_dtype"] == native_dtype("cpu")
    expected = choose(sorted(os.sched_getaffinity(0)), colocated_wins, RequestMix(), SLO)
    assert f"layout auto: {expected.best.layout.name()}" in result.output
    if expected.best.layout.kind == COLOCATED:
        assert cluster.role_of_workers[0] == "colocated"
        assert (cluster.prefill, cluster.decode) == (expected.best.layout.nodes, 0)
    # The SLOs given to the nodes are the chooser's.
    result, cluster, _ = _up(monkeypatch, tmp_path, "--tbt-slo-ms", "5", measured=M)
    assert "mean TBT <= 5 ms" in result.output


def test_layout_auto_on_two_cores_with_a_decode_near_the_slo(monkeypatch, tmp_path):
    if len(os.sched_getaffinity(0)) != 2:
        pytest.skip("the hand-made choice is for 2 CPUs")
    near = Measurements(prefill=((1, 128, 0.1), (1, 512, 0.4), (2, 512, 0.2)),
                        decode=((1, 0.06), (8, 0.09)))
    result, cluster, _ = _up(monkeypatch, tmp_path, measured=near)
    assert "layout auto: disaggregated 1P+1D" in result.output, result.output
    assert (cluster.prefill, cluster.decode) == (1, 1)
    assert cluster.placement == place([0, 1], 1, 1)  # no borrower: it would add nothing


def test_explicit_counts_are_the_users_layout(monkeypatch, tmp_path):
    result, cluster, _ = _up(monkeypatch, tmp_path, "--prefill", "1", "--decode", "1",
                             "--no-borrow", measured=None)
    assert "--prefill, --decode given" in result.output
    assert (cluster.prefill, cluster.decode) == (1, 1) and not cluster.placement.borrowers
    result, cluster, _ = _up(monkeypatch, tmp_path, "--colocated", "2", measured=None)
    assert cluster.role_of_workers[0] == "colocated" and cluster.prefill == 2
    result, cluster, _ = _up(monkeypatch, tmp_path, "--layout", "colocated", measured=None)
    assert cluster.role_of_workers[0] == "colocated" and cluster.prefill == 1


@pytest.mark.parametrize("args", [["--layout", "colocated", "--prefill", "1"],
                                  ["--layout", "disaggregated", "--colocated", "1"],
                                  ["--layout", "mixed"]])
def test_contradicting_layout_flags_are_refused(monkeypatch, tmp_path, args):
    result, cluster, _ = _up(monkeypatch, tmp_path, *args, measured=None)
    assert result.exit_code == 2 and cluster is None
    assert "--layout" in result.output


def test_every_module_of_the_forward_pass_is_in_the_measurements_key():
    """A kernel moved into a module of its own (the projections' row tiles,
    the prefill attention tiles) still invalidates cached speeds: every
    model module the runner imports is timed, or named as not."""
    import sys
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, "-c", "import sys, model.runner; print(' '.join(sorted("
         "m for m in sys.modules if m.startswith('model.'))))"],
        capture_output=True, text=True, check=True, cwd=Path(layout_measure.__file__).parents[1])
    imported = {"model/" + m.split(".", 1)[1] + ".py" for m in out.stdout.split()}
    assert imported <= set(layout_measure.TIMED_SOURCES) | set(layout_measure.UNTIMED_MODEL_SOURCES)
    assert not set(layout_measure.TIMED_SOURCES) & set(layout_measure.UNTIMED_MODEL_SOURCES)


def test_a_change_to_the_timed_model_code_measures_again(tmp_path):
    """The cache stands for the speed of the code it timed: a new decode or
    prefill kernel must not be scored with the old one's numbers."""
    root = tmp_path / "src"
    for rel in layout_measure.TIMED_SOURCES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    before = layout_measure.code_identity(root)
    assert layout_measure.code_identity(root) == before
    (root / layout_measure.TIMED_SOURCES[-1]).write_text("x = 2\n")
    assert layout_measure.code_identity(root) != before
    key = layout_measure.cache_key("dummy", 2, RequestMix(), 1024, "2.x")
    assert key["code"] == layout_measure.code_identity()
