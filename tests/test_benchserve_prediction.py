"""What `bench serve` reports about early rejection and prediction error (report.py)."""
import pytest

from mooncaked.benchserve.replay import RequestResult
from mooncaked.benchserve.report import Slo, summarize


def ok(i, ttft, predicted, server_ttft, pred_tbt=0.02, tbt=0.03):
    r = RequestResult(i, i, 0.0, 10, 4, status="ok", sent_s=float(i), ttft_s=ttft, e2e_s=ttft + 0.1,
                      token_times_s=[ttft, ttft + 0.03, ttft + 0.06], completion_tokens=3)
    r.server = {"predicted_ttft_s": predicted, "ttft_s": server_ttft,
                "predicted_tbt_s": pred_tbt, "tbt_s": tbt}
    return r


def test_prediction_error_and_rejections_are_summarized():
    results = [ok(0, 0.2, 0.3, 0.2), ok(1, 0.4, 0.1, 0.4), ok(2, 2.0, 1.0, 2.0)]
    rej = RequestResult(3, 3, 0.0, 10, 4, status="rejected", sent_s=3.0, reject_s=0.004,
                        retry_after="2")
    s = summarize(results + [rej], Slo(ttft_s=1.0, tbt_ms=150))
    assert s["accepted"] == 3 and s["rejected"] == 1 and s["rejected_with_retry_after"] == 1
    # Both SLOs: requests 0 and 1 (request 2's TTFT is 2 s).
    assert s["accepted_in_slo"] == pytest.approx(2 / 3)
    assert s["reject_s"]["max"] == pytest.approx(0.004)
    p = s["prediction"]
    # |0.3-0.2| + |0.1-0.4| + |1.0-2.0| = 1.4 over 3; TTFT p50 (client) 0.4 s.
    assert p["n"] == 3 and p["ttft_mean_abs_error_s"] == pytest.approx(1.4 / 3)
    assert p["ttft_mean_error_s"] == pytest.approx((0.1 - 0.3 - 1.0) / 3)
    assert p["ttft_mean_abs_error_of_p50"] == pytest.approx(1.4 / 3 / s["ttft_s"]["p50"])
    assert p["tbt_mean_abs_error_s"] == pytest.approx(0.01)


def test_a_server_without_traces_reports_no_prediction_error():
    r = ok(0, 0.2, 0.3, 0.2)
    r.server = {}
    assert summarize([r], Slo())["prediction"] == {"n": 0}


def test_the_error_against_the_clients_ttft_is_reported_beside_the_servers():
    # The client saw each first token 5 ms after the server did.
    results = [ok(0, 0.205, 0.2, 0.2), ok(1, 0.405, 0.41, 0.4), ok(2, 0.105, 0.09, 0.1)]
    p = summarize(results, Slo())["prediction"]
    assert p["ttft_mean_abs_error_s"] == pytest.approx((0.0 + 0.01 + 0.01) / 3)
    # |0.2-0.205| + |0.41-0.405| + |0.09-0.105| = 0.025 over 3; client p50 0.205 s.
    assert p["client_ttft_mean_abs_error_s"] == pytest.approx(0.025 / 3)
    assert p["client_ttft_mean_abs_error_of_p50"] == pytest.approx(0.025 / 3 / 0.205)


def _served(i: int, sent_s: float, ttft_s: float, e2e_s: float) -> RequestResult:
    return RequestResult(i, i, sent_s, prompt_tokens=8, max_tokens=2, status="ok",
                         http_status=200, sent_s=sent_s, ttft_s=ttft_s, e2e_s=e2e_s,
                         token_times_s=[ttft_s, e2e_s], completion_tokens=2)


def test_goodput_counts_effective_requests_per_second_of_offered_load():
    """Two servers that serve the same five requests, sent once a second,
    all within both SLOs, have the same goodput whatever the latency of
    their last request; a request outside the SLO takes its share off."""
    slo = Slo(ttft_s=1.0, tbt_ms=1000.0)
    quick = [_served(i, float(i), 0.1, 0.2) for i in range(5)]
    slow_last = quick[:4] + [_served(4, 4.0, 0.9, 1.8)]
    for results in (quick, slow_last):
        summary = summarize(results, slo)
        assert summary["offered_rate_rps"] == pytest.approx(1.0)     # 4 gaps in 4 s
        assert summary["goodput_rps"] == pytest.approx(1.0)
    # The run-time figure (goodput_run_rps) differs by the last request's end.
    assert summarize(quick, slo)["goodput_run_rps"] == pytest.approx(5 / 4.2)
    assert summarize(slow_last, slo)["goodput_run_rps"] == pytest.approx(5 / 5.8)
    late = quick[:4] + [_served(4, 4.0, 1.5, 1.6)]                     # TTFT over the SLO
    assert summarize(late, slo)["goodput_rps"] == pytest.approx(1.0 * 4 / 5)
    assert summarize(quick[:1], slo)["goodput_rps"] == pytest.approx(1 / 0.2)   # no span
