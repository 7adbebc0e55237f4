"""CLI: ``mooncaked bench serve``, ``mooncaked bench compare``, ``mooncaked trace-gen``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from mooncaked.benchserve.compare import (DEFAULT_CONFIGS, PRESETS, ClusterShape,
                                          cluster_target, markdown_table, run_compare,
                                          warmup_requests)
from mooncaked.benchserve.isolated import CLIENT_NICE, IsolatedClient
from mooncaked.benchserve.replay import ReplayConfig
from mooncaked.benchserve.report import Slo, plot_sweep, prefix_hit_line
from mooncaked.benchserve.session import MACHINE_NOTE, headline, run_bench
from mooncaked.benchserve.tracegen import TraceGenConfig, describe, generate, write_trace
from mooncaked.benchserve.workload import WorkloadConfig, build_workload


# Options that `bench serve` and `bench compare` share, declared once.
OFFSET = typer.Option(0, help="Skip the first N requests of the trace.")
POISSON = typer.Option(False, help="Poisson arrivals at --rate.")
OUTPUT_SCALE = typer.Option(0.0, help="Scale output lengths by this instead (0 = --length-scale).")
MAX_OUTPUT_TOKENS = typer.Option(0, help="Cap max_tokens (0 = no cap).")
TTFT_SLO = typer.Option(30.0, help="TTFT SLO, seconds.")
TBT_SLO = typer.Option(200.0, help="TBT SLO, milliseconds.")
VOCAB_SIZE = typer.Option(256, help="Prompt token ids are < this.")
RESERVED_TOKENS = typer.Option(0, help="Prompt token ids are >= this.")


CLIENT_NICE_HELP = ("Autogroup nice of the replay client, which runs in a session of its own "
                    "so that it keeps its schedule beside a server that fills every core "
                    "(below 0 needs root; 0: the default weight).")


def _rates(text: str) -> list[float]:
    if not text:
        return []
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"rate: {text!r} is not a comma-separated list of numbers") from None
    if any(not r > 0 for r in rates):
        raise ValueError("rate: every rate must be > 0")
    return rates


def serve(url: str, trace: Path, time_scale: float, max_requests: int, offset: int, rate: str,
          poisson: bool, length_scale: float, output_scale: float, max_output_tokens: int, ttft_slo: float,
          tbt_slo: float, out: Optional[Path], max_duration: float, request_timeout: float,
          model: str, vocab_size: int, reserved_tokens: int, seed: int, plots: bool,
          progress: bool, server_traces: bool, client: IsolatedClient) -> dict[str, Any]:
    """Replay once (no --rate or one rate) or sweep over several rates, each
    replay in ``client``'s process."""
    slo = Slo(ttft_slo, tbt_slo)
    replay = ReplayConfig(url=url, model=model, max_duration_s=max_duration,
                          request_timeout_s=request_timeout, server_traces=server_traces)
    rates = _rates(rate)
    if poisson and not rates:
        raise ValueError("--poisson needs --rate")
    common = dict(trace=str(trace), max_requests=max_requests, offset=offset,
                  time_scale=time_scale, length_scale=length_scale,
                  output_scale=output_scale, max_output_tokens=max_output_tokens, vocab_size=vocab_size,
                  reserved_tokens=reserved_tokens, seed=seed)
    arrival = "poisson" if poisson else "rate"
    if len(rates) <= 1:
        wl = WorkloadConfig(**common, arrival=arrival if rates else "trace",
                            rate=rates[0] if rates else 0.0)
        run = client.call(run_bench, wl, replay, slo, out, plots, progress)
        return run.summary
    # A sweep replays the same slice at each rate against the same server, so
    # caches are warm after the first rate; restart the server between rates
    # (or use bench compare) when that matters.
    rows = []
    for r in rates:
        wl = WorkloadConfig(**common, arrival=arrival, rate=r)
        sub = out / f"rate_{r:g}" if out else None
        run = client.call(run_bench, wl, replay, slo, sub, plots, progress,
                          label=f"rate {r:g}/s")
        rows.append({"rate": r, "summary": run.summary})
    if out:
        (out / "sweep.json").write_text(json.dumps({"note": MACHINE_NOTE, "rates": rows},
                                                   indent=1))
        if plots:
            plot_sweep(out / "goodput_vs_rate.png", rows)
    return {"sweep": [{"rate": r["rate"], **headline(r["summary"])} for r in rows]}


