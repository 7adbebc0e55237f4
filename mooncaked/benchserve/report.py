"""Summary of a replay (the paper's metrics), JSON/CSV files and PNG plots.

Definitions (every number is recomputable from ``requests.json``):

- TTFT, E2E: client-side, from the send to the first token / end of stream.
- TBT: the paper's, mean of the longest 10% of a request's token intervals
  (``simulate.metrics.paper_tbt``); TPOT and ITL as vLLM reports them.
- effective request capacity: share of *sent* requests (rejected and failed
  ones included) that finished with TTFT <= ttft_slo_s and TBT <= tbt_slo_ms;
  the paper's figure, also given at its three TBT SLOs (100/200/300 ms).
- goodput: those effective requests per second of offered load, i.e. the
  offered rate times the effective share (``goodput_rps``).  Per second of
  run time, first send to the last request's end, it is also reported
  (``goodput_run_rps``), but that also counts how late the last
  request ended, so two servers that both served every request within both
  SLOs differed by the latency of their last one (1-5% on a 4x replay of
  11 s); the SLOs already count latency.
- accepted: sent and not rejected (429); ``accepted_in_slo``: the share of
  them that met both SLOs (what early rejection is meant to protect).
- rejections: ``reject_s`` (send -> the 429) and how many carried Retry-After.
- prediction error (servers exposing per-request traces): mean absolute
  (predicted - conductor-measured) TTFT and TBT over ok requests; TTFT's
  also as a share of the client-measured TTFT p50.
- cache hit ratio: cached prompt tokens / prompt tokens of ok requests;
  ``prefill_compute_saved`` is the same share, read as prefill tokens not
  computed; ``prefill_compute_s`` is the server-measured prefill compute
  time summed (when the server exposes per-request traces).
- theoretical hit ratio: what an unbounded instant cache would reach on the
  replayed slice; ``cache_hit_of_theoretical`` = measured / theoretical.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mooncaked.benchserve.replay import RequestResult
from mooncaked.simulate.metrics import TBT_SLOS_MS, pct


@dataclass
class Slo:
    ttft_s: float = 30.0
    tbt_ms: float = 200.0

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ValueError("ttft_slo_s must be > 0")
        if not self.tbt_ms > 0:
            raise ValueError("tbt_slo_ms must be > 0")

    def met(self, r: RequestResult, tbt_ms: Optional[float] = None) -> bool:
        limit = self.tbt_ms if tbt_ms is None else tbt_ms
        return (r.status == "ok" and r.ttft_s is not None and r.ttft_s <= self.ttft_s
                and (r.tbt_s or 0.0) <= limit / 1000)


def stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9),
            "p99": pct(xs, 0.99), "max": max(xs)}


def run_duration_s(results: list[RequestResult]) -> float:
    """First send to the last end of a request (the goodput denominator)."""
    sent = [r for r in results if r.status != "not_sent"]
    if not sent:
        return 0.0
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in sent]
    return max(ends) - min(r.sent_s for r in sent)


def goodput_of_offered(sent: int, effective: int, send_span_s: float,
                       single: float = 0.0) -> float:
    """Effective requests per second of offered load: the offered rate
    ((sent - 1) / send span, as ``offered_rate_rps``) times the effective
    share.  ``single``: the figure for a replay with no span (one request)."""
    if sent < 2 or send_span_s <= 0:
        return single
    return (sent - 1) / send_span_s * effective / sent


def summarize(results: list[RequestResult], slo: Slo,
              theoretical_hit_ratio: Optional[float] = None) -> dict[str, Any]:
    sent = [r for r in results if r.status != "not_sent"]
    ok = [r for r in sent if r.status == "ok"]
    by_status = {s: sum(1 for r in results if r.status == s)
                 for s in ("ok", "rejected", "error", "timeout", "not_sent")}
    duration = run_duration_s(results)
    good = [r for r in sent if slo.met(r)]
    goodput_run = len(good) / duration if duration > 0 else 0.0
    send_span = (max(r.sent_s for r in sent) - min(r.sent_s for r in sent)) if sent else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    shared = sum(r.shared_prefix_tokens for r in ok)
    server = [r.server for r in ok if "prefill_compute_s" in r.server]
    itl = [x for r in ok for x in r.intervals_s]
    out: dict[str, Any] = {
        "requests": len(results), "sent": len(sent), **by_status,
        "duration_s": duration,
        "offered_rate_rps": (len(sent) - 1) / send_span if send_span > 0 else 0.0,
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / duration
        if duration > 0 else 0.0,
        "slo": {"ttft_s": slo.ttft_s, "tbt_ms": slo.tbt_ms},
        "effective_requests": len(good),
        "effective_request_capacity": len(good) / len(sent) if sent else 0.0,
        "effective_request_capacity_at_tbt_ms": {
            str(int(ms)): (sum(1 for r in sent if slo.met(r, ms)) / len(sent) if sent else 0.0)
            for ms in TBT_SLOS_MS},
        "goodput_rps": goodput_of_offered(len(sent), len(good), send_span, goodput_run),
        "goodput_run_rps": goodput_run,
        "rejection_ratio": by_status["rejected"] / len(sent) if sent else 0.0,
        "ttft_s": stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt_s": stats([r.tbt_s for r in ok if r.tbt_s is not None]),
        "tpot_s": stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": stats(itl),
        "e2e_s": stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "send_lag_s": stats([r.send_lag_s for r in sent]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "prefill_tokens_computed": prompt - cached,
        "prefill_compute_saved": cached / prompt if prompt else 0.0,
        "shared_prefix_tokens": shared,
        "cache_hit_of_shared": cached / shared if shared else 0.0,
        "prefill_compute_s": sum(s["prefill_compute_s"] for s in server) if server else None,
        "prefill_queue_s": sum(s.get("prefill_queue_s", 0.0) for s in server) if server else None,
        "fetched_tokens": sum(s.get("fetched_tokens", 0) for s in server) if server else None,
        "server_traces": len(server),
    }
    accepted = [r for r in sent if r.status != "rejected"]
    rejected = [r for r in sent if r.status == "rejected"]
    out["accepted"] = len(accepted)
    out["accepted_in_slo"] = len(good) / len(accepted) if accepted else 0.0
    out["reject_s"] = stats([r.reject_s for r in rejected if r.reject_s is not None])
    out["rejected_with_retry_after"] = sum(1 for r in rejected if r.retry_after)
    out["prediction"] = prediction_error(ok, out["ttft_s"].get("p50"))
    if theoretical_hit_ratio is not None:
        out["theoretical_hit_ratio"] = theoretical_hit_ratio
        out["cache_hit_of_theoretical"] = (out["cache_hit_ratio"] / theoretical_hit_ratio
                                           if theoretical_hit_ratio > 0 else None)
    return out


def prefix_hit_line(summary: dict[str, Any]) -> str:
    """The replay's prefix reuse in one line: what the server reported as
    cached, against what an unbounded instant cache would have given."""
    theo = summary.get("theoretical_hit_ratio")
    line = (f"prefix hits: {summary.get('cache_hit_ratio', 0.0):.1%} of prompt tokens cached "
            f"(the server's usage.prompt_tokens_details.cached_tokens)")
    if theo is None:
        return line
    line += f"; theoretical {theo:.1%} (unbounded instant cache over the replayed slice)"
    ratio = summary.get("cache_hit_of_theoretical")
    return line + (f"; achieved / theoretical {ratio:.2f}" if ratio is not None else "")


def prediction_error(ok: list[RequestResult], ttft_p50_s: Optional[float]) -> dict[str, Any]:
    """Mean absolute predicted-vs-actual TTFT/TBT from the server's traces."""
    ttft = [(r.server["predicted_ttft_s"], r.server["ttft_s"]) for r in ok
            if "predicted_ttft_s" in r.server and "ttft_s" in r.server]
    tbt = [(r.server["predicted_tbt_s"], r.server["tbt_s"]) for r in ok
           if r.server.get("tbt_s") and "predicted_tbt_s" in r.server]
    out: dict[str, Any] = {"n": len(ttft)}
    if ttft:
        abs_err = sum(abs(p - a) for p, a in ttft) / len(ttft)
        out["ttft_mean_abs_error_s"] = abs_err
        out["ttft_mean_error_s"] = sum(p - a for p, a in ttft) / len(ttft)
        out["ttft_mean_abs_error_of_p50"] = abs_err / ttft_p50_s if ttft_p50_s else None
    # The same against the TTFT this client measured: it also holds the
    # request's and the first token's way over HTTP and this client's own
    # delays, which no server sees (a few ms on loopback, more under load).
    client = [(r.server["predicted_ttft_s"], r.ttft_s) for r in ok
              if "predicted_ttft_s" in r.server and r.ttft_s is not None]
    if client:
        abs_err = sum(abs(p - a) for p, a in client) / len(client)
        out["client_ttft_mean_abs_error_s"] = abs_err
        out["client_ttft_mean_abs_error_of_p50"] = abs_err / ttft_p50_s if ttft_p50_s else None
    if tbt:
        out["tbt_mean_abs_error_s"] = sum(abs(p - a) for p, a in tbt) / len(tbt)
        out["tbt_mean_error_s"] = sum(p - a for p, a in tbt) / len(tbt)
    return out


