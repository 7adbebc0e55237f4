"""Goodput against offered rate: mooncaked (as ``mooncaked up`` runs it) and
vLLM's CPU build, on the same checkpoint and trace slice, at several multiples
of the trace's own rate.

    .venv/bin/python benchmarks/rate_sweep.py --rates 1,2,4 --out /tmp/sweep

For every rate and every server: a fresh server (cold cache), warmed on
the ``--warmup`` requests that follow the slice in the trace, at the same rate
and with hash ids moved so they share no block with the slice (the kernels,
buffers and fitted estimators see the slice's shapes; its cache hits stay its
own), then the slice replayed at that rate (arrival = trace timestamp / rate).
Servers alternate within a rate, so machine drift hits both.  mooncaked is started through the real ``mooncaked up``
command line (``--up-args``, default: its defaults), so what is measured is
the layout, block size and store size ``up`` picks for this machine, with
only ``--ttft-slo-s``/``--tbt-slo-ms`` set to the SLOs the run is judged by.  vLLM: ``vllm_compare.vllm_target`` (its venv is built
on first use, about 3.5 GB).

Writes sweep.json, sweep.md and sweep.png (goodput, in-SLO share of accepted
requests, TTFT p90 and ITL p90 against the offered rate) under ``--out``.  A
heavy benchmark, not a test; figures on a shared 2-core machine are relative.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mooncaked.benchserve.compare import Target  # noqa: E402
from mooncaked.benchserve.isolated import CLIENT_NICE, IsolatedClient  # noqa: E402
from mooncaked.benchserve.replay import ReplayConfig, run_replay  # noqa: E402
from mooncaked.benchserve.report import Slo  # noqa: E402
from mooncaked.benchserve.session import MACHINE_NOTE, run_bench  # noqa: E402
from mooncaked.benchserve.workload import WorkloadConfig, build_workload, warmup_slice  # noqa: E402
from vllm_compare import (ensure_vllm_venv, prepare_checkpoint,  # noqa: E402
                          vllm_target)


def log(msg: str) -> None:
    print(f"[rate_sweep] {msg}", file=sys.stderr, flush=True)


def up_target(model_dir: Path, up_args: list[str], log_dir: Path, start_timeout_s: float,
              served_model_name: str | None = "model", name: str = "mooncaked") -> Target:
    """``mooncaked up --model DIR --log-dir ... UP_ARGS`` as a subprocess (with
    ``--served-model-name`` unless None); its printed ``API:`` line is the URL."""
    state: dict[str, Any] = {}
    starts = [0]

    def start() -> str:
        starts[0] += 1
        logs = log_dir / f"up_{starts[0]}"
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [str(ROOT / ".venv" / "bin" / "mooncaked"), "up", "--model", str(model_dir),
               *(["--served-model-name", served_model_name] if served_model_name else []),
               "--log-dir", str(logs), *up_args]
        err = (logs / "up.stderr").open("wb")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        state["proc"] = proc
        found: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                if line.startswith("API: ") and not found:
                    found.append(line.split(None, 1)[1].strip())

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline and not found:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncaked up exited with {proc.returncode}; see {logs}")
            time.sleep(0.2)
        if not found:
            stop()
            raise RuntimeError(f"mooncaked up not ready in {start_timeout_s}s; see {logs}")
        return found[0]

    def stop() -> None:
        proc = state.pop("proc", None)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGINT)   # up's Ctrl-C path stops every node
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    return Target(name, f"mooncaked up --model M {shlex.join(up_args) or '(defaults)'}",
                  start, stop)


def server_targets(wanted: list[str], model_dir: Path, max_len: int, block_tokens: int,
                   args: argparse.Namespace) -> list[Target]:
    """The servers named in ``wanted`` (mooncaked, vllm) on one checkpoint;
    ``args`` carries up_args, ttft_slo (s), tbt_slo (ms), out, workdir and
    vllm_start_timeout.  mooncaked is started as a user starts it, plus the
    SLO flags the benchmark judges by (``--ttft-slo-s``, ``--tbt-slo-ms``)
    and whatever ``--up-args`` says: no hidden ``--set`` (its block size and
    store size are up's defaults; ``block_tokens``, the replay's tokens per
    hash id, is not passed to it)."""
    del block_tokens
    targets: list[Target] = []
    if "mooncaked" in wanted:
        up_args = shlex.split(args.up_args) + [
            "--ttft-slo-s", f"{args.ttft_slo:g}", "--tbt-slo-ms", f"{args.tbt_slo:g}"]
        targets.append(up_target(model_dir, up_args, args.out / "logs", 240.0))
    if "vllm" in wanted:
        python = ensure_vllm_venv(args.workdir / "venv-vllm")
        targets.append(vllm_target(python, model_dir, max_len, args.out / "logs" / "vllm.log",
                                   args.vllm_start_timeout))
    return targets


def _ms(stat: dict[str, Any] | None, key: str) -> float | None:
    """``stat[key]`` (seconds, from report.stats) in ms; None for no samples."""
    return (stat[key] or 0) * 1e3 if stat and stat.get("n") else None


def headline(rate: float, name: str, s: dict[str, Any]) -> dict[str, Any]:
    pred = s.get("prediction") or {}
    return {
        "rate_x": rate, "server": name, "offered_rps": s["offered_rate_rps"],
        "sent": s["sent"], "ok": s.get("ok", 0), "rejected": s.get("rejected", 0),
        "accepted": s.get("accepted"),
        "in_slo_of_accepted": s.get("accepted_in_slo") if s.get("accepted") else None,
        # Per second of offered load (report.py); an older summary without
        # goodput_run_rps holds the run-time figure there: derived again from
        # the offered rate and the effective share, which it also holds.
        "goodput_rps": s["goodput_rps"] if "goodput_run_rps" in s
        else s["offered_rate_rps"] * s["effective_request_capacity"],
        "effective_request_capacity": s["effective_request_capacity"],
        "ttft_p50_s": s["ttft_s"].get("p50"), "ttft_p90_s": s["ttft_s"].get("p90"),
        "itl_p50_ms": _ms(s["itl_s"], "p50"), "itl_p90_ms": _ms(s["itl_s"], "p90"),
        # ITL as aiperf (and the issue's own measurements) compute it: per
        # request, (e2e - TTFT) / (tokens - 1).  The figure above takes every
        # token interval on its own, so a server that hands a whole output
        # over in one burst after a stall scores near 0 there.
        "itl_req_p50_ms": _ms(s["tpot_s"], "p50"), "itl_req_p90_ms": _ms(s["tpot_s"], "p90"),
        "ttft_mae_of_p50": pred.get("ttft_mean_abs_error_of_p50"),
        "client_ttft_mae_of_p50": pred.get("client_ttft_mean_abs_error_of_p50"),
        # How far behind its schedule the client sent (send_lag_s): a client
        # starved by a server that fills every core offers it a lower,
        # burstier rate and reads its tokens late (client_lag_warnings).
        "send_lag_p90_ms": _ms(s.get("send_lag_s"), "p90"),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    out = ["| rate | server | offered req/s | ok/sent | 429 | in SLO of accepted | goodput req/s "
           "| effective | TTFT p50 / p90 s | ITL p50 / p90 ms (intervals) "
           "| ITL p50 / p90 ms (per request, aiperf's) | TTFT MAE / p50 (server / client) "
           "| client send lag p90 ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['rate_x']:g}x | {r['server']} | {r['offered_rps']:.2f} | {r['ok']}/{r['sent']} "
            f"| {r['rejected']} | {f(r['in_slo_of_accepted'], '.1%')} | {r['goodput_rps']:.2f} "
            f"| {r['effective_request_capacity']:.1%} | {f(r['ttft_p50_s'], '.2f')} / "
            f"{f(r['ttft_p90_s'], '.2f')} | {f(r['itl_p50_ms'], '.1f')} / {f(r['itl_p90_ms'], '.1f')} "
            f"| {f(r.get('itl_req_p50_ms'), '.1f')} / {f(r.get('itl_req_p90_ms'), '.1f')} "
            f"| {f(r['ttft_mae_of_p50'], '.0%')} / {f(r.get('client_ttft_mae_of_p50'), '.0%')} "
            f"| {f(r.get('send_lag_p90_ms'), '.1f')} |")
    return "\n".join(out)


# A run whose client sent 10% of its requests this late or later is flagged:
# measured on this machine, a client beside vLLM filling both cores lagged
# 0.1-1.1 s at p90, against 1-35 ms beside mooncaked.
SEND_LAG_WARN_MS = 50.0


def client_lag_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run whose client fell behind its schedule: that server
    was offered a lower, burstier rate than the others and its tokens were
    read late, so its figures there are not comparable."""
    return [f"warning: at {r['rate_x']:g}x the client sent to {r['server']} late "
            f"(send lag p90 {r['send_lag_p90_ms']:.0f} ms): it could not keep its schedule "
            f"beside that server, whose figures there are understated"
            for r in rows if (r.get("send_lag_p90_ms") or 0) > SEND_LAG_WARN_MS]


