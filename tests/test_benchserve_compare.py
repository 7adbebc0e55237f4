"""bench compare on a tiny slice: two real local clusters one after the
other (Mooncake and colocated without prefix reuse), two rounds, one table
with medians and ratios."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.slow  # starts four local clusters


def test_compare_two_configs_produces_table_and_plots(tmp_path, bench_cli, system_prompt_trace):
    # One shared system prompt, one-offs: every request after the first can
    # reuse it where prefix reuse is on.
    trace = system_prompt_trace(requests=8, rate=2.0, system_prompts=1, user_tokens_mean=200)
    out = tmp_path / "cmp"
    res = CliRunner().invoke(bench_cli, [
        "bench", "compare", "--trace", str(trace), "--configs", "mooncake,colocated_no_cache",
        "--model", "tiny", "--prefill", "1", "--decode", "1", "--colocated", "2",
        "--length-scale", "0.03125", "--time-scale", "0.5", "--max-output-tokens", "2",
        "--warmup", "1", "--rounds", "2", "--out", str(out), "--log-dir", str(tmp_path / "logs"),
        "--set", "store.capacity_bytes=16777216", "--set", "node.heartbeat_interval_s=0.2",
        "--no-progress"])
    assert res.exit_code == 0, res.output
    table = [line for line in res.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 4 and "goodput x" in table[0]
    # Two rounds each (order rotated): ok/sent counts both.
    assert table[2].startswith("| mooncake | 16/16 ") and table[3].startswith(
        "| colocated_no_cache | 16/16 ")
    result = json.loads((out / "compare.json").read_text())
    base, nocache = result["rows"]
    assert result["rounds"] == 2 and len(base["rounds"]) == len(nocache["rounds"]) == 2
    assert base["goodput_rps"] == sum(r["goodput_rps"] for r in base["rounds"]) / 2
    assert base["x_goodput"] == 1.0 and base["name"] == "mooncake"
    assert "2 colocated" in nocache["description"] and "1P+1D" in base["description"]
    # Prefix reuse off means no cached tokens; Mooncake reuses the system prompt.
    assert nocache["cache_hit_ratio"] == 0.0
    assert base["cache_hit_ratio"] > 0.0
    assert base["prefill_tokens_computed"] < nocache["prefill_tokens_computed"]
    assert nocache["x_prefill_compute"] == nocache["prefill_compute_s"] / base["prefill_compute_s"]
    for name in ("compare.md", "compare.png", "compare_cdf.png", "mooncake/round_1/summary.json",
                 "colocated_no_cache/round_2/requests.csv"):
        assert (out / name).is_file(), name
    # Every start is a fresh cluster with its own logs.
    meta = json.loads((out / "colocated_no_cache/round_2/summary.json").read_text())["meta"]
    assert meta["round"] == 2
    assert (tmp_path / "logs" / "mooncake" / "start_2" / "conductor.log").is_file()
