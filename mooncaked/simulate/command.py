"""`mooncaked simulate`: the CLI front of the simulator."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .config import SimConfig
from .engine import run_simulation
from .records import SimResult


def write_outputs(res: SimResult, out: Path, plots: bool = True) -> list[Path]:
    """result.json (summary, per-node, replicas, per-request) + PNG plots."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "result.json"
    path.write_text(json.dumps(res.to_json(), indent=1))
    written = [path]
    if plots:
        from .plots import plot_run
        written += plot_run(res, out)
    return written


def register(app: typer.Typer) -> None:
    """Add the `simulate` command to the project CLI."""

    @app.command("simulate", help="Replay a trace on a simulated cluster (16-512 nodes) "
                 "through the real scheduler and a cost model; see docs/simulation.md.")
    def simulate(
        trace: Path = typer.Option(..., help="Mooncake-format JSONL trace"),
        prefill: int = typer.Option(8, help="prefill nodes (colocated: all nodes)"),
        decode: int = typer.Option(8, help="decode nodes (ignored for colocated)"),
        policy: str = typer.Option("mooncake", help="mooncake | local_cache_aware | "
                                   "load_balance | random | round_robin | sglang_cache_aware"
                                   " | dynamo_kv | llmd_weighted | colocated"),
        cache_tokens_per_node: int = typer.Option(3_000_000, help="store capacity per "
                                                  "prefill node in tokens; -1 = unbounded"),
        model_profile: str = typer.Option("llama3-70b-8xa800",
                                          help="llama3-70b-8xa800 | llama3-70b-8xh800 | FILE"),
        nic_gbps: float = typer.Option(0.0, help="per-node NIC Gbps (0 = the profile's)"),
        ttft_slo: float = typer.Option(30.0, help="TTFT SLO, seconds"),
        tbt_slo: float = typer.Option(100.0, help="TBT SLO, milliseconds"),
        rate_scale: float = typer.Option(1.0, help="multiply the trace's request rate"),
        threshold: float = typer.Option(1.0, help="kvcache_balancing_threshold"),
        reject: bool = typer.Option(False, help="early rejection on predicted SLO miss"),
        max_requests: int = typer.Option(0, help="replay only the first N (0 = all)"),
        out: Optional[Path] = typer.Option(None, help="write result.json and PNGs here"),
        plots: bool = typer.Option(True, help="write PNG plots with --out"),
        estimators: str = typer.Option("exact", help="exact: the scheduler is handed the cost "
                                       "model's formulas | learned: it fits them from measured "
                                       "times only, starting 2x off"),
        noise_sigma: float = typer.Option(0.0, help="sigma of a mean-one lognormal factor on "
                                          "every measured prefill, decode step and KV pull"),
        slow_nodes: str = typer.Option("", help="nodes slower than modelled, e.g. p0=1.5,d0=1.3 "
                                       "(the scheduler is not told)"),
        heartbeat_interval: float = typer.Option(0.0, help="load report period, s (0 = none)"),
        heartbeat_delay: float = typer.Option(0.0, help="age of a load report on arrival, s"),
        event_delay: float = typer.Option(0.0, help="delay of cache events to the index, s"),
        reject_on_current_load: bool = typer.Option(
            False, help="baseline: reject on the decode load nodes last reported, not on the "
            "load predicted at join (needs --heartbeat-interval)"),
    ) -> None:
        try:
            cfg = SimConfig(trace=str(trace), prefill=prefill, decode=decode, policy=policy,
                            cache_tokens_per_node=cache_tokens_per_node,
                            model_profile=model_profile, nic_gbps=nic_gbps,
                            ttft_slo_s=ttft_slo, tbt_slo_ms=tbt_slo, rate_scale=rate_scale,
                            kvcache_balancing_threshold=threshold, reject=reject,
                            max_requests=max_requests, out=str(out or ""),
                            estimators=estimators, noise_sigma=noise_sigma,
                            node_slowdown=_slow_nodes(slow_nodes),
                            heartbeat_interval_s=heartbeat_interval,
                            heartbeat_delay_s=heartbeat_delay, event_delay_s=event_delay,
                            reject_on_current_load=reject_on_current_load)
            res = run_simulation(cfg)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        if out is not None:
            write_outputs(res, out, plots)
        typer.echo(json.dumps(res.summary, indent=1))


def _slow_nodes(spec: str) -> dict[str, float]:
    """"p0=1.5,d0=1.3" -> {"p0": 1.5, "d0": 1.3}."""
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        node, sep, factor = item.partition("=")
        try:
            out[node.strip()] = float(factor)
        except ValueError:
            sep = ""
        if not sep or not node.strip():
            raise ValueError(f"--slow-nodes: expected NODE=FACTOR, got {item!r}")
    return out
