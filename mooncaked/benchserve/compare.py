"""``bench compare``: one trace slice against several configurations of our
own system, one after the other on the same machine, each on a fresh local
cluster (cold caches), in one invocation; one table and one plot with
ratios against the first configuration.

Named configurations (``PRESETS``):

- ``mooncake`` — disaggregated prefill/decode, global cache, Algorithm 1
  with cache load balancing (the paper's system);
- ``colocated_prefix_cache`` — colocated nodes (prefill and decode on one
  worker), each with its own local prefix cache, load-balanced: vLLM with
  prefix caching behind a load balancer;
- ``colocated_no_cache`` — the same with prefix reuse off: plain vLLM;
- ``random``, ``load_balance``, ``local_cache_aware`` — the disaggregated
  cluster under the other scheduling policies (the paper's Table 1 set;
  ``mooncake`` is the fourth).

A ``Target`` may also be any server the caller starts and stops (the vLLM
comparison script does that), so external peers land in the same table.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from mooncaked.benchserve.isolated import IsolatedClient
from mooncaked.benchserve.replay import ReplayConfig, run_replay
from mooncaked.benchserve.report import Slo, plot_cdfs
from mooncaked.benchserve.session import MACHINE_NOTE, BenchRun, run_bench
from mooncaked.benchserve.workload import ReplayRequest, scaled_prompt


@dataclass(frozen=True)
class Preset:
    layout: str                     # disaggregated | colocated
    overrides: tuple[str, ...]
    description: str


PRESETS: dict[str, Preset] = {
    "mooncake": Preset("disaggregated", ("conductor.policy=mooncake",),
                       "disaggregated, global cache, Algorithm 1"),
    "colocated_prefix_cache": Preset("colocated", ("conductor.policy=load_balance",),
                                     "colocated, local prefix cache (vLLM+prefix caching-like)"),
    "colocated_no_cache": Preset("colocated", ("conductor.policy=load_balance",
                                               "prefill.prefix_cache=false"),
                                 "colocated, no prefix reuse (plain vLLM-like)"),
    "random": Preset("disaggregated", ("conductor.policy=random",),
                     "disaggregated, random scheduling"),
    "load_balance": Preset("disaggregated", ("conductor.policy=load_balance",),
                           "disaggregated, load-balancing scheduling"),
    "local_cache_aware": Preset("disaggregated", ("conductor.policy=local_cache_aware",),
                                "disaggregated, local cache-aware scheduling"),
}
DEFAULT_CONFIGS = ("mooncake", "colocated_prefix_cache", "colocated_no_cache", "random",
                   "load_balance", "local_cache_aware")


@dataclass
class ClusterShape:
    prefill: int = 2
    decode: int = 1
    colocated: int = 3              # colocated nodes (default: as many workers as P + D)
    model: str = "dummy"
    overrides: list[str] = field(default_factory=list)   # --set for every node
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.colocated < 1:
            raise ValueError("prefill, decode and colocated must be >= 1")
        if not self.start_timeout_s > 0:
            raise ValueError("start_timeout_s must be > 0")


@dataclass
class Target:
    """Something to replay against: ``start()`` returns its URL, ``stop()`` ends it."""
    name: str
    description: str
    start: Callable[[], str]
    stop: Callable[[], None]


def cluster_target(name: str, shape: ClusterShape, log_dir: Optional[Path] = None) -> Target:
    """A preset as a Target; every start() launches a fresh cluster (cold caches)."""
    from mooncaked.local_cluster import LocalCluster

    if name not in PRESETS:
        raise ValueError(f"configs: unknown configuration {name!r} "
                         f"(known: {', '.join(PRESETS)})")
    preset = PRESETS[name]
    colocated = preset.layout == "colocated"
    nodes = (f"{shape.colocated} colocated" if colocated
             else f"{shape.prefill}P+{shape.decode}D")
    state: dict[str, LocalCluster] = {}
    starts = [0]

    def start() -> str:
        starts[0] += 1
        logs = log_dir / name / f"start_{starts[0]}" if log_dir else None
        cluster = LocalCluster(prefill=shape.colocated if colocated else shape.prefill,
                               decode=0 if colocated else shape.decode, model=shape.model,
                               overrides=[*shape.overrides, *preset.overrides], log_dir=logs)
        if colocated:
            cluster.role_of_workers = ("colocated", "decode")
        state["cluster"] = cluster
        try:
            cluster.start(timeout_s=shape.start_timeout_s)
        except Exception:
            stop()
            raise
        return cluster.url

    def stop() -> None:
        cluster = state.pop("cluster", None)
        if cluster is not None:
            cluster.stop()

    return Target(name, f"{preset.description} ({nodes})", start, stop)


def warmup_requests(n: int, length: int, block_tokens: int, vocab_size: int,
                    reserved: int) -> list[ReplayRequest]:
    """Requests from hash ids no trace uses (>= 2**40): they warm the
    servers' code paths without putting any of the trace's prefixes in cache."""
    out = []
    for i in range(n):
        ids = tuple(2**40 + i * 1000 + j for j in range(-(-length // 512)))
        prompt = scaled_prompt(ids, length, block_tokens, vocab_size, reserved)
        out.append(ReplayRequest(i, -1, 0.0, tuple(int(t) for t in prompt), 4, ids,
                                 block_tokens))
    return out


def run_compare(targets: list[Target], reqs: list[ReplayRequest], replay: ReplayConfig,
                slo: Slo, out: Optional[Path], plots: bool = True, progress: bool = True,
                *, client: IsolatedClient, warmup: list[ReplayRequest] | None = None,
                rounds: int = 1) -> dict[str, Any]:
    """Each target in turn: start, warm up, replay ``reqs``, stop; ``rounds``
    times, the order rotated each round so that no configuration always runs
    first (on a shared machine the load drifts).  The table gives medians
    over rounds; ratios are against the first target.  The replays run in
    ``client``'s process (isolated.py)."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")

    runs: dict[str, list[BenchRun]] = {t.name: [] for t in targets}
    for rnd in range(rounds):
        order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
        for target in order:
            print(f"== round {rnd + 1}/{rounds} {target.name}: {target.description}: starting",
                  file=sys.stderr, flush=True)
            sub = None
            if out is not None:
                sub = out / target.name / f"round_{rnd + 1}" if rounds > 1 else out / target.name
            t0 = time.monotonic()
            url = target.start()
            try:
                cfg = ReplayConfig(**{**replay.__dict__, "url": url})
                if warmup:
                    client.call(run_replay,
                                ReplayConfig(**{**cfg.__dict__, "server_traces": False}), warmup)
                runs[target.name].append(client.call(
                    run_bench, reqs, cfg, slo, sub, plots, progress, label=target.name,
                    extra_meta={"config": target.description, "round": rnd + 1,
                                "start_s": time.monotonic() - t0,
                                "client": client.weight.describe()}))
            finally:
                target.stop()
    table = comparison_table(runs, {t.name: t.description for t in targets})
    result = {"note": MACHINE_NOTE, "slo": {"ttft_s": slo.ttft_s, "tbt_ms": slo.tbt_ms},
              "requests": len(reqs), "rounds": rounds, "rows": table}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(result, indent=1))
        (out / "compare.md").write_text(markdown_table(table) + "\n")
        if plots:
            plot_compare(out / "compare.png", table)
            plot_cdfs(out / "compare_cdf.png",
                      {k: [r for run in v for r in run.results] for k, v in runs.items()},
                      result["slo"], MACHINE_NOTE)
    return result


