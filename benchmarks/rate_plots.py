"""One figure of benchmark rows by offered rate: a column per trace, a row
per metric, a line per server (user_compare.py, engine_compare.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from mooncaked.benchserve.session import MACHINE_NOTE

TTFT_SLO_MS = 1000.0
ITL_SLO_MS = 150.0


def plot_by_rate(path: Path, rows: list[dict[str, Any]], series: str,
                 panels: list[tuple[str, str]]) -> None:
    """``series``: the row key naming a line (server, router); ``panels``:
    (row key, title).  SLO lines under TTFT and ITL panels, the theoretical
    ratio under a prefix-hit panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    fig, axes = plt.subplots(len(panels), len(traces), squeeze=False,
                             figsize=(4.2 * len(traces), 3.1 * len(panels)))
    for j, trace in enumerate(traces):
        for i, (key, title) in enumerate(panels):
            ax = axes[i][j]
            for name in names:
                pts = [(r["offered_rps"], r[key]) for r in rows
                       if r["trace"] == trace and r[series] == name and r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=name)
            if key == "ttft_p90_ms":
                ax.axhline(TTFT_SLO_MS, color="grey", linestyle=":")
                ax.set_yscale("log")
            if key == "itl_p90_ms":
                ax.axhline(ITL_SLO_MS, color="grey", linestyle=":")
            if key == "prefix_hit_ratio":
                theo = [r["theoretical_hit_ratio"] for r in rows if r["trace"] == trace]
                ax.axhline(theo[0], color="grey", linestyle="--", label="theoretical")
                ax.set_ylim(0, 1.05)
            ax.set_title(f"{trace}: {title}", fontsize=9)
            ax.set_xlabel("offered rate (req/s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(textwrap.fill(MACHINE_NOTE, 70), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