# The paper's effective request capacity: the highest offered rate at which
# at least this share of requests (sent, rejections counting as misses) meets
# both SLOs.
CAPACITY_SHARE = 0.9


def capacity(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per server: the highest swept rate (req/s) with >= CAPACITY_SHARE of its
    requests in both SLOs; None when no swept rate reaches it.  Only rates
    swept count, so the figure is a lower bound at the sweep's resolution."""
    out: dict[str, float | None] = {}
    for r in rows:
        out.setdefault(r["server"], None)
        if r["effective_request_capacity"] >= CAPACITY_SHARE:
            best = out[r["server"]]
            out[r["server"]] = max(best or 0.0, r["offered_rps"])
    return out


def plot(path: Path, rows: list[dict[str, Any]], slo: Slo) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    panels = [("goodput_rps", "goodput (req/s in both SLOs)", None),
              ("in_slo_of_accepted", "share of accepted in both SLOs", None),
              ("ttft_p90_s", "TTFT p90 (s)", slo.ttft_s),
              ("itl_req_p90_ms", "ITL p90 (ms, per request)", slo.tbt_ms),
              ("itl_p90_ms", "ITL p90 (ms, token intervals)", slo.tbt_ms)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title, limit) in zip(axes, panels):
        for name in servers:
            pts = [(r["offered_rps"], r[key]) for r in rows if r["server"] == name
                   and r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        if limit is not None:
            ax.axhline(limit, color="grey", linestyle=":", label="SLO")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(MACHINE_NOTE, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mooncaked-vllm")
    ap.add_argument("--model-dir", type=Path, help="HF checkpoint (default: build a random one)")
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces"
                                           / "synthetic_trace.jsonl"))
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-requests", type=int, default=150)
    ap.add_argument("--rates", default="1,2,4", help="multiples of the trace's own rate")
    ap.add_argument("--length-scale", type=float, default=1 / 16,
                    help="tokens per trace token (1/16: 32 token ids per 512-token block)")
    ap.add_argument("--max-output-tokens", type=int, default=16)
    ap.add_argument("--ttft-slo", type=float, default=1.0)
    ap.add_argument("--tbt-slo", type=float, default=150.0)
    ap.add_argument("--up-args", default="", help="extra `mooncaked up` arguments, one string")
    ap.add_argument("--servers", default="mooncaked,vllm")
    ap.add_argument("--warmup", type=int, default=40,
                    help="warm-up requests: the ones after the slice, at the same rate, hash "
                         "ids moved so they share no block with it")
    ap.add_argument("--max-duration", type=float, default=240.0)
    ap.add_argument("--vllm-start-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mooncaked-rate-sweep"))
    ap.add_argument("--client-nice", type=int, default=CLIENT_NICE,
                    help="autogroup nice of the benchmark client, which runs in a session of "
                         "its own so that it keeps its schedule beside a server that fills "
                         "every core (lowering it needs root; 0: the default weight)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild sweep.json/md/png under --out from the "
                         "summaries an earlier sweep wrote there (rate_*/SERVER/summary.json)")
    args = ap.parse_args(argv)
    if args.report_only:
        rows = rows_from(args.out)
        if not rows:
            raise SystemExit(f"no rate_*/*/summary.json under {args.out}")
        write_sweep(args.out, rows, Slo(args.ttft_slo, args.tbt_slo), sys.argv[1:])
        return 0

    model_dir, vocab, max_len, reserved = prepare_checkpoint(args.model_dir, args.workdir)
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    slo = Slo(args.ttft_slo, args.tbt_slo)
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    block_tokens = round(512 * args.length_scale)
    targets = server_targets(wanted, model_dir, max_len, block_tokens, args)
    rows: list[dict[str, Any]] = []
    with IsolatedClient(args.client_nice) as client:
        log(f"benchmark client: {client.weight.describe()}")
        for i, rate in enumerate(rates):
            rows += sweep_rate(i, rate, targets, client, vocab, max_len, reserved, slo, args)
    write_sweep(args.out, rows, slo, sys.argv[1:])
    return 0