# Columns of the table: (key, header, format); "x" columns are ratios vs the first row.
COLUMNS = (
    ("name", "config", "{}"),
    ("ok_of_sent", "ok/sent", "{}"),
    ("rejected", "429", "{:g}"),
    ("ttft_mean_s", "TTFT mean s", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.2f}"),
    ("tbt_p90_ms", "TBT p90 ms", "{:.0f}"),
    ("effective_request_capacity", "effective", "{:.0%}"),
    ("goodput_rps", "goodput req/s", "{:.3f}"),
    ("cache_hit_ratio", "cache hit", "{:.1%}"),
    ("prefill_tokens_computed", "prefill tokens", "{:.0f}"),
    ("prefill_compute_s", "prefill compute s", "{:.1f}"),
    ("x_goodput", "goodput x", "{:.2f}"),
    ("x_ttft_mean", "TTFT x", "{:.2f}"),
    ("x_prefill_compute", "prefill compute x", "{:.2f}"),
)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _row(run: BenchRun) -> dict[str, Any]:
    s = run.summary
    return {
        "ok": s["ok"], "sent": s["sent"], "rejected": s["rejected"],
        "errors": s["error"] + s["timeout"],
        "ttft_mean_s": s["ttft_s"].get("mean"), "ttft_p90_s": s["ttft_s"].get("p90"),
        "tbt_p90_ms": s["tbt_s"]["p90"] * 1000 if s["tbt_s"].get("n") else None,
        "effective_request_capacity": s["effective_request_capacity"],
        "goodput_rps": s["goodput_rps"], "cache_hit_ratio": s["cache_hit_ratio"],
        "theoretical_hit_ratio": s.get("theoretical_hit_ratio"),
        "prefill_compute_s": s["prefill_compute_s"],
        "prefill_tokens_computed": s["prefill_tokens_computed"],
    }


