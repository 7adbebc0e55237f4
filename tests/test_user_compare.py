"""benchmarks/user_compare.py without servers: the generated traces' shapes,
block-stable prompt text, the servers' prefix counters read from /metrics,
and the table built from a fixed aiperf export."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from mooncaked.benchserve.tracegen import TraceGenConfig, describe, generate
from paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import user_compare  # noqa: E402
from prompt_text import BlockText  # noqa: E402


def test_arrival_cv_makes_arrivals_bursty_and_cv_1_keeps_poisson_draws():
    # One-offs and documents only: every request is a fresh arrival (chat
    # turns come after Poisson think times, whatever the arrival gaps).
    shape = dict(requests=400, seed=3, chat_share=0.0)
    poisson = generate(TraceGenConfig(**shape))
    assert poisson == generate(TraceGenConfig(**shape, arrival_cv=1.0))
    bursty = describe(generate(TraceGenConfig(**shape, arrival_cv=3.0)))
    assert 0.8 < describe(poisson)["arrival_gap_cv"] < 1.3
    assert bursty["arrival_gap_cv"] > 2.0
    with pytest.raises(ValueError, match="arrival_cv"):
        TraceGenConfig(arrival_cv=0)


def test_generated_traces_have_clearly_different_shapes(tmp_path):
    args = argparse.Namespace(out=tmp_path, max_requests=200, warmup=20, max_output_tokens=32,
                              max_span=75.0)
    chat, docs = user_compare.load_traces(["chat", "docs"], args, block_tokens=32)
    assert (tmp_path / "traces" / "chat.jsonl").is_file()
    assert len(chat.records) == len(docs.records) == 200 and len(docs.warmup) == 20

    def mean(s, key):
        return sum(r[key] for r in s.records) / len(s.records)

    # docs: prompts 5x longer, outputs 3x shorter, more reuse, burstier.
    assert mean(docs, "input_length") > 4 * mean(chat, "input_length")
    assert mean(chat, "output_length") > 2.5 * mean(docs, "output_length")
    assert docs.theoretical_hit_ratio > chat.theoretical_hit_ratio > 0.7
    cv = {s.name: describe(generate(user_compare.GENERATED[s.name]))["arrival_gap_cv"]
          for s in (chat, docs)}
    assert cv["docs"] > 2 * cv["chat"]
    # Both run about a minute at 1x with 200 requests (the matrix's time budget).
    for s in (chat, docs):
        assert 40 < s.records[-1]["timestamp"] / 1000 < 90
    args.max_span = 10.0
    (short,) = user_compare.load_traces(["chat"], args, block_tokens=32)
    assert 10 < len(short.records) < 50 and short.records[-1]["timestamp"] <= 10_000
    # Warm-up shares no block with the slice.
    ids = {h for r in docs.records for h in r["hash_ids"]}
    assert not ids & {h for r in docs.warmup for h in r["hash_ids"]}


def test_theoretical_hit_in_whole_cache_blocks_floors_each_shared_prefix():
    recs = [{"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": list(range(10))},
            {"timestamp": 1, "input_length": 300, "output_length": 1,
             "hash_ids": list(range(9)) + [99]}]
    # The second shares 9 blocks of 32 = 288 tokens: all of it at 32-token
    # blocks, one 256-token block at 256.
    assert user_compare.theoretical_hit(recs, 32) == pytest.approx(288 / 600)
    assert user_compare.theoretical_hit_at(recs, 32, 32) == pytest.approx(288 / 600)
    assert user_compare.theoretical_hit_at(recs, 32, 256) == pytest.approx(256 / 600)


def _tokenizer_dir(path: Path) -> Path:
    """The byte-level BPE of vllm_compare.build_checkpoint, without the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(f"word{i % 97} token{i % 13}" for i in range(j, j + 50))
              for j in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_block_text_prompts_share_exactly_their_shared_blocks_of_tokens(tmp_path):
    text = BlockText(_tokenizer_dir(tmp_path / "tok"), block_tokens=32)
    a = text.encode(text.prompt([1, 2, 3], 90))
    b = text.encode(text.prompt([1, 2, 7, 8], 100))
    assert (len(a), len(b)) == (90, 100)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared >= 64 and a[:64] == b[:64]
    for ids, n in (([5], 1), ([5, 6], 33), ([4, 5, 6, 7], 128)):
        text.check(ids, n)
    with pytest.raises(ValueError, match="do not fit"):
        text.prompt([1, 2], 70)


