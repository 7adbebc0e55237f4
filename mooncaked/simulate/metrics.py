"""Turn a finished simulation into per-request records and a summary."""
from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from roles.scheduling.estimators import paper_tbt  # noqa: F401 (the metric, for this package's users)

from .records import SimResult

if TYPE_CHECKING:
    from roles.scheduling import Scheduler

    from .config import SimConfig
    from .costmodel import CostModel
    from .records import DecodeNode, PrefillNode, Req

TBT_SLOS_MS = (100.0, 200.0, 300.0)


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs: the sorted sample at index round(q * (n - 1)); 0.0 if empty."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class FinishedRun(Protocol):
    """What build_result reads from a run whose event loop has drained.

    engine.Simulation is one; naming the fields here rather than importing
    the engine keeps the dependency one way (engine -> metrics).
    """

    cfg: SimConfig
    cost: CostModel
    scheduler: Scheduler
    reqs: list[Req]
    prefills: dict[str, PrefillNode]
    decodes: dict[str, DecodeNode]
    hot: list[int]  # the sampled hot keys, hottest first
    replica_samples: list[tuple[float, list[int]]]  # (time, holders per hot key)
    # (time, mean prefill backlog s, mean decode batch, mean decode step s)
    load_samples: list[tuple[float, float, float, float]]
    transfer_bytes: int


def prediction_error(rows: list[dict]) -> dict:
    """How far the scheduler's predictions were from what happened, per served request.

    TTFT: predicted at dispatch vs measured (first token - arrival); TBT:
    predicted at dispatch vs the request's mean token interval. Signed
    means are predicted - actual (negative: optimistic). The mean absolute
    TTFT error is also given relative to the measured TTFT p50 (issue 14's
    yardstick).
    """
    ttft = [r["predicted_ttft_s"] - r["ttft_s"] for r in rows if "ttft_s" in r]
    tbt = [r["predicted_tbt_s"] - r["tbt_mean_s"] for r in rows
           if "ttft_s" in r and r["tbt_mean_s"] > 0]
    p50 = pct([r["ttft_s"] for r in rows if "ttft_s" in r], 0.5)
    out = {"count": len(ttft)}
    for name, errs in (("ttft", ttft), ("tbt", tbt)):
        n = len(errs)
        out[f"{name}_mean_s"] = sum(errs) / n if n else 0.0
        out[f"{name}_mean_abs_s"] = sum(abs(e) for e in errs) / n if n else 0.0
        out[f"{name}_p90_abs_s"] = pct([abs(e) for e in errs], 0.9)
    out["ttft_mean_abs_over_p50"] = out["ttft_mean_abs_s"] / p50 if p50 > 0 else 0.0
    return out


def build_result(sim: FinishedRun, wall_s: float) -> SimResult:
    """Per-request rows, the run's summary, per-node load and replica samples."""
    cfg = sim.cfg
    cost = sim.cost
    rows = []
    ttfts, tbts = [], []
    prefix = local = xfer = tokens = 0
    used_s = full_s = 0.0
    for r in sim.reqs:
        row = {"id": r.t.index, "arrival_s": r.t.arrival_s, "input": r.t.input_length,
               "output": r.t.output_length}
        if r.rejected:
            row["rejected"] = r.rejected
            rows.append(row)
            continue
        ttft = r.first_token - r.t.arrival_s
        tbt = paper_tbt(r.intervals)
        d = r.decision
        row.update(ttft_s=ttft, tbt_s=tbt, prefill=d.prefill_node, decode=d.decode_node,
                   prefix_tokens=r.prefix_tokens, local_prefix_tokens=r.local_prefix_tokens,
                   transferred_tokens=r.transferred_tokens, predicted_ttft_s=d.predicted_ttft_s,
                   predicted_tbt_s=d.predicted_tbt_s,
                   tbt_mean_s=sum(r.intervals) / len(r.intervals) if r.intervals else 0.0,
                   prefill_s=r.prefill_s)
        rows.append(row)
        ttfts.append(ttft)
        tbts.append(tbt)
        prefix += r.prefix_tokens
        local += r.local_prefix_tokens
        xfer += r.transferred_tokens
        tokens += r.t.input_length
        used_s += r.prefill_s
        full_s += cost.prefill_s(r.t.input_length, 0)
    n = len(sim.reqs)
    served = len(ttfts)
    effective = {}
    for slo in TBT_SLOS_MS:
        ok = sum(1 for row in rows if "ttft_s" in row and row["ttft_s"] <= cfg.ttft_slo_s
                 and row["tbt_s"] <= slo / 1000)
        effective[f"tbt_{int(slo)}ms"] = ok / n if n else 0.0
    span = (max(r.t.arrival_s for r in sim.reqs) - min(r.t.arrival_s for r in sim.reqs)) \
        if sim.reqs else 0.0
    sim_end = max((r.done_at for r in sim.reqs), default=0.0)
    summary = {
        "requests": n, "served": served, "rejected": n - served,
        "rejections": dict(sim.scheduler.rejections),
        "request_rate": (n - 1) / span if span > 0 else 0.0,
        "ttft_avg_s": sum(ttfts) / served if served else 0.0,
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p90_s": pct(ttfts, 0.9),
        "ttft_p99_s": pct(ttfts, 0.99),
        "tbt_avg_s": sum(tbts) / served if served else 0.0,
        "tbt_p90_s": pct(tbts, 0.9), "tbt_p99_s": pct(tbts, 0.99),
        "hit_rate": prefix / tokens if tokens else 0.0,
        "local_hit_rate": local / tokens if tokens else 0.0,
        "transferred_token_share": xfer / tokens if tokens else 0.0,
        "transfer_bytes": sim.transfer_bytes,
        "prefill_seconds": used_s,
        "prefill_seconds_without_reuse": full_s,
        "prefill_compute_saved": 1 - used_s / full_s if full_s else 0.0,
        "effective_capacity": effective,
        "estimator_error": sim.scheduler.estimator_error(),
        "prediction_error": prediction_error(rows),
        # Decode-side load, to tell whether decode ever binds (P/D ratio):
        # the largest batch any decode node ran, and the mean share of the
        # run its nodes spent stepping (a node steps whenever it holds work).
        "decode_max_batch": max((d.max_batch for d in sim.decodes.values()), default=0),
        "decode_busy_share": (sum(d.busy_s for d in sim.decodes.values())
                              / (len(sim.decodes) * sim_end)) if sim.decodes and sim_end > 0
        else 0.0,
        "simulated_seconds": sim_end,
        "wall_seconds": wall_s,
        "simulated_requests_per_wall_s": n / wall_s if wall_s > 0 else 0.0,
    }
    nodes = {nid: {"prefill_busy_s": p.busy_s, "prefill_requests": p.served,
                   "cached_blocks": len(p.store)} for nid, p in sim.prefills.items()}
    for nid, d in sim.decodes.items():
        nodes.setdefault(nid, {}).update(decode_busy_s=d.busy_s, decode_steps=d.steps,
                                         max_batch=d.max_batch)
    replicas = {"hot_keys": len(sim.hot), "prefill_nodes": len(sim.prefills),
                "times_s": [t for t, _ in sim.replica_samples],
                "counts": [c for _, c in sim.replica_samples]}
    load = {"times_s": [s[0] for s in sim.load_samples],
            "prefill_backlog_s": [s[1] for s in sim.load_samples],
            "decode_batch": [s[2] for s in sim.load_samples],
            "decode_step_s": [s[3] for s in sim.load_samples]}
    return SimResult(asdict(cfg), summary, rows, replicas, nodes, load)