def register(bench: typer.Typer, app: typer.Typer) -> None:
    """Add ``serve`` and ``compare`` to the ``bench`` sub-app and ``trace-gen`` to ``app``."""

    @bench.command("serve")
    def serve_cmd(
        url: str = typer.Option(..., help="Server base URL (conductor or any OpenAI server)."),
        trace: Path = typer.Option(..., help="Mooncake-format JSONL trace."),
        time_scale: float = typer.Option(1.0, help="Arrival = trace timestamp x this "
                                         "(< 1 compresses time)."),
        max_requests: int = typer.Option(0, help="Replay at most N requests (0 = all)."),
        offset: int = OFFSET,
        rate: str = typer.Option("", help="Requests/s instead of trace timestamps; a "
                                 "comma-separated list sweeps over rates."),
        poisson: bool = POISSON,
        length_scale: float = typer.Option(1.0, help="Scale prompt and output lengths "
                                           "(each hash id -> round(512 x this) tokens)."),
        output_scale: float = OUTPUT_SCALE,
        max_output_tokens: int = MAX_OUTPUT_TOKENS,
        ttft_slo: float = TTFT_SLO,
        tbt_slo: float = TBT_SLO,
        out: Optional[Path] = typer.Option(None, help="Write summary.json, requests.json/.csv "
                                           "and PNG plots here."),
        max_duration: float = typer.Option(600.0, help="Bound on the whole run, seconds."),
        request_timeout: float = typer.Option(300.0, help="Bound on one request, seconds."),
        model: str = typer.Option("", help="Model name (default: the server's first)."),
        vocab_size: int = VOCAB_SIZE,
        reserved_tokens: int = RESERVED_TOKENS,
        seed: int = typer.Option(0, help="Seed of Poisson arrivals."),
        plots: bool = typer.Option(True, help="Write PNG plots with --out."),
        progress: bool = typer.Option(True, help="Live progress bar on stderr."),
        server_traces: bool = typer.Option(True, help="Fetch the conductor's per-request "
                                           "timing (/admin/requests/{id})."),
        client_nice: int = typer.Option(CLIENT_NICE, help=CLIENT_NICE_HELP),
    ) -> None:
        """Replay a Mooncake trace against a server: TTFT, TBT, goodput, cache hits."""
        try:
            with IsolatedClient(client_nice) as client:
                typer.echo(f"replay client: {client.weight.describe()}", err=True)
                summary = serve(url, trace, time_scale, max_requests, offset, rate, poisson,
                                length_scale, output_scale, max_output_tokens, ttft_slo, tbt_slo,
                                out, max_duration, request_timeout, model, vocab_size,
                                reserved_tokens, seed, plots, progress, server_traces, client)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except RuntimeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(json.dumps({"note": MACHINE_NOTE, **summary}, indent=1))
        for row in summary.get("sweep") or [summary]:
            typer.echo((f"rate {row['rate']:g}/s: " if "rate" in row else "")
                       + prefix_hit_line(row), err=True)

    @bench.command("compare")
    def compare_cmd(
        trace: Path = typer.Option(..., help="Mooncake-format JSONL trace."),
        configs: str = typer.Option(",".join(DEFAULT_CONFIGS), help="Comma-separated, first "
                                    "is the baseline of the ratios: " + ", ".join(PRESETS)),
        prefill: int = typer.Option(2, help="Prefill nodes of disaggregated configs."),
        decode: int = typer.Option(1, help="Decode nodes of disaggregated configs."),
        colocated: int = typer.Option(3, help="Nodes of colocated configs."),
        model: str = typer.Option("dummy", help="Model every node serves."),
        overrides: list[str] = typer.Option([], "--set", help="Config override for every node "
                                            "(repeatable); store.block_size defaults to the "
                                            "scaled trace block."),
        time_scale: float = typer.Option(1.0, help="Arrival = trace timestamp x this."),
        max_requests: int = typer.Option(100, help="Replay at most N requests (0 = all)."),
        offset: int = OFFSET,
        rate: float = typer.Option(0.0, help="Requests/s instead of trace timestamps."),
        poisson: bool = POISSON,
        length_scale: float = typer.Option(1 / 32, help="Scale prompt and output lengths."),
        output_scale: float = OUTPUT_SCALE,
        max_output_tokens: int = MAX_OUTPUT_TOKENS,
        ttft_slo: float = TTFT_SLO,
        tbt_slo: float = TBT_SLO,
        out: Optional[Path] = typer.Option(None, help="Write compare.json/.md, plots and "
                                           "each run's report here."),
        max_duration: float = typer.Option(300.0, help="Bound on each run, seconds."),
        request_timeout: float = typer.Option(120.0, help="Bound on one request, seconds."),
        warmup: int = typer.Option(2, help="Untimed requests (unrelated prompts) per config."),
        rounds: int = typer.Option(1, help="Run every config this many times, order rotated "
                                   "each round; the table shows medians."),
        vocab_size: int = VOCAB_SIZE,
        reserved_tokens: int = RESERVED_TOKENS,
        seed: int = typer.Option(0, help="Seed of Poisson arrivals."),
        log_dir: Optional[Path] = typer.Option(None, help="Node logs (default: temp dirs)."),
        plots: bool = typer.Option(True, help="Write PNG plots with --out."),
        progress: bool = typer.Option(True, help="Live progress bar on stderr."),
        client_nice: int = typer.Option(CLIENT_NICE, help=CLIENT_NICE_HELP),
    ) -> None:
        """Replay one trace slice against several local cluster configurations."""
        try:
            names = [c.strip() for c in configs.split(",") if c.strip()]
            if not names:
                raise ValueError("configs: name at least one configuration")
            wl = WorkloadConfig(trace=str(trace), max_requests=max_requests, offset=offset,
                                time_scale=time_scale,
                                arrival=("poisson" if poisson else "rate") if rate else "trace",
                                rate=rate, length_scale=length_scale,
                                output_scale=output_scale, max_output_tokens=max_output_tokens, vocab_size=vocab_size,
                                reserved_tokens=reserved_tokens, seed=seed)
            if poisson and not rate:
                raise ValueError("--poisson needs --rate")
            sets = list(overrides)
            if not any(s.startswith("store.block_size=") for s in sets):
                sets.append(f"store.block_size={wl.block_tokens}")
            shape = ClusterShape(prefill, decode, colocated, model, sets)
            targets = [cluster_target(n, shape, log_dir) for n in names]
            reqs = build_workload(wl)
            slo = Slo(ttft_slo, tbt_slo)
            replay = ReplayConfig(url="http://unused", max_duration_s=max_duration,
                                  request_timeout_s=request_timeout)
            warm = warmup_requests(warmup, 2048, wl.block_tokens, vocab_size, reserved_tokens)
            with IsolatedClient(client_nice) as client:
                typer.echo(f"replay client: {client.weight.describe()}", err=True)
                result = run_compare(targets, reqs, replay, slo, out, plots, progress,
                                     client=client, warmup=warm, rounds=rounds)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except RuntimeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(markdown_table(result["rows"]))
        typer.echo(MACHINE_NOTE)
        if out:
            typer.echo(f"written: {out / 'compare.json'}, {out / 'compare.md'}"
                       + (f", {out / 'compare.png'}" if plots else ""))

    @app.command("trace-gen")
    def trace_gen_cmd(
        out: Path = typer.Option(..., help="JSONL file to write."),
        requests: int = typer.Option(1000, help="Requests in the trace."),
        rate: float = typer.Option(1.0, help="New sessions / questions / one-offs per second."),
        seed: int = typer.Option(0, help="Random seed."),
        chat_share: float = typer.Option(0.5, help="Share of arrivals that start a chat."),
        doc_share: float = typer.Option(0.3, help="Share that ask about a long document."),
        system_prompts: int = typer.Option(4, help="Shared system prompts."),
        system_prompt_tokens: int = typer.Option(2048, help="Tokens per system prompt."),
        turns_mean: float = typer.Option(4.0, help="Mean chat turns per session."),
        think_time: float = typer.Option(20.0, help="Mean seconds between a session's turns."),
        user_tokens: int = typer.Option(600, help="Mean new user tokens per request."),
        output_tokens: int = typer.Option(200, help="Mean output tokens."),
        documents: int = typer.Option(10, help="Distinct long documents."),
        document_tokens: int = typer.Option(16384, help="Tokens per document."),
        max_input_tokens: int = typer.Option(131072, help="A chat ends before passing this."),
        arrival_cv: float = typer.Option(1.0, help="Coefficient of variation of the gaps "
                                         "between arrivals: 1 = Poisson, above 1 = bursty."),
        annotate: bool = typer.Option(False, help="Add kind/session/turn/doc/system fields."),
    ) -> None:
        """Write a Mooncake-format trace with shared system prompts, chats and documents."""
        try:
            cfg = TraceGenConfig(requests, rate, seed, chat_share, doc_share, system_prompts,
                                 system_prompt_tokens, turns_mean, think_time, user_tokens,
                                 output_tokens, documents, document_tokens, max_input_tokens,
                                 arrival_cv)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        records = generate(cfg, annotate)
        write_trace(out, records)
        typer.echo(json.dumps({"written": str(out), **describe(records)}, indent=1))
