"""PNG plots of one simulation run, and the two drawing helpers the figure plots reuse."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402

from .records import SimResult  # noqa: E402


def save_png(fig: Figure, path: Path, tight: bool = True) -> Path:
    """Write `fig` at 110 dpi and free it; `tight=False` for constrained-layout figures."""
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replica_heatmap(ax: Axes, replicas: dict, **imshow_kw) -> AxesImage:
    """Hot keys (rows, hottest at the bottom) x sample times, coloured by holders.

    `replicas` is SimResult.replicas: counts[t][k] = prefill nodes holding
    hot key k at times_s[t]; the colour scale spans 0 .. every prefill node.
    """
    grid = list(map(list, zip(*replicas["counts"])))  # key x time
    return ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                     extent=(replicas["times_s"][0], replicas["times_s"][-1], 0, len(grid)),
                     vmin=0, vmax=replicas["prefill_nodes"], **imshow_kw)


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
    paths.append(save_png(fig, out / "latency_cdf.png"))

    rep = res.replicas
    if rep["counts"]:
        fig, ax = plt.subplots(figsize=(8, 3.6))
        im = replica_heatmap(ax, rep)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel(f"top-{rep['hot_keys']} hot keys (rank)")
        fig.colorbar(im, label="replicas (prefill nodes holding it)")
        paths.append(save_png(fig, out / "replicas.png"))

    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = sorted(res.nodes)
    ax.bar(names, [res.nodes[n].get("prefill_busy_s", 0) + res.nodes[n].get("decode_busy_s", 0)
                   for n in names])
    ax.set_ylabel("busy seconds")
    ax.tick_params(axis="x", rotation=90)
    paths.append(save_png(fig, out / "node_load.png"))
    return paths
