"""benchmarks/rate_sweep.py's report: ITL both ways, and rebuilding a sweep's
tables from the summaries it wrote."""
from __future__ import annotations

import json
import sys

import pytest

from mooncaked.benchserve.replay import RequestResult
from mooncaked.benchserve.report import Slo, summarize
from paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import rate_sweep  # noqa: E402

SLO = Slo(1.0, 150.0)


def _request(i: int, token_times: list[float]) -> RequestResult:
    return RequestResult(index=i, trace_index=i, scheduled_s=i * 0.5, prompt_tokens=10,
                         max_tokens=len(token_times), status="ok", http_status=200,
                         sent_s=i * 0.5, ttft_s=token_times[0], e2e_s=token_times[-1],
                         token_times_s=token_times, completion_tokens=len(token_times))


def _steady(i: int) -> RequestResult:      # 16 tokens, 10 ms apart
    return _request(i, [0.1 + 0.01 * k for k in range(16)])


def _burst(i: int) -> RequestResult:       # a first token, a 300 ms stall, then 15 at once
    return _request(i, [0.1] + [0.4 + 1e-5 * k for k in range(15)])


def test_itl_per_request_is_what_aiperf_reports_and_a_burst_does_not_hide_a_stall():
    steady = rate_sweep.headline(1.0, "steady", summarize([_steady(i) for i in range(10)], SLO))
    burst = rate_sweep.headline(1.0, "burst", summarize([_burst(i) for i in range(10)], SLO))
    assert steady["itl_p90_ms"] == pytest.approx(10.0)
    assert steady["itl_req_p90_ms"] == pytest.approx(10.0)
    # Token intervals: 14 of 15 are 0.01 ms, so the burst "wins" there ...
    assert burst["itl_p90_ms"] == pytest.approx(0.01, abs=1e-3)
    # ... while per request ((e2e - TTFT) / 15) it is 20 ms, as aiperf says.
    assert burst["itl_req_p90_ms"] == pytest.approx((0.4 + 14e-5 - 0.1) / 15 * 1e3)
    table = rate_sweep.markdown([steady, burst])
    assert "ITL p50 / p90 ms (per request, aiperf's)" in table
    assert "| 10.0 / 10.0 | 10.0 / 10.0 |" in table


def test_report_only_rebuilds_the_rows_a_sweep_wrote(tmp_path):
    for rate, name, make in ((1, "a", _steady), (1, "b", _burst), (2, "a", _steady)):
        run = tmp_path / f"rate_{rate}" / name
        run.mkdir(parents=True)
        summary = summarize([make(i) for i in range(4)], SLO)
        (run / "summary.json").write_text(json.dumps({"meta": {}, "summary": summary}))
    rows = rate_sweep.rows_from(tmp_path)
    assert [(r["rate_x"], r["server"]) for r in rows] == [(1.0, "a"), (1.0, "b"), (2.0, "a")]
    assert rows[1]["itl_req_p90_ms"] > 10 * rows[1]["itl_p90_ms"]
    assert rate_sweep.rows_from(tmp_path / "nothing") == []


def test_a_run_whose_client_fell_behind_its_schedule_is_flagged(tmp_path, monkeypatch):
    on_time = [_steady(i) for i in range(10)]
    late = [_steady(i) for i in range(10)]
    for i, r in enumerate(late):      # the client sent every request 0.1 s more behind
        r.send_lag_s = 0.1 * i
    rows = [rate_sweep.headline(4.0, "kept", summarize(on_time, SLO)),
            rate_sweep.headline(4.0, "starved", summarize(late, SLO))]
    assert rows[0]["send_lag_p90_ms"] == 0.0
    assert rows[1]["send_lag_p90_ms"] > rate_sweep.SEND_LAG_WARN_MS
    assert "| client send lag p90 ms |" in rate_sweep.markdown(rows)
    (warning,) = rate_sweep.client_lag_warnings(rows)
    assert "at 4x the client sent to starved late" in warning
    monkeypatch.setattr(rate_sweep, "plot", lambda *args: None)   # no PNG needed here
    rate_sweep.write_sweep(tmp_path, rows, SLO, [])
    assert warning in (tmp_path / "sweep.md").read_text()


def test_a_summary_from_before_stop_30_is_reported_with_goodput_per_offered_load():
    """Summaries written before goodput was per second of offered load hold
    the run-time figure under goodput_rps: the sweep derives the new one
    from the offered rate and the effective share they also hold."""
    summary = summarize([_steady(i) for i in range(4)], SLO)   # sent every 0.5 s, all in SLO
    assert rate_sweep.headline(1.0, "a", summary)["goodput_rps"] == pytest.approx(2.0)
    old = {k: v for k, v in summary.items() if k != "goodput_run_rps"}
    old["goodput_rps"] = summary["goodput_run_rps"]             # 4 / (1.5 + 0.25) s
    assert old["goodput_rps"] == pytest.approx(4 / 1.75)
    assert rate_sweep.headline(1.0, "a", old)["goodput_rps"] == pytest.approx(2.0)
