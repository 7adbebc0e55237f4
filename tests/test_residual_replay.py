"""benchmarks/residual_replay.py: the residual model replayed on a run's
request trace, checked on hand-made traces whose errors are worked out by
hand."""

from __future__ import annotations

import json
import math
import sys

import pytest

from paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import residual_replay  # noqa: E402
from residual_replay import VARIANTS, replay  # noqa: E402


def trace(n: int, model_s: float = 0.5, measured_s: float = 0.75, **extra) -> list[dict]:
    """``n`` requests on one node, one a second, each measured ``measured_s``
    against a cost model of ``model_s``: each one's sample joins the windows
    before the next decision."""
    return [{"status": "ok", "prefill_node": "n0", "load_level": 0, "priced_by_prior": False,
             "scheduled_at_s": 100.0 + i, "predicted_model_ttft_s": model_s,
             "predicted_ttft_s": model_s, "ttft_s": measured_s, **extra} for i in range(n)]


def test_the_model_is_trusted_after_min_samples_and_then_predicts_the_residual():
    # Samples never age here.  Decisions 0-7 read fewer than 8 samples: the cost model alone, 0.25 s
    # short each; from the 9th on the median residual is 0.25: no error.
    res = replay(trace(12), half_life_s=math.inf)
    assert res.requests == 12
    assert res.mae_s == pytest.approx(8 * 0.25 / 12)
    assert res.median_error_s == pytest.approx(0.25)
    assert res.covered == pytest.approx(4 / 12)   # model + 0.9-quantile residual from the 9th on
    assert res.ttft_p50_s == 0.75


def test_samples_priced_by_the_prior_are_not_learned():
    res = replay(trace(12, priced_by_prior=True), half_life_s=math.inf)
    assert res.mae_s == pytest.approx(0.25) and res.covered == 0.0


def test_aged_samples_stop_counting():
    # A half-life of 1 s: a window of one-a-second samples never weighs 8
    # (sum of 0.5 ** k < 2), so the cost model alone prices every request.
    res = replay(trace(30), half_life_s=1.0)
    assert res.mae_s == pytest.approx(0.25)


def test_the_log_ratio_variant_learns_a_factor():
    (log_ratio,) = [v for v in VARIANTS if v.name == "log-ratio"]
    res = replay(trace(12), log_ratio, half_life_s=math.inf)
    assert res.mae_s == pytest.approx(8 * 0.25 / 12)
    assert log_ratio.predict(0.5, math.log(1.5)) == pytest.approx(0.75)


def test_a_trace_without_the_residual_models_record_is_refused():
    old = [{k: v for k, v in r.items() if k != "scheduled_at_s"} for r in trace(3)]
    with pytest.raises(ValueError, match="residual model's record"):
        replay(old)


def test_the_command_prints_every_variant(tmp_path, capsys):
    path = tmp_path / "conductor_requests.json"
    path.write_text(json.dumps(trace(12)))
    residual_replay.main([str(path)])
    out = capsys.readouterr().out
    assert "12 requests" in out
    for variant in VARIANTS:
        assert variant.name in out