def sweep_rate(i: int, rate: float, targets: list[Target], client: IsolatedClient,
               vocab: int, max_len: int, reserved: int, slo: Slo,
               args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every server at one rate: started fresh, warmed, measured, stopped;
    the replays run in ``client``'s process."""
    wl = WorkloadConfig(trace=args.trace, offset=args.offset, max_requests=args.max_requests,
                        time_scale=1.0 / rate, length_scale=args.length_scale,
                        output_scale=1.0, max_output_tokens=args.max_output_tokens,
                        vocab_size=vocab, reserved_tokens=reserved)
    reqs = build_workload(wl)
    warm = warmup_slice(wl, args.warmup)
    longest = max(len(r.prompt) + r.max_tokens for r in reqs)
    if longest > max_len:
        raise SystemExit(f"the slice needs {longest} tokens of context; the model has {max_len}")
    rows = []
    order = targets[i % len(targets):] + targets[:i % len(targets)]
    for target in order:
        log(f"rate {rate:g}x: {target.description}: starting")
        url = target.start()
        try:
            replay = ReplayConfig(url=url, model="model", max_duration_s=args.max_duration,
                                  request_timeout_s=args.max_duration,
                                  server_traces=target.name == "mooncaked")
            client.call(run_replay, ReplayConfig(**{**replay.__dict__, "server_traces": False}),
                        warm)
            run = client.call(run_bench, reqs, replay, slo,
                              args.out / f"rate_{rate:g}" / target.name, plots=False,
                              progress=False, label=target.name,
                              extra_meta={"client": client.weight.describe()})
        finally:
            target.stop()
        row = headline(rate, target.name, run.summary)
        rows.append(row)
        log(json.dumps(row))
    return rows


def rows_from(out: Path) -> list[dict[str, Any]]:
    """The headline rows of a sweep written under ``out``, by rate (servers in
    the order they ran there)."""
    rows = []
    rates = sorted((float(d.name[len("rate_"):]), d) for d in out.glob("rate_*"))
    for rate, rate_dir in rates:
        for f in sorted(rate_dir.glob("*/summary.json"), key=lambda f: f.stat().st_mtime):
            rows.append(headline(rate, f.parent.name, json.loads(f.read_text())["summary"]))
    return rows


def write_sweep(out: Path, rows: list[dict[str, Any]], slo: Slo, argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    caps = capacity(rows)
    (out / "sweep.json").write_text(json.dumps(
        {"note": MACHINE_NOTE, "argv": argv, "slo": {"ttft_s": slo.ttft_s, "tbt_ms": slo.tbt_ms},
         "rows": rows, "effective_request_capacity_rps": caps}, indent=1))
    table = markdown(rows) + "\n\n" + "\n".join(
        f"effective request capacity ({CAPACITY_SHARE:.0%} of requests in both SLOs), {name}: "
        + (f"{cap:.2f} req/s" if cap is not None else "below the lowest swept rate")
        for name, cap in caps.items())
    warnings = client_lag_warnings(rows)
    if warnings:
        table += "\n\n" + "\n".join(warnings)
    (out / "sweep.md").write_text(table + "\n")
    plot(out / "sweep.png", rows, slo)
    print(table)
    print(MACHINE_NOTE)
    print(f"written: {out / 'sweep.json'}, {out / 'sweep.png'}")


if __name__ == "__main__":
    raise SystemExit(main())