def test_prefix_counters_read_vllm_and_mooncaked_metrics():
    vllm = ("# HELP vllm:prefix_cache_queries_total x\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0\n'
            'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n')
    assert user_compare.prefix_counters(vllm) == {"queries": 1200.0, "hits": 300.0}
    ours = ("mooncaked:prefix_cache_queries_total 4096.0\n"
            "mooncaked:prefix_cache_hits_total 1024.0\n"
            "mooncaked:prefix_cache_fetched_tokens_total 512.0\n")
    assert user_compare.prefix_counters(ours) == {"queries": 4096.0, "hits": 1024.0}


def test_result_row_table_and_plot_from_a_fixed_aiperf_export(tmp_path):
    recs = [{"timestamp": t, "input_length": 64, "output_length": 4, "hash_ids": [1, h]}
            for t, h in ((0, 2), (1000, 3), (1500, 4), (3000, 5))]
    trace = user_compare.TraceSlice("chat", recs, [], 32)
    export = {
        "request_count": {"avg": 3.0}, "error_request_count": {"avg": 1.0},
        "good_request_count": {"avg": 2.0}, "goodput": {"avg": 0.5},
        "time_to_first_token": {"p50": 200.0, "p90": 900.0},
        "inter_token_latency": {"p50": 20.0, "p90": 40.0},
        "overall_usage_prompt_cache_read_pct": {"avg": 25.0},
        "error_summary": [{"error_details": {"code": 429}, "count": 1}],
    }
    traces = [{"request_id": "a", "predicted_ttft_s": 0.3, "ttft_s": 0.2},
              {"request_id": "b", "predicted_ttft_s": 0.1, "ttft_s": 0.2},
              {"request_id": "c", "predicted_ttft_s": 0.1, "ttft_s": 0.0}]   # rejected
    # aiperf's per-request records: sent 1, 3, 2 and 40 ms late (one without timing).
    records = [{"metadata": {"credit_issued_ns": 10**9 * i, "request_start_ns": 10**9 * i + late}}
               for i, late in enumerate((1_000_000, 3_000_000, 2_000_000, 40_000_000))]
    records.append({"metadata": {"x_request_id": "no timing"}})
    row = user_compare.result_row(trace, 2.0, "mooncaked", export,
                                  {"queries": 100.0, "hits": 10.0},
                                  {"queries": 228.0, "hits": 42.0}, traces, records)
    assert row["offered_rps"] == pytest.approx(2.0)       # 3 gaps in 3 s, at 2x
    assert row["in_slo_of_accepted"] == pytest.approx(2 / 3)
    assert row["prefix_hit_ratio"] == pytest.approx(32 / 128)
    assert row["theoretical_hit_ratio"] == pytest.approx(3 * 32 / 256)
    assert row["ttft_mae_s"] == pytest.approx(0.1)
    assert row["ttft_mae_of_p50"] == pytest.approx(0.5)
    assert row["client_late_p90_ms"] == pytest.approx(40.0)   # sorted 1, 2, 3, 40: index 3
    line = user_compare.markdown([row]).splitlines()[-1]
    assert line == ("| chat | 2x | mooncaked | 2.00 | 3/4 | 1 | 0.50 | 67% | 200 | 40.0 "
                    "| 25.0% | 25.0% | 37.5% (0.0%) | 50% | 40 |")
    assert user_compare.client_late_p90_ms([]) is None
    user_compare.write_results(tmp_path, [row], {"note": "test"})
    assert (tmp_path / "results.png").stat().st_size > 0


def test_unknown_trace_or_server_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        user_compare.main(["--traces", "sharegpt"])
    assert e.value.code == 2 and "sharegpt" in capsys.readouterr().err


def test_bench_serve_prefix_line_names_achieved_and_theoretical():
    from mooncaked.benchserve.report import Slo, prefix_hit_line, summarize
    from mooncaked.benchserve.replay import RequestResult

    ok = [RequestResult(i, i, 0.0, 100, 4, status="ok", ttft_s=0.1, e2e_s=0.2,
                        token_times_s=[0.1, 0.15], completion_tokens=2, cached_tokens=c)
          for i, c in enumerate((0, 60))]
    s = summarize(ok, Slo(1.0, 150.0), theoretical_hit_ratio=0.4)
    assert s["cache_hit_ratio"] == pytest.approx(0.3)
    assert s["cache_hit_of_theoretical"] == pytest.approx(0.75)
    line = prefix_hit_line(s)
    assert "30.0% of prompt tokens cached" in line and "theoretical 40.0%" in line
    assert line.endswith("achieved / theoretical 0.75")
    assert summarize(ok, Slo(), theoretical_hit_ratio=0.0)["cache_hit_of_theoretical"] is None


