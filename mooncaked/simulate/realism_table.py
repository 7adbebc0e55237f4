"""Print the exact-vs-learned tables of docs/simulation.md from sim_figures.json.

`python -m mooncaked.simulate.realism_table [docs/img/sim_figures.json]`

Reads what `figures --only fig5,fig5_learned,peers,peers_learned,oscillation,
oscillation_learned` wrote (runs nothing) and prints Markdown: per run, each
policy's average TTFT on both bases, the prediction error on the learned
one, and Mooncake's margin over the best other policy.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .experiments import mooncake_margin


def _policy_rows(exact: dict, learned: dict, runs: list[str], extra: str = "") -> list[str]:
    lines = []
    head = "| policy | " + " | ".join(
        f"x{r}: exact avg TTFT | x{r}: learned avg TTFT (mean abs / p90 abs error)"
        for r in runs) + (f" | {extra}" if extra else "") + " |"
    lines.append(head)
    lines.append("|" + "---|" * (1 + 2 * len(runs) + (1 if extra else 0)))
    for p in exact[runs[0]]:
        cells = []
        for r in runs:
            e, le = exact[r][p], learned[r][p]
            err = le["prediction_error"]
            cells += [f"{e['ttft_avg_s']:.2f} s",
                      f"{le['ttft_avg_s']:.2f} s ({err['ttft_mean_abs_s']:.2f} / "
                      f"{err['ttft_p90_abs_s']:.2f} s)"]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    cells = []
    for r in runs:
        for res in (exact[r], learned[r]):
            m = mooncake_margin(res)
            cells.append(f"{m['margin']:+.0%} vs {m['best_other']}")
    lines.append("| **mooncake's margin** | " + " | ".join(cells) + " |")
    return lines


def tables(data: dict) -> str:
    out = []
    if "fig5" in data and "fig5_learned" in data:
        out.append("Fig. 5 (8P+8D, no rejection): average TTFT")
        out += _policy_rows(data["fig5"]["ours"], data["fig5_learned"]["ours"], ["1.0", "1.5"])
        out.append("")
    if "peers" in data and "peers_learned" in data:
        out.append("Peer routers (8P+8D): average TTFT")
        out += _policy_rows(data["peers"], data["peers_learned"], ["1.0", "2.0", "2.0+reject"])
        out.append("")
        out.append("| policy | x2.0+reject eff.100ms exact | learned | rejected exact | learned |")
        out.append("|---|---|---|---|---|")
        for p, e in data["peers"]["2.0+reject"].items():
            le = data["peers_learned"]["2.0+reject"][p]
            out.append(f"| {p} | {e['effective_capacity']['tbt_100ms']:.1%} | "
                       f"{le['effective_capacity']['tbt_100ms']:.1%} | {e['rejected']} | "
                       f"{le['rejected']} |")
        out.append("")
    for name in ("oscillation", "oscillation_learned"):
        if name not in data:
            continue
        d = data[name]
        out.append(f"{name}: {d['prefill']}P+{d['decode']}D, x{d['rate_scale']}, "
                   f"TBT SLO {d['tbt_slo_ms']:.0f} ms, {d['basis']} estimators")
        out.append("| rejection rule | decode step mean / CV | decode batch CV | "
                   "prefill backlog mean / CV | rejected | accepted in both SLOs (paper TBT / mean "
                   "interval) | "
                   "goodput req/s | TTFT mean abs error |")
        out.append("|---|---|---|---|---|---|---|---|")
        for v, s in d["variants"].items():
            out.append(
                f"| {v} | {s['decode_step_s']['mean'] * 1e3:.1f} ms / "
                f"{s['decode_step_s']['cv']:.3f} | {s['decode_batch']['cv']:.3f} | "
                f"{s['prefill_backlog_s']['mean']:.2f} s / {s['prefill_backlog_s']['cv']:.3f} | "
                f"{s['rejected']} of {s['requests']} | {s['accepted_in_slo']:.1%} / "
                f"{s.get('accepted_in_slo_mean_tbt', 0.0):.1%} | "
                f"{s['goodput_req_s']:.2f} | "
                f"{s['prediction_error']['ttft_mean_abs_s']:.2f} s |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "docs/img/sim_figures.json")
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; run `python -m mooncaked.simulate.figures` first")
    print(tables(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