SERVER_CSV_FIELDS = ("predicted_ttft_s", "server_ttft_s", "predicted_queue_s", "prefill_queue_s",
                     "predicted_prefill_s", "schedule_s", "reserve_s", "prefix_load_s",
                     "kv_transfer_wait_s", "first_layer_sent_s", "prefill_rpc_s", "prefill_node_s",
                     "prefill_compute_cpu_s", "prefill_batched_ahead_s",
                     "prefill_batched_behind_s", "prefill_gave_way_s", "prefill_thread_wait_s")
CSV_FIELDS = ("index", "trace_index", "status", "http_status", "scheduled_s", "sent_s",
              "send_lag_s", "prompt_tokens", "cached_tokens", "shared_prefix_tokens",
              "max_tokens", "completion_tokens", "ttft_s", "tbt_s", "tpot_s", "e2e_s",
              "prefill_node", "decode_node", "prefill_compute_s",
              # The conductor's trace: its prediction and what it measured, per part.
              *SERVER_CSV_FIELDS, "error")


def write_csv(path: Path, results: list[RequestResult]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in results:
            row = r.to_json()
            row["prefill_compute_s"] = r.server.get("prefill_compute_s")
            for k in SERVER_CSV_FIELDS:
                row[k] = r.server.get("ttft_s" if k == "server_ttft_s" else k)
            w.writerow(["" if row[k] is None else row[k] for k in CSV_FIELDS])


def write_report(out: Path, summary: dict[str, Any], results: list[RequestResult],
                 meta: dict[str, Any], plots: bool = True) -> list[Path]:
    """summary.json (summary + run metadata), requests.json, requests.csv, PNGs."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.json", out / "requests.json", out / "requests.csv"]
    written[0].write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    written[1].write_text(json.dumps([r.to_json() for r in results]))
    write_csv(written[2], results)
    if plots:
        written.append(plot_cdfs(out / "latency_cdf.png", {"": results}, summary["slo"]))
    return written


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_cdfs(path: Path, runs: dict[str, list[RequestResult]], slo: dict[str, float],
              note: str = "shared 2-core CPU machine") -> Path:
    """TTFT and TBT CDFs, one line per run, SLOs as dashed lines."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, results in runs.items():
        ok = [r for r in results if r.status == "ok"]
        for ax, xs in ((axes[0], [r.ttft_s for r in ok]), (axes[1], [r.tbt_s * 1000 for r in ok])):
            xs = sorted(xs)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=name or None)
    axes[0].axvline(slo["ttft_s"], ls="--", c="gray")
    axes[1].axvline(slo["tbt_ms"], ls="--", c="gray")
    axes[0].set(xlabel="TTFT (s)", ylabel="share of ok requests", title="TTFT CDF")
    axes[1].set(xlabel="TBT, mean of longest 10% intervals (ms)", title="TBT CDF")
    if any(runs):
        axes[1].legend(fontsize=8)
    fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Goodput and effective request capacity against offered request rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [r["rate"] for r in rows]
    ax.plot(rates, [r["summary"]["goodput_rps"] for r in rows], "o-", label="goodput (req/s)")
    ax.plot(rates, rates, ":", c="gray", label="offered")
    ax.set(xlabel="request rate (req/s)", ylabel="req/s", title="goodput vs request rate")
    ax2 = ax.twinx()
    ax2.plot(rates, [r["summary"]["effective_request_capacity"] for r in rows], "s--", c="C1",
             label="effective request capacity")
    ax2.set(ylabel="effective share", ylim=(0, 1.05))
    fig.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
