"""The pure parts of benchmarks/engine_compare.py: counter deltas, the
prediction error from the conductor's running counters, rows, the bars and
the table, on hand-computed figures."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from engine_compare import (ROUTER_PROCS, answered_requests, artifacts, bars,  # noqa: E402
                            bars_markdown, engine_row, markdown, prefix_delta,
                            reuse_breakdown, session_cpu_s, ttft_error_delta,
                            write_results)


def test_prefix_delta_sums_both_engines_and_splits_the_lookups():
    before = [{"queries": 1000.0, "hits": 100.0}, {"queries": 0.0, "hits": 0.0}]
    after = [{"queries": 1600.0, "hits": 400.0}, {"queries": 200.0, "hits": 0.0}]
    d = prefix_delta(before, after)
    # (600 + 200) tokens looked up, (300 + 0) hit.
    assert d["prefix_queries"] == 800 and d["prefix_hits"] == 300
    assert d["prefix_hit_ratio"] == pytest.approx(0.375)
    assert d["engine_split"] == pytest.approx([0.75, 0.25])


def test_prefix_delta_without_lookups_has_no_ratio():
    same = [{"queries": 5.0, "hits": 1.0}]
    assert prefix_delta(same, same) == {"prefix_queries": 0, "prefix_hits": 0,
                                        "prefix_hit_ratio": None, "engine_split": None}
    with pytest.raises(ValueError):
        prefix_delta(same, same * 2)


def test_ttft_error_delta_keeps_only_the_requests_between_snapshots():
    # 4 warm-up requests: |err| sum 2.0, signed sum -1.0.
    before = {"count": 4, "mean_s": -0.25, "mean_abs_s": 0.5}
    # 10 in all: |err| sum 2.0 + 6 * 0.1 = 2.6, signed sum -1.0 + 0.3 = -0.7.
    after = {"count": 10, "mean_s": -0.07, "mean_abs_s": 0.26}
    d = ttft_error_delta(before, after, ttft_p50_s=0.4)
    assert d["prediction_n"] == 6
    assert d["ttft_mae_s"] == pytest.approx(0.1)
    assert d["ttft_bias_s"] == pytest.approx(0.05)
    assert d["ttft_mae_of_p50"] == pytest.approx(0.25)


def test_ttft_error_delta_without_a_conductor_or_new_requests():
    assert ttft_error_delta(None, None, 1.0)["ttft_mae_of_p50"] is None
    snap = {"count": 3, "mean_s": 0.0, "mean_abs_s": 0.1}
    assert ttft_error_delta(snap, snap, 1.0)["prediction_n"] == 0
    assert ttft_error_delta({"count": 0, "mean_s": 0.0, "mean_abs_s": 0.0}, snap,
                            None)["ttft_mae_of_p50"] is None


def summary(router: str, ok: int, rejected: int, good: int, goodput: float) -> dict:
    return {"server": router, "sent": 10, "ok": ok, "errors": 10 - ok,
            "rejected_429": rejected, "errors_by_code": {}, "good": good,
            "goodput_rps": goodput, "ttft_p50_ms": 400.0, "ttft_p90_ms": 900.0,
            "itl_p50_ms": 20.0, "itl_p90_ms": 40.0, "cached_prompt_pct": None,
            "duration_s": 5.0}


def row(router: str, hit: float, goodput: float, ok: int = 10, rejected: int = 0,
        good: int = 9, mae_of_p50: float | None = None) -> dict:
    prefix = {"prefix_queries": 100.0, "prefix_hits": 100.0 * hit, "prefix_hit_ratio": hit,
              "engine_split": [0.5, 0.5]}
    pred = {"prediction_n": 0 if mae_of_p50 is None else 5, "ttft_mae_s": None,
            "ttft_bias_s": None, "ttft_mae_of_p50": mae_of_p50}
    return engine_row("docs", 2.0, 4.0, 0.8, router, summary(router, ok, rejected, good, goodput),
                      prefix, pred)


def test_engine_row_counts_in_slo_over_accepted_requests():
    r = row("mooncaked", 0.7, 1.5, ok=8, rejected=2, good=7)
    # 10 sent, 2 answered 429: 7 good of 8 accepted.
    assert r["in_slo_of_accepted"] == pytest.approx(7 / 8)
    assert (r["router"], r["trace"], r["rate_x"], r["offered_rps"]) == \
        ("mooncaked", "docs", 2.0, 4.0)
    everything_rejected = row("mooncaked", 0.0, 0.0, ok=0, rejected=10, good=0)
    assert everything_rejected["in_slo_of_accepted"] is None


def test_bars_compare_mooncaked_with_both_peers():
    rows = [row("mooncaked", 0.70, 1.5, ok=8, rejected=2, good=7, mae_of_p50=0.2),
            row("sglang_cache_aware", 0.70, 1.6),
            row("round_robin", 0.40, 1.0)]
    (check,) = bars(rows)
    assert check == {"trace": "docs", "rate_x": 2.0, "hit_ge_cache_aware": True,
                     "hit_gt_round_robin": True, "goodput_ge_both": False,
                     "in_slo_ge_90": False, "prediction_le_25": True}
    # Equal hit ratios pass ">=" but not ">".
    rows[2] = row("round_robin", 0.70, 1.0)
    assert bars(rows)[0]["hit_gt_round_robin"] is False
    # A (trace, rate) missing a router is not judged.
    assert bars(rows[:2]) == []


def test_repeated_runs_are_judged_by_their_medians(tmp_path):
    """Three runs per router: the checks read the medians (a run where
    mooncaked hit less and served less than cache_aware does not decide
    them), the table names each run and adds median [min-max], and each
    run's artifacts have a folder of their own."""
    figures = {"mooncaked": [(0.70, 1.5), (0.60, 1.2), (0.72, 1.6)],
               "sglang_cache_aware": [(0.69, 1.4), (0.70, 1.5), (0.69, 1.45)],
               "round_robin": [(0.40, 1.0), (0.40, 1.1), (0.45, 1.0)]}
    rows = [row(router, hit, goodput, mae_of_p50=0.2) | {"run": run, "runs": 3}
            for run in (1, 2, 3) for router, runs in figures.items()
            for hit, goodput in [runs[run - 1]]]
    (check,) = bars(rows)
    assert (check["hit_ge_cache_aware"], check["goodput_ge_both"]) == (True, True)
    (second,) = bars([r for r in rows if r["run"] == 2])
    assert (second["hit_ge_cache_aware"], second["goodput_ge_both"]) == (False, False)
    table = write_results(tmp_path, rows, {})
    assert "| docs | 2x | mooncaked, run 2 |" in table
    assert "| docs | 2x | mooncaked | 3 | 0 | 70.0 [60.0-72.0] | 1.50 [1.20-1.60] |" in table
    assert "Checks, mooncaked against the other two (medians of 3 runs):" in table
    assert artifacts(tmp_path, "docs", 2.0, "mooncaked", 2, 3) == \
        tmp_path / "aiperf" / "docs" / "2x" / "mooncaked" / "run2"
    assert artifacts(tmp_path, "docs", 2.0, "mooncaked", 1, 1) == \
        tmp_path / "aiperf" / "docs" / "2x" / "mooncaked"


