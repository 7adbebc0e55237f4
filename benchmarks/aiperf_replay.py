"""A Mooncake-format trace slice replayed by aiperf (NVIDIA's benchmark
client, not ours) against mooncaked, and optionally vLLM's CPU build, on the
same random-weight checkpoint the rate sweep uses.

    nice -n 19 .venv/bin/python benchmarks/aiperf_replay.py --max-requests 200 \\
        --servers mooncaked,vllm --out /tmp/mooncaked-aiperf

What it does, per server (a fresh one each, cold cache):

1. aiperf in its own venv (default ``~/.cache/mooncaked-aiperf/venv``,
   ``pip install aiperf==0.13.0``, built on first use) so the project's venv
   keeps its pins;
2. the slice written as a Mooncake trace aiperf reads unchanged: aiperf maps
   each hash id to ``--isl-block-size`` tokens but takes ``input_length``
   literally (a 40k-token request stays 40k whatever the block size), so the
   lengths are scaled here, as the rate sweep scales them: ``input_length``
   becomes ``ceil(input_length * b / 512)`` with ``b = round(512 *
   length_scale)`` (32 by default), hash ids are kept, aiperf is told
   ``--isl-block-size b``; output lengths are capped at
   ``--max-output-tokens`` (aiperf sends a turn's ``output_length`` as
   ``max_tokens``); timestamps are shifted to start at 0 and divided by
   ``--rate``;
3. aiperf's offline tokenizer: aiperf loads a tokenizer offline only from a
   Hugging Face hub cache (``models--ORG--NAME/snapshots/REV/`` with
   ``refs/main`` naming REV), never from a plain checkpoint directory, so the
   checkpoint's tokenizer files are laid out as one under ``--workdir`` and
   aiperf runs with ``HF_HUB_CACHE`` pointing there and ``HF_HUB_OFFLINE=1``;
4. the server: mooncaked through the real ``mooncaked up`` command line
   (``rate_sweep.up_target``; ``--up-args`` adds to it), vLLM through
   ``vllm_compare.vllm_target``;
5. an optional warm-up replay (``--warmup`` requests after the slice, hash
   ids moved so they share no block with it), then the measured replay:
   ``aiperf profile --endpoint-type completions --streaming
   --custom-dataset-type mooncake_trace --fixed-schedule --goodput
   "time_to_first_token:MS inter_token_latency:MS"``, temperature 0 and
   ``ignore_eos`` (so every request decodes its full output length).

aiperf prompts are text (hash-id blocks of its own corpus, decoded with the
checkpoint's tokenizer); the server tokenizes them again, so prompt lengths
and shared prefixes are those of the scaled slice up to BPE merges at block
joins, which with a small tokenizer leave little of the shared prefixes
(2-6% of the reusable tokens measured on both servers).
``benchmarks/user_compare.py`` gives aiperf block-stable literal prompts
instead (``prompt_text.BlockText``) and is the comparison of record.  Token counts are the server's (``--use-server-token-count``: the
``usage`` of the last streamed chunk, cached prompt tokens from
``usage.prompt_tokens_details.cached_tokens``).  Goodput is aiperf's: requests meeting both SLOs (TTFT, and the
request's mean inter-token latency) per second of the run.  aiperf counts an
HTTP 429 (mooncaked's early rejection) as an error; the 429 column is its
error breakdown.

Writes aiperf's artifacts (``profile_export_aiperf.json``/``.csv``,
per-request ``profile_export.jsonl``) under ``--out/aiperf/SERVER/``,
``replay.json`` and ``replay.md`` under ``--out``.  A benchmark, not a
test; figures on a shared 2-core machine are relative.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kvstore.keys import TRACE_BLOCK_TOKENS  # noqa: E402
from mooncaked.benchserve.session import MACHINE_NOTE  # noqa: E402
from mooncaked.benchserve.workload import WARMUP_HASH_OFFSET, WorkloadConfig, load_slice  # noqa: E402

AIPERF_PIN = "aiperf==0.13.0"
# What aiperf's summary export is called under --artifact-dir (its default
# --profile-export-prefix).
SUMMARY_JSON = "profile_export_aiperf.json"
# Files of a checkpoint that make up its tokenizer for AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "config.json",
                   "generation_config.json")


def log(msg: str) -> None:
    print(f"[aiperf_replay] {msg}", file=sys.stderr, flush=True)


def ensure_aiperf(venv: Path) -> Path:
    """The ``aiperf`` executable of its own venv, installed on first use."""
    exe = venv / "bin" / "aiperf"
    if (venv / ".ready").is_file() and exe.is_file():
        return exe
    log(f"creating {venv} and installing {AIPERF_PIN} ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", AIPERF_PIN],
                   check=True)
    subprocess.run([str(exe), "--version"], check=True, stdout=subprocess.DEVNULL)
    (venv / ".ready").write_text(AIPERF_PIN + "\n")
    return exe


def scaled_trace(cfg: WorkloadConfig, rate: float, hash_offset: int = 0) -> list[dict[str, Any]]:
    """The slice of ``cfg`` as Mooncake trace records for aiperf at block size
    ``cfg.block_tokens``: the same prompt and output lengths as
    ``workload.build_workload`` gives the rate sweep, the trace's hash ids
    (plus ``hash_offset``), timestamps in ms from 0, ``rate`` x denser.

    Invariant aiperf's hash-id synthesis needs: with m hash ids of a valid
    trace line, ``(m-1)*512 < input_length <= m*512``, so the scaled length is
    in ``((m-1)*b, m*b]``: the last id is a partial (or full) block, never
    an empty or overfull one."""
    if not rate > 0:
        raise ValueError("rate must be > 0")
    b = cfg.block_tokens
    trace = load_slice(cfg)
    if not trace:
        raise ValueError(f"trace: no requests in {cfg.trace!r} after offset {cfg.offset}")
    t0 = trace[0].arrival_s
    out = []
    for r in trace:
        out_len = max(1, math.ceil(r.output_length * (cfg.output_scale or cfg.length_scale)))
        if cfg.max_output_tokens:
            out_len = min(out_len, cfg.max_output_tokens)
        out.append({
            "timestamp": round((r.arrival_s - t0) * 1000.0 / rate, 3),
            "input_length": max(1, math.ceil(r.input_length * b / TRACE_BLOCK_TOKENS)),
            "output_length": out_len,
            "hash_ids": [h + hash_offset for h in r.hash_ids],
        })
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tokenizer_hub_cache(model_dir: Path, hub_cache: Path, repo_id: str) -> str:
    """Lay the checkpoint's tokenizer files out as the Hugging Face hub cache
    holds a downloaded repo ``repo_id``; returns the revision.  The revision is
    a digest of the files, so a changed checkpoint gets a new snapshot and
    ``refs/main`` always names the current one."""
    files = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    if not any(f.name == "tokenizer.json" or f.name == "tokenizer.model" for f in files):
        raise SystemExit(f"{model_dir}: no tokenizer.json or tokenizer.model to give aiperf")
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    rev = digest.hexdigest()
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return rev


def aiperf_command(aiperf: Path, *, url: str, model: str, tokenizer: str, trace_file: Path,
                   block_tokens: int, ttft_slo_ms: float, itl_slo_ms: float,
                   artifact_dir: Path, request_timeout_s: float, endpoint_type: str,
                   seed: int) -> list[str]:
    return [
        str(aiperf), "profile",
        "--model", model, "--tokenizer", tokenizer, "--url", url,
        "--endpoint-type", endpoint_type, "--streaming",
        "--custom-dataset-type", "mooncake_trace", "--input-file", str(trace_file),
        "--fixed-schedule", "--isl-block-size", str(block_tokens),
        # Output tokens as the server counts them (usage in the last chunk):
        # aiperf's own count re-tokenizes the streamed text, and random-weight
        # models emit token runs that do not re-tokenize to themselves (16
        # generated tokens counted as up to 48), which would shrink the ITL
        # aiperf derives as (latency - TTFT) / (tokens - 1).
        "--use-server-token-count",
        # Deterministic decoding, and every request runs its full output.
        "--extra-inputs", json.dumps({"temperature": 0, "ignore_eos": True}),
        "--goodput", f"time_to_first_token:{ttft_slo_ms:g} inter_token_latency:{itl_slo_ms:g}",
        "--request-timeout-seconds", f"{request_timeout_s:g}",
        "--random-seed", str(seed),
        "--artifact-dir", str(artifact_dir),
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
    ]


def run_aiperf(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # A session of its own, as the servers have: with scheduler autogroups
    # the kernel shares the cores between sessions first, so a client left in
    # this script's session would get whatever that session was given (a
    # shell or CI job at a low priority starves the client, and its TTFTs
    # then measure its own waiting).
    with log_path.open("wb") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s, check=False, start_new_session=True)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"aiperf exited with {proc.returncode}; see {log_path}:\n"
                           + "\n".join(tail))


def _stat(metrics: dict[str, Any], tag: str, key: str) -> float | None:
    value = (metrics.get(tag) or {}).get(key)
    return None if value is None else float(value)


def summary_row(server: str, export: dict[str, Any], sent: int) -> dict[str, Any]:
    """One table row from aiperf's summary export (``profile_export_aiperf.json``).

    aiperf writes each metric under its tag with ``unit`` and statistics
    (``avg``, ``p50``, ``p90``, ...); a run-level count sits in ``avg``.
    Requests that failed are not in ``request_count`` but in
    ``error_request_count`` and, by cause, in ``error_summary``."""
    def count(tag: str) -> int:
        v = _stat(export, tag, "avg")
        return 0 if v is None else int(v)

    errors_by_code: dict[str, int] = {}
    for entry in export.get("error_summary") or []:
        details = entry.get("error_details") or {}
        code = str(details.get("code") or details.get("type") or "other")
        errors_by_code[code] = errors_by_code.get(code, 0) + int(entry.get("count", 0))
    return {
        "server": server, "sent": sent,
        "ok": count("request_count"), "errors": count("error_request_count"),
        "rejected_429": errors_by_code.get("429", 0), "errors_by_code": errors_by_code,
        "good": count("good_request_count"),
        "goodput_rps": _stat(export, "goodput", "avg"),
        "ttft_p50_ms": _stat(export, "time_to_first_token", "p50"),
        "ttft_p90_ms": _stat(export, "time_to_first_token", "p90"),
        "itl_p50_ms": _stat(export, "inter_token_latency", "p50"),
        "itl_p90_ms": _stat(export, "inter_token_latency", "p90"),
        "cached_prompt_pct": _stat(export, "overall_usage_prompt_cache_read_pct", "avg"),
        "duration_s": _stat(export, "benchmark_duration", "avg"),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    out = ["| server | ok/sent | errors (429) | in SLO | goodput req/s | TTFT p50 / p90 ms "
           "| ITL p50 / p90 ms | cached prompt % |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['server']} | {r['ok']}/{r['sent']} | {r['errors']} ({r['rejected_429']}) "
                   f"| {r['good']} | {f(r['goodput_rps'], '.2f')} "
                   f"| {f(r['ttft_p50_ms'], '.0f')} / {f(r['ttft_p90_ms'], '.0f')} "
                   f"| {f(r['itl_p50_ms'], '.1f')} / {f(r['itl_p90_ms'], '.1f')} "
                   f"| {f(r['cached_prompt_pct'], '.1f')} |")
    return "\n".join(out)


@dataclass(frozen=True)
class Replay:
    """One server's aiperf runs: same client settings, one artifact folder each."""
    aiperf: Path
    url: str
    tokenizer: str          # the hub-cache repo id of the checkpoint's tokenizer
    block_tokens: int
    args: argparse.Namespace
    env: dict[str, str]
    artifacts: Path

    def run(self, trace_file: Path, name: str) -> Path:
        artifact_dir = self.artifacts / name
        if artifact_dir.exists():
            shutil.rmtree(artifact_dir)   # aiperf would mix a previous run's files in
        a = self.args
        cmd = aiperf_command(
            self.aiperf, url=self.url, model="model", tokenizer=self.tokenizer,
            trace_file=trace_file, block_tokens=self.block_tokens,
            ttft_slo_ms=a.ttft_slo * 1000.0, itl_slo_ms=a.tbt_slo, artifact_dir=artifact_dir,
            request_timeout_s=a.request_timeout, endpoint_type=a.endpoint_type, seed=0)
        log(f"{artifact_dir}: {shlex.join(cmd)}")
        span_s = max(json.loads(line)["timestamp"] for line in trace_file.open()) / 1000.0
        # Bounded: the schedule's span, one request timeout, and aiperf's own start-up.
        run_aiperf(cmd, self.env, artifact_dir / "aiperf.log",
                   timeout_s=span_s + a.request_timeout + 300.0)
        return artifact_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run it under `nice -n 19` on a shared machine.  See docs/bench.md.")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mooncaked-vllm",
                    help="where the random checkpoint and vLLM's venv live (as vllm_compare)")
    ap.add_argument("--aiperf-venv", type=Path,
                    default=Path.home() / ".cache" / "mooncaked-aiperf" / "venv")
    ap.add_argument("--model-dir", type=Path, help="HF checkpoint (default: build a random one)")
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces"
                                           / "synthetic_trace.jsonl"))
    ap.add_argument("--offset", type=int, default=0, help="skip the first N trace requests")
    ap.add_argument("--max-requests", type=int, default=200, help="requests in the slice")
    ap.add_argument("--rate", type=float, default=1.0, help="multiple of the trace's own rate")
    ap.add_argument("--length-scale", type=float, default=1 / 16,
                    help="tokens per trace token (1/16: 32 tokens per 512-token block)")
    ap.add_argument("--max-output-tokens", type=int, default=16)
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    ap.add_argument("--tbt-slo", type=float, default=150.0, help="ms, judged on aiperf's ITL")
    ap.add_argument("--servers", default="mooncaked", help="comma list of mooncaked, vllm")
    ap.add_argument("--up-args", default="", help="extra `mooncaked up` arguments, one string")
    ap.add_argument("--warmup", type=int, default=20,
                    help="warm-up requests (after the slice, hash ids moved; 0 = none)")
    ap.add_argument("--endpoint-type", default="completions", choices=("completions", "chat"),
                    help="chat needs a checkpoint with a chat template")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--vllm-start-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mooncaked-aiperf"))
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(wanted) - {"mooncaked", "vllm"})
    if unknown or not wanted:
        ap.error(f"--servers: unknown {', '.join(unknown) or '(none given)'}; "
                 "use mooncaked and/or vllm")
    if args.max_requests <= 0 or args.warmup < 0 or not args.rate > 0:
        ap.error("--max-requests must be > 0, --warmup >= 0, --rate > 0")

    from vllm_compare import prepare_checkpoint
    from rate_sweep import server_targets

    try:
        wl = WorkloadConfig(trace=args.trace, offset=args.offset, max_requests=args.max_requests,
                            length_scale=args.length_scale, output_scale=1.0,
                            max_output_tokens=args.max_output_tokens)
        slice_records = scaled_trace(wl, args.rate)
        warm = replace(wl, offset=args.offset + args.max_requests,
                       max_requests=args.warmup) if args.warmup else None
        warm_records = scaled_trace(warm, args.rate, WARMUP_HASH_OFFSET) if warm else []
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    aiperf = ensure_aiperf(args.aiperf_venv)
    model_dir, _vocab, max_len, _reserved = prepare_checkpoint(args.model_dir, args.workdir)
    longest = max(r["input_length"] + r["output_length"] for r in slice_records + warm_records)
    if longest > max_len:
        raise SystemExit(f"the slice needs {longest} tokens of context; the model has {max_len}")

    args.out.mkdir(parents=True, exist_ok=True)
    slice_file = write_jsonl(args.out / "slice.jsonl", slice_records)
    warm_file = write_jsonl(args.out / "warmup.jsonl", warm_records) if warm_records else None
    hub_cache = args.out / "hf-hub"
    repo_id = f"mooncaked/{model_dir.name}"
    tokenizer_hub_cache(model_dir, hub_cache, repo_id)
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}

    b = wl.block_tokens
    # mooncaked's conductor admits against the same SLOs aiperf judges by.
    targets = server_targets(wanted, model_dir, max_len, b, args)
    rows = []
    for target in targets:
        log(f"{target.description}: starting")
        url = target.start()
        try:
            replay = Replay(aiperf, url, repo_id, b, args, env, args.out / "aiperf" / target.name)
            if warm_file is not None:
                replay.run(warm_file, "warmup")
            measured = replay.run(slice_file, "slice")
        finally:
            target.stop()
        export = json.loads((measured / SUMMARY_JSON).read_text())
        row = summary_row(target.name, export, len(slice_records))
        rows.append(row)
        log(json.dumps(row))

    table = markdown(rows)
    (args.out / "replay.json").write_text(json.dumps(
        {"note": MACHINE_NOTE, "argv": sys.argv[1:] if argv is None else argv,
         "client": AIPERF_PIN, "block_tokens": b, "rate_x": args.rate,
         "slo": {"ttft_s": args.ttft_slo, "itl_ms": args.tbt_slo}, "rows": rows}, indent=1))
    (args.out / "replay.md").write_text(table + "\n")
    print(table)
    print(MACHINE_NOTE)
    print(f"written: {args.out / 'replay.json'}, aiperf artifacts under {args.out / 'aiperf'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