def _median(xs: list[Any]) -> Any:
    vals = sorted(x for x in xs if x is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def comparison_table(runs: dict[str, list[BenchRun]], descriptions: dict[str, str]
                     ) -> list[dict[str, Any]]:
    """One row per configuration: the median of each figure over its rounds
    (the per-round figures are kept under ``rounds``)."""
    rows = []
    for name, name_runs in runs.items():
        per_round = [_row(run) for run in name_runs]
        row: dict[str, Any] = {"name": name, "description": descriptions.get(name, "")}
        for key in per_round[0]:
            row[key] = _median([r[key] for r in per_round])
        row["ok_of_sent"] = "/".join(str(sum(r[k] for r in per_round)) for k in ("ok", "sent"))
        row["rounds"] = per_round
        rows.append(row)
    if rows:
        base = rows[0]
        for r in rows:
            r["x_goodput"] = _ratio(r["goodput_rps"], base["goodput_rps"])
            r["x_ttft_mean"] = _ratio(r["ttft_mean_s"], base["ttft_mean_s"])
            r["x_prefill_compute"] = _ratio(r["prefill_compute_s"], base["prefill_compute_s"])
            r["x_cache_hit"] = _ratio(r["cache_hit_ratio"], base["cache_hit_ratio"])
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_compare(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Grouped bars: each metric of each config divided by the first config's."""
    from mooncaked.benchserve.report import _pyplot

    plt = _pyplot()
    metrics = (("goodput_rps", "goodput"), ("effective_request_capacity", "effective share"),
               ("cache_hit_ratio", "cache hit ratio"),
               ("prefill_tokens_computed", "prefill tokens computed"),
               ("prefill_compute_s", "prefill compute s"),
               ("ttft_mean_s", "mean TTFT"))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 2), 4))
    width = 0.8 / len(metrics)
    base = rows[0]
    for j, (key, label) in enumerate(metrics):
        ys = [_ratio(r.get(key), base.get(key)) or 0.0 for r in rows]
        ax.bar([i + (j - (len(metrics) - 1) / 2) * width for i in range(len(rows))], ys,
               width, label=label)
    ax.axhline(1.0, c="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=15, fontsize=8)
    ax.set(ylabel=f"ratio to {base['name']}", title="bench compare (same trace slice)")
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, MACHINE_NOTE, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
