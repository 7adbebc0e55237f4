"""PNG plots of one simulation run (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .engine import SimResult  # noqa: E402


def plot_run(res: SimResult, out: Path) -> list[Path]:
    """TTFT/TBT CDFs, hot-key replicas over time, per-node load."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = [r for r in res.requests if "ttft_s" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (k, label) in enumerate((("ttft_s", "TTFT (s)"), ("tbt_s", "TBT (s, paper def.)"))):
        xs = sorted(r[k] for r in rows)
        if xs:
            ax[i].plot(xs, [(j + 1) / len(xs) for j in range(len(xs))])
        ax[i].set_xlabel(label)
        ax[i].set_ylabel("CDF")
        ax[i].grid(alpha=0.3)
    fig.suptitle(f"policy={res.config['policy']}  P={res.config['prefill']} "
                 f"D={res.config['decode']}")
    fig.tight_layout()
    paths.append(out / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    rep = res.replicas
    if rep["counts"]:
        fig, ax = plt.subplots(figsize=(8, 3.6))
        grid = list(map(list, zip(*rep["counts"])))  # key x time
        im = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                       extent=(rep["times_s"][0], rep["times_s"][-1], 0, len(grid)),
                       vmin=0, vmax=rep["prefill_nodes"])
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel(f"top-{rep['hot_keys']} hot keys (rank)")
        fig.colorbar(im, label="replicas (prefill nodes holding it)")
        fig.tight_layout()
        paths.append(out / "replicas.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = sorted(res.nodes)
    ax.bar(names, [res.nodes[n].get("prefill_busy_s", 0) + res.nodes[n].get("decode_busy_s", 0)
                   for n in names])
    ax.set_ylabel("busy seconds")
    ax.tick_params(axis="x", rotation=90)
    fig.tight_layout()
    paths.append(out / "node_load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