def test_tables_render_the_figures():
    rows = [row("mooncaked", 0.70, 1.5, ok=8, rejected=2, good=7, mae_of_p50=0.2)
            | {"router_cpu_ms_per_request": 3.25},
            row("sglang_cache_aware", 0.65, 1.6), row("round_robin", 0.40, 1.0)]
    table = markdown(rows).splitlines()
    assert len(table) == 2 + 3
    assert table[2] == ("| docs | 2x | mooncaked | 4.00 | 8/10 | 2 | 1.50 | 88% | 400 / 900 "
                        "| 20.0 / 40.0 | 70.0% | 50%/50% | 80.0% | - | - | 20% | 3.2 |")
    assert table[3].endswith("| - | - | - |")   # a row without the router's CPU
    checks = bars_markdown(bars(rows)).splitlines()
    assert checks[2] == "| docs | 2x | yes | yes | **no** | **no** | yes |"


def test_a_routers_cpu_is_its_whole_sessions():
    # A session leader with a child: both count, a process outside does not.
    child_loop = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               f"subprocess.run([sys.executable, '-c', {child_loop!r}])\n"
                               "time.sleep(30)"], start_new_session=True)
    ROUTER_PROCS["probe"] = {"proc": leader}
    try:
        assert session_cpu_s("nobody") is None
        deadline = time.monotonic() + 30
        while (used := session_cpu_s("probe")) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert used >= 0.3   # the child's, counted once it ended and was waited for
    finally:
        leader.kill()
        leader.wait()
        ROUTER_PROCS.pop("probe")


def test_reuse_breakdown_tells_ready_prefixes_from_in_flight_ones():
    # 32-token hash ids: 4 per 128-token engine block.
    a = list(range(8))                  # two whole blocks
    records = [{"input_length": 300, "hash_ids": a + [100, 101]},        # 2 whole blocks
               {"input_length": 300, "hash_ids": a + [200, 201]},        # shares 2 with #0
               {"input_length": 257, "hash_ids": a + [300]},             # shares 2 with #0, #1
               {"input_length": 129, "hash_ids": a[:4] + [400]},         # shares 1 with all
               {"input_length": 300, "hash_ids": a + [500, 501]}]        # never answered
    answered = {0: (0.0, 10.0, 0.0),
                1: (5.0, 20.0, 0.0),     # started while #0 prefilled: reusable, not ready
                2: (15.0, 30.0, 256.0),  # #0 done by 15: 2 blocks ready, hit
                3: (40.0, 50.0, 128.0)}  # everything done: 1 block ready, hit
    got = reuse_breakdown(records, 32, answered)
    total = 300 + 300 + 257 + 129
    assert got["reusable_ratio"] == pytest.approx((256 + 256 + 128) / total)
    assert got["ready_ratio"] == pytest.approx((256 + 128) / total)
    assert got["hit_of_ready"] == pytest.approx(1.0)
    # The prompt's last token is never reusable: 256 tokens hold one whole reusable block.
    assert reuse_breakdown([records[0], {"input_length": 256, "hash_ids": a}], 32,
                           {0: (0.0, 1.0, 0.0), 1: (2.0, 3.0, 128.0)})["ready_ratio"] == \
        pytest.approx(128 / (300 + 256))
    assert reuse_breakdown(records, 32, {})["ready_ratio"] is None


def test_answered_requests_reads_aiperf_records(tmp_path):
    lines = [
        {"metadata": {"conversation_id": "session_000002", "request_start_ns": 1_000_000},
         "metrics": {"time_to_first_token": {"value": 2.5, "unit": "ms"},
                     "usage_prompt_cache_read_tokens": {"value": 128, "unit": "tokens"}}},
        # A request refused with 429 has no TTFT.
        {"metadata": {"conversation_id": "session_000003", "request_start_ns": 5},
         "metrics": {}}]
    path = tmp_path / "profile_export.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert answered_requests(path) == {2: (1_000_000, 3_500_000.0, 128)}
