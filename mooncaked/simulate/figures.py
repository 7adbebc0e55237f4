"""Reproduce the paper's simulation-friendly figures on a trace (the CLI).

`python -m mooncaked.simulate.figures --trace FILE --out docs/img [--only fig5,...]`

Writes docs/img/sim_*.png and sim_figures.json (every number plotted).
Each figure is an experiment (experiments.py: a handful of `run_simulation`
calls, returning data) and a renderer (figure_plots.py: PNGs from that data).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from . import experiments as ex
from . import figure_plots as fp
from .trace import TraceRequest, load_trace

Experiment = Callable[[list[TraceRequest]], ex.FigureData]
Renderer = Callable[[ex.FigureData, Path], None]

# in the order a run without --only makes them
FIGURES: dict[str, tuple[Experiment, Renderer]] = {
    "fig5": (ex.fig5, fp.plot_fig5),
    "fig9": (ex.fig9, fp.plot_fig9),
    "fig10_11": (ex.fig10_11, fp.plot_fig10_11),
    "fig15": (ex.fig15, fp.plot_fig15),
    "capacity": (ex.capacity, fp.plot_capacity),
    "peers": (ex.peers, fp.plot_peers),
    "bandwidth": (ex.bandwidth, fp.plot_bandwidth),
    # the same on a scheduler that learns from measurements (experiments.LEARNED)
    "fig5_learned": (partial(ex.fig5, basis="learned"), fp.plot_fig5),
    "peers_learned": (partial(ex.peers, basis="learned"), fp.plot_peers),
    # early rejection on current vs predicted load (the paper's oscillation)
    "oscillation": (partial(ex.oscillation, basis="exact"), fp.plot_oscillation),
    "oscillation_learned": (partial(ex.oscillation, basis="learned"), fp.plot_oscillation),
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="reproduce the paper's figures in simulation")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--only", default="", help="comma list of " + ",".join(FIGURES))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(a.trace)
    todo = [f for f in a.only.split(",") if f] or list(FIGURES)
    path = out / "sim_figures.json"
    # figures not rerun keep their numbers from an earlier run
    result = json.loads(path.read_text()) if path.is_file() else {}
    for name in todo:
        if name not in FIGURES:
            raise SystemExit(f"--only: unknown figure {name!r}")
        experiment, render = FIGURES[name]
        t = time.perf_counter()
        data = experiment(trace)
        render(data, out)
        result[name] = {**data.numbers, "wall_s": round(time.perf_counter() - t, 1)}
        print(f"{name}: {result[name]['wall_s']} s", flush=True)
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