def test_a_trace_file_is_read_checked_and_named_by_its_stem(tmp_path, capsys):
    path = tmp_path / "their_trace.jsonl"
    lines = [{"timestamp": 1000 + 250 * i, "input_length": 1024, "output_length": 40,
              "hash_ids": [0, 1, 10 + i]} for i in range(12)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    args = argparse.Namespace(out=tmp_path, max_requests=10, warmup=2, max_output_tokens=32,
                              max_span=75.0)
    assert user_compare.is_trace_file(str(path)) and not user_compare.is_trace_file("docs")
    (t,) = user_compare.load_traces([str(path)], args, block_tokens=32)
    assert t.name == "their_trace" and len(t.records) == 10 and len(t.warmup) == 2
    # From its first request; lengths at 32 tokens per 512-token hash id, outputs capped.
    assert t.records[0] == {"timestamp": 0.0, "input_length": 64, "output_length": 32,
                            "hash_ids": [0, 1, 10]}
    assert t.rate_rps == pytest.approx(4.0)
    # Bad lines name the file and the line, before anything starts.
    for bad, says in (('{"timestamp": 0, "input_length": 5}', "missing output_length, hash_ids"),
                      ("not json", "not JSON"),
                      ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
                       "input_length > 0")):
        path.write_text(json.dumps(lines[0]) + "\n" + bad + "\n")
        with pytest.raises(SystemExit) as e:
            user_compare.read_trace_file(path)
        assert f"{path}:2: " in str(e.value) and says in str(e.value)
    with pytest.raises(SystemExit, match="No such file"):
        user_compare.read_trace_file(tmp_path / "absent.jsonl")
    # The command line takes the path where a built-in name would go.
    with pytest.raises(SystemExit) as e:
        user_compare.main(["--traces", f"docs,{tmp_path}/absent.jsonl,sharegpt", "--rates", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "sharegpt" in err and "absent" not in err.split("unknown or missing")[-1]


def test_checks_compare_with_vllm_at_each_rate():
    def row(server, rate, goodput, itl, in_slo=1.0, mae=0.1):
        return {"trace": "t", "rate_x": rate, "server": server, "goodput_rps": goodput,
                "itl_p90_ms": itl, "in_slo_of_accepted": in_slo, "ttft_mae_of_p50": mae}

    rows = [row("mooncaked", 1, 2.0, 10.0), row("vllm", 1, 2.0, 12.0),
            row("mooncaked_defaults", 1, 1.9, 11.0),                         # 0.95x: passes
            row("mooncaked", 2, 3.9, 15.0, in_slo=0.89, mae=0.21), row("vllm", 2, 4.0, 14.0),
            row("mooncaked_defaults", 2, 3.7, 20.0),                         # 0.925x: fails
            row("mooncaked", 4, 8.0, 20.0, mae=None), row("vllm", 4, 7.0, 30.0),
            row("mooncaked_defaults", 4, 1.0, 20.0),                         # above 2x: not judged
            row("vllm", 8, 9.0, 30.0)]                                       # no mooncaked: no bar
    checks = user_compare.bars(rows)
    assert [(c["rate_x"], c["goodput_ge_vllm"], c["itl_p90_le_vllm"], c["in_slo_ge_90"],
             c["prediction_le_20"], c["defaults_ge_95"]) for c in checks] == [
        (1, True, True, True, True, True),
        (2, False, False, False, False, False),
        (4, True, True, True, None, None)]
    table = user_compare.bars_markdown(checks).splitlines()
    assert table[3] == "| t | 2x | **no** | **no** | **no** | **no** | **no** |"
    assert table[4] == "| t | 4x | yes | yes | yes | - | - |"


def test_repeated_runs_are_judged_by_their_medians():
    """With several runs per (trace, rate, server) the checks read each
    figure's median: one slow run does not decide them; the spread table
    gives median [min-max] and the refusals of all runs."""
    def row(server, run, goodput, itl, mae=0.1, refused=0):
        return {"trace": "t", "rate_x": 2, "server": server, "run": run, "runs": 3,
                "goodput_rps": goodput, "itl_p90_ms": itl, "in_slo_of_accepted": 1.0,
                "ttft_mae_of_p50": mae, "rejected_429": refused}

    rows = [row("mooncaked", 1, 4.0, 10.0, 0.15), row("vllm", 1, 3.9, 12.0, None),
            row("mooncaked", 2, 2.0, 30.0, 0.40, refused=5), row("vllm", 2, 3.9, 11.0, None),
            row("mooncaked", 3, 4.1, 11.0, 0.18), row("vllm", 3, 4.0, 13.0, None)]
    summary = user_compare.medians(rows)
    assert [(r["server"], r["runs"], r["goodput_rps"], r["itl_p90_ms"], r["rejected_429"])
            for r in summary] == [("mooncaked", 3, 4.0, 11.0, 5), ("vllm", 3, 3.9, 12.0, 0)]
    assert summary[0]["ttft_mae_of_p50"] == 0.18 and summary[1]["ttft_mae_of_p50"] is None
    assert summary[0]["goodput_rps_range"] == (2.0, 4.1)
    (check,) = user_compare.bars(rows)
    assert (check["goodput_ge_vllm"], check["itl_p90_le_vllm"], check["prediction_le_20"]) == \
        (True, True, True)
    # The single slow run alone fails every one of them.
    (alone,) = user_compare.bars([rows[2], rows[3]])
    assert (alone["goodput_ge_vllm"], alone["itl_p90_le_vllm"], alone["prediction_le_20"]) == \
        (False, False, False)
    spread = user_compare.spread_markdown(summary).splitlines()
    assert spread[2] == "| t | 2x | mooncaked | 3 | 5 | 4.00 [2.00-4.10] | 11.0 [10.0-30.0] " \
                        "| 100 [100-100] | 18 [15-40] |"
    assert spread[3].endswith("| 12.0 [11.0-13.0] | 100 [100-100] | - |")


def test_results_name_each_run_and_say_the_checks_read_medians(tmp_path):
    rows = []
    for run, (m, v) in enumerate(((2.0, 2.1), (2.2, 2.0)), start=1):
        for server, goodput in (("mooncaked", m), ("vllm", v)):
            rows.append({"trace": "t", "rate_x": 1, "server": server, "run": run, "runs": 2,
                         "offered_rps": 2.0, "ok": 10, "sent": 10, "rejected_429": 0,
                         "goodput_rps": goodput, "in_slo_of_accepted": 1.0, "ttft_p50_ms": 40.0,
                         "itl_p90_ms": 9.0, "prefix_hit_ratio": 0.5, "cached_prompt_pct": 50.0,
                         "theoretical_hit_ratio": 0.5, "theoretical_hit_ratio_256": 0.5,
                         "ttft_mae_of_p50": 0.1 if server == "mooncaked" else None,
                         "client_late_p90_ms": 2.0})
    table = user_compare.write_results(tmp_path, rows, {})
    assert "| t | 1x | mooncaked, run 2 |" in table
    assert "Median [min-max] of 2 runs:" in table
    assert "Checks, mooncaked against vLLM (medians of 2 runs):" in table
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["bars"][0]["goodput_ge_vllm"] is True    # medians 2.1 against 2.05


def test_rounds_rotate_the_servers_from_run_to_run_and_rate_to_rate():
    order = list(user_compare.rounds([1.0, 2.0], 2, ["a", "b", "c"]))
    assert order == [(1.0, 1, "a"), (1.0, 1, "b"), (1.0, 1, "c"),
                     (1.0, 2, "b"), (1.0, 2, "c"), (1.0, 2, "a"),
                     (2.0, 1, "b"), (2.0, 1, "c"), (2.0, 1, "a"),
                     (2.0, 2, "c"), (2.0, 2, "a"), (2.0, 2, "b")]


def test_replay_all_keeps_the_rows_that_ran_and_writes_after_each():
    """A replay that fails (RuntimeError) is left out and the others still
    run; every kept row is written as soon as it is in."""
    slices = [argparse.Namespace(name="t")]
    written = []

    def run_row(s, rate, name, run):
        if name == "b" and run == 2:
            raise RuntimeError("server did not start")
        return {"trace": s.name, "rate_x": rate, "server": name, "run": run}

    rows = user_compare.replay_all(slices, [1.0], 2, ["a", "b"], run_row,
                                   lambda done: written.append(len(done)))
    assert [(r["server"], r["run"]) for r in rows] == [("a", 1), ("b", 1), ("a", 2)]
    assert written == [1, 2, 3]
