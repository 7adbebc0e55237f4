"""benchmarks/aiperf_replay.py: the trace slice aiperf is given, the hub-cache
layout its offline tokenizer needs, the table row read from its export, and
(when aiperf's venv is installed) a real replay by aiperf against a cluster
started by ``mooncaked up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.benchserve.workload import WorkloadConfig, build_workload
from paths import REPO, SYNTHETIC_TRACE, needs_trace

sys.path.insert(0, str(REPO / "benchmarks"))
import aiperf_replay  # noqa: E402

AIPERF_VENV = Path.home() / ".cache" / "mooncaked-aiperf" / "venv"
needs_aiperf = pytest.mark.skipif(
    not (AIPERF_VENV / "bin" / "aiperf").is_file(),
    reason=f"aiperf not installed in {AIPERF_VENV} (benchmarks/aiperf_replay.py installs it "
           "from PyPI on first use)")


def _write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_scaled_trace_scales_lengths_keeps_hash_ids_and_compresses_time(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1000, "output_length": 40, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 512, "output_length": 3, "hash_ids": [7]},
    ])
    wl = WorkloadConfig(trace=str(trace), length_scale=1 / 16, output_scale=1.0,
                        max_output_tokens=16)
    # b = 32 tokens per hash id: ceil(1000 * 32 / 512) = 63, 512 -> 32; outputs
    # capped at 16; timestamps from 0, twice as dense at rate 2.
    assert aiperf_replay.scaled_trace(wl, rate=2.0) == [
        {"timestamp": 0.0, "input_length": 63, "output_length": 16, "hash_ids": [7, 8]},
        {"timestamp": 1000.0, "input_length": 32, "output_length": 3, "hash_ids": [7]},
    ]
    moved = aiperf_replay.scaled_trace(wl, rate=1.0, hash_offset=100)
    assert [r["hash_ids"] for r in moved] == [[107, 108], [107]]
    assert moved[1]["timestamp"] == 2000.0


@needs_trace
def test_scaled_trace_matches_the_rate_sweep_workload_and_aiperf_block_rule():
    wl = WorkloadConfig(trace=str(SYNTHETIC_TRACE), offset=3700, max_requests=250,
                        length_scale=1 / 16, output_scale=1.0, max_output_tokens=16)
    records = aiperf_replay.scaled_trace(wl, rate=1.0)
    reqs = build_workload(wl)
    b = wl.block_tokens
    assert len(records) == len(reqs) == 250
    for rec, req in zip(records, reqs):
        # Same prompt and output lengths as the token-id replay of the rate sweep.
        assert rec["input_length"] == len(req.prompt)
        assert rec["output_length"] == req.max_tokens
        assert tuple(rec["hash_ids"]) == req.hash_ids
        assert rec["timestamp"] == pytest.approx(req.arrival_s * 1000.0, abs=1e-3)
        # aiperf's hash-id synthesis: the last id is a block of 1..b tokens.
        m = len(rec["hash_ids"])
        assert (m - 1) * b < rec["input_length"] <= m * b


def _save_tokenizer(path: Path, extra: str = "") -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([f"alpha beta gamma {i} {extra}" for i in range(50)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    # As in a checkpoint: AutoTokenizer reads the model type from config.json.
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))


_LOAD_FROM_HUB_CACHE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps(tok.encode("alpha beta gamma 7", add_special_tokens=False)))
"""


@pytest.mark.slow  # trains a tokenizer, imports transformers in a subprocess: ~8 s
def test_tokenizer_hub_cache_is_loadable_offline_by_repo_id(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save_tokenizer(ckpt)
    hub = tmp_path / "hub"
    rev = aiperf_replay.tokenizer_hub_cache(ckpt, hub, "mooncaked/ckpt")
    repo = hub / "models--mooncaked--ckpt"
    assert (repo / "refs" / "main").read_text() == rev
    assert (repo / "snapshots" / rev / "tokenizer.json").is_file()
    # A fresh process, offline, names the tokenizer by repo id only (a plain
    # directory is what aiperf cannot load offline).
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _LOAD_FROM_HUB_CACHE, "mooncaked/ckpt"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoTokenizer
    direct = AutoTokenizer.from_pretrained(str(ckpt))
    assert json.loads(out.stdout) == direct.encode("alpha beta gamma 7", add_special_tokens=False)

    # A changed checkpoint gets its own snapshot and refs/main follows it.
    _save_tokenizer(ckpt, extra="delta")
    rev2 = aiperf_replay.tokenizer_hub_cache(ckpt, hub, "mooncaked/ckpt")
    assert rev2 != rev and (repo / "refs" / "main").read_text() == rev2


def test_tokenizer_hub_cache_refuses_a_directory_without_a_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        aiperf_replay.tokenizer_hub_cache(tmp_path, tmp_path / "hub", "x/y")


def test_summary_row_counts_429_apart_from_other_errors():
    # The shape aiperf 0.13 writes to profile_export_aiperf.json (keys used here).
    export = {
        "request_count": {"unit": "requests", "avg": 11.0},
        "error_request_count": {"unit": "requests", "avg": 6.0},
        "good_request_count": {"unit": "requests", "avg": 9.0},
        "goodput": {"unit": "requests/sec", "avg": 1.25},
        "time_to_first_token": {"unit": "ms", "p50": 263.8, "p90": 822.3},
        "inter_token_latency": {"unit": "ms", "p50": 5.8, "p90": 11.4},
        "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 1.7},
        "benchmark_duration": {"unit": "sec", "avg": 7.7},
        "error_summary": [
            {"error_details": {"code": 429, "type": "Too Many Requests"}, "count": 1},
            {"error_details": {"code": 429, "type": "Too Many Requests"}, "count": 4},
            {"error_details": {"code": 500, "type": "Internal Server Error"}, "count": 1},
        ],
    }
    row = aiperf_replay.summary_row("mooncaked", export, sent=17)
    assert (row["ok"], row["errors"], row["rejected_429"], row["good"]) == (11, 6, 5, 9)
    assert row["errors_by_code"] == {"429": 5, "500": 1}
    assert (row["ttft_p50_ms"], row["itl_p90_ms"], row["goodput_rps"]) == (263.8, 11.4, 1.25)
    line = aiperf_replay.markdown([row]).splitlines()[-1]
    assert line == "| mooncaked | 11/17 | 6 (5) | 9 | 1.25 | 264 / 822 | 5.8 / 11.4 | 1.7 |"


def test_bad_arguments_are_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        aiperf_replay.main(["--servers", "sglang", "--out", str(tmp_path)])
    assert e.value.code == 2 and "unknown sglang" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="is not a file"):
        aiperf_replay.main(["--trace", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)])


