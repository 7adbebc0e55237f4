"""Predicted-vs-actual export of the conductor's metrics (roles/conductor/metrics.py)."""
import pytest
from prometheus_client import CollectorRegistry

from roles.conductor.dispatch import RequestTrace
from roles.conductor.metrics import ConductorMetrics


def test_predicted_and_actual_ttft_and_tbt_go_to_their_histograms():
    reg = CollectorRegistry()
    m = ConductorMetrics(reg)
    t = RequestTrace("r", prompt_tokens=10, predicted_ttft_s=0.3, predicted_tbt_s=0.02)
    t.ttft_s = 0.5
    m.first_token(t)
    t.token_times = [0.5, 0.53, 0.56, 0.59]     # 3 decoded-token intervals of 30 ms
    t.tbt_s, t.status = 0.03, "ok"
    m.finished(t)

    def total(name):
        return reg.get_sample_value(name + "_sum"), reg.get_sample_value(name + "_count")

    assert total("mooncaked:predicted_time_to_first_token_seconds") == (pytest.approx(0.3), 1)
    assert total("mooncaked:ttft_prediction_abs_error_seconds") == (pytest.approx(0.2), 1)
    assert total("mooncaked:predicted_time_per_output_token_seconds") == (pytest.approx(0.02), 1)
    assert total("mooncaked:request_time_per_output_token_seconds") == (pytest.approx(0.03), 1)
    assert total("mooncaked:tbt_prediction_abs_error_seconds") == (pytest.approx(0.01), 1)
    # The summary served by /admin/requests carries both sides.
    row = t.summary()
    assert (row["predicted_ttft_s"], row["ttft_s"], row["predicted_tbt_s"], row["tbt_s"]) \
        == (0.3, 0.5, 0.02, 0.03)


def test_a_request_without_decoded_tokens_records_no_tbt():
    reg = CollectorRegistry()
    m = ConductorMetrics(reg)
    t = RequestTrace("r", prompt_tokens=10, predicted_ttft_s=0.3, predicted_tbt_s=0.02)
    t.token_times, t.status = [0.5], "ok"
    m.finished(t)
    assert reg.get_sample_value("mooncaked:predicted_time_per_output_token_seconds_count") == 0