@pytest.mark.slow
@needs_aiperf
def test_aiperf_replays_a_trace_against_mooncaked_up_unchanged(tmp_path):
    """aiperf (its own venv, offline tokenizer from the hub-cache layout)
    replays a 3-request Mooncake trace against `mooncaked up`: every request
    succeeds, the server's usage shows each request's full output, and a
    request sharing 3 hash-id blocks with an earlier one is served from cache
    — aiperf's hash-synthesised text keeps the trace's shared prefixes through
    the server's tokenizer.  ~1 min: a cluster start and two aiperf starts."""
    from vllm_compare import build_checkpoint

    ckpt = tmp_path / "ckpt"
    build_checkpoint(ckpt, vocab=512, seed=0)
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 2048, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 100, "input_length": 300, "output_length": 8, "hash_ids": [9]},
        # 3 s later: the first request's prefill is long done and its blocks stored.
        {"timestamp": 3000, "input_length": 2000, "output_length": 6, "hash_ids": [1, 2, 3, 5]},
    ])
    out = tmp_path / "out"
    # SLOs far above anything a tiny model takes here, so nothing is refused.
    rc = aiperf_replay.main([
        "--model-dir", str(ckpt), "--trace", str(trace), "--max-requests", "3",
        "--warmup", "0", "--ttft-slo", "120", "--tbt-slo", "60000",
        # 32-token store blocks (up's default is 256), so that 3 shared hash
        # ids (96 tokens) can be served from cache at all.
        "--up-args", "--set store.block_size=32",
        "--request-timeout", "120", "--out", str(out)])
    assert rc == 0
    (row,) = json.loads((out / "replay.json").read_text())["rows"]
    assert (row["server"], row["sent"], row["ok"], row["errors"]) == ("mooncaked", 3, 3, 0)
    assert row["good"] == 3
    records = [json.loads(line) for line in
               (out / "aiperf" / "mooncaked" / "slice" / "profile_export.jsonl").open()]
    by_isl = {r["metrics"]["usage_prompt_tokens"]["value"]: r["metrics"] for r in records}
    # Prompt lengths as scaled (b = 32): 128, ceil(300/16) = 19, 125 tokens.
    assert sorted(by_isl) == [19, 125, 128]
    assert [by_isl[n]["usage_completion_tokens"]["value"] for n in (128, 19, 125)] == [5, 8, 6]
    assert by_isl[128]["usage_prompt_cache_read_tokens"]["value"] == 0
    assert by_isl[125]["usage_prompt_cache_read_tokens"]["value"] >= 2 * 32, by_isl[125]


@pytest.mark.slow
@needs_aiperf
def test_aiperf_min_tokens_gets_the_output_lengths_asked_for(tmp_path):
    """``--extra-inputs min_tokens:N``, as aiperf suggests for exact output
    lengths, runs unchanged against `mooncaked up`: every request generates
    exactly the N tokens asked for.  EOS is pushed to the top with a
    logit_bias, so without min_tokens each answer would end at once; the
    lengths come from min_tokens holding EOS off.  ~1 min: a cluster start
    and one aiperf start."""
    from rate_sweep import up_target
    from vllm_compare import build_checkpoint

    ckpt = tmp_path / "ckpt"
    build_checkpoint(ckpt, vocab=512, seed=0)  # EOS is token 1
    hub = tmp_path / "hf-hub"
    aiperf_replay.tokenizer_hub_cache(ckpt, hub, "mooncaked/ckpt")
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    output_tokens = 6
    target = up_target(ckpt, ["--prefill", "1", "--decode", "1", "--ttft-slo-s", "120",
                              "--tbt-slo-ms", "60000"], tmp_path / "up", start_timeout_s=180)
    url = target.start()
    try:
        artifacts = tmp_path / "aiperf"
        cmd = [str(AIPERF_VENV / "bin" / "aiperf"), "profile",
               "--model", "model", "--tokenizer", "mooncaked/ckpt", "--url", url,
               "--endpoint-type", "completions", "--streaming",
               "--synthetic-input-tokens-mean", "40", "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
               "--extra-inputs", f"min_tokens:{output_tokens}",
               "--extra-inputs", json.dumps({"temperature": 0, "logit_bias": {"1": 100}}),
               "--request-count", "3", "--concurrency", "1", "--use-server-token-count",
               "--request-timeout-seconds", "120", "--random-seed", "0",
               "--artifact-dir", str(artifacts),
               "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"]
        aiperf_replay.run_aiperf(cmd, env, artifacts / "aiperf.log", timeout_s=600)
    finally:
        target.stop()
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").open()]
    assert len(records) == 3, records
    assert [r["metrics"]["usage_completion_tokens"]["value"] for r in records] == \
        [output_tokens] * 3
