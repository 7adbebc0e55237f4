"""Render the paper-figure PNGs from experiments' FigureData (reads data, runs nothing)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .experiments import FigureData  # noqa: E402
from .metrics import TBT_SLOS_MS  # noqa: E402
from .plots import replica_heatmap, save_png  # noqa: E402

# the summary's effective_capacity keys, one per TBT SLO
TBT_SLOS = tuple(f"tbt_{int(slo)}ms" for slo in TBT_SLOS_MS)


def _suffix(data: FigureData) -> str:
    """File-name suffix of a figure rerun on the learned basis (none for exact)."""
    basis = data.numbers.get("basis", "exact")
    return "" if basis == "exact" else f"_{basis}"


def plot_fig5(data: FigureData, out: Path) -> None:
    paper = data.numbers["paper_avg_ttft_s"]
    ours = data.numbers["ours"]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    names = list(paper)
    ax[0].bar(names, [paper[n] for n in names], color="gray")
    ax[0].set_title("paper (Conversation trace)")
    for i, rs in enumerate(("1.0", "1.5")):
        ax[i + 1].bar(names, [ours[rs][n]["ttft_avg_s"] for n in names])
        ax[i + 1].set_title(f"ours (Synthetic, 8P+8D, rate x{rs}, "
                            f"{data.numbers.get('basis', 'exact')} estimators)", fontsize=9)
    for a in ax:
        a.set_ylabel("average TTFT (s)")
        a.tick_params(axis="x", rotation=20)
    save_png(fig, out / f"sim_fig5_policies{_suffix(data)}.png")


def plot_fig9(data: FigureData, out: Path) -> None:
    d = data.numbers
    theo = d["theoretical_max"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.semilogx([c / 1e6 for c in d["capacity_tokens"]], d["lru_pool_hit_rate"], "o-",
                label="one LRU pool of this size")
    ax.axhline(theo, color="k", ls="--", label=f"theoretical max {theo:.3f}")
    ax.axvline(3, color="gray", ls=":", label="3M tokens (one node's DRAM)")
    ax.set_xlabel("cache capacity (M tokens)")
    ax.set_ylabel("hit rate (tokens)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_png(fig, out / "sim_fig9_hit_vs_capacity.png")


def plot_fig10_11(data: FigureData, out: Path) -> None:
    d = data.numbers
    runs = [d["local_load_balance"], d["local_cache_aware"], d["global"]]
    names = ["local\n(load_balance)", "local\n(cache-aware)", "global\n(mooncake)"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    ax[0].bar(names, [r["hit_rate"] for r in runs])
    ax[0].set_ylabel("hit rate")
    ax[0].set_title("paper Synthetic: global = x2.36 local", fontsize=9)
    ax[1].bar(names, [r["prefill_seconds"] for r in runs])
    ax[1].set_ylabel("total prefill node-seconds")
    ax[1].set_title("paper Synthetic: global = x0.52 local", fontsize=9)
    save_png(fig, out / "sim_fig10_global_vs_local.png")

    # three replica heatmaps (one per run) and the replica bound per use count
    fig, axes = plt.subplots(1, 4, figsize=(19, 3.8), layout="constrained",
                             gridspec_kw={"width_ratios": [1, 1, 1, 0.8]})
    for ax, (name, rep) in zip(axes, data.series["replicas"].items()):
        im = replica_heatmap(ax, rep, cmap="viridis")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("hot key rank (0 = hottest)")
        ax.set_title(f"mooncake, 10P x 3M tokens, rate x{name}", fontsize=8)
    fig.colorbar(im, ax=axes[2], label="prefill nodes holding the key")
    b = d["replica_bound"]["by_uses"]
    xs = [int(u) for u in b]
    axes[3].plot(xs, [b[str(u)]["serving_nodes"] for u in xs], "o-", ms=3,
                 label="distinct nodes that served it")
    axes[3].plot(xs, [b[str(u)]["holders_at_end"] for u in xs], "s-", ms=3,
                 label="holders at end of run")
    axes[3].set_xlabel("requests using the key (Synthetic x1.0)")
    axes[3].set_ylabel("prefill nodes (mean over keys)")
    axes[3].set_ylim(0, 10.5)
    axes[3].legend(fontsize=7)
    axes[3].grid(alpha=0.3)
    save_png(fig, out / "sim_fig11_replicas.png", tight=False)


def plot_fig15(data: FigureData, out: Path) -> None:
    d = data.numbers
    rows, cap, rate_scale = d["rows"], d["capacity"], d["rate_scale"]
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.6))
    xs = [f"{r['prefill']}P{r['decode']}D" for r in rows]
    ax[0].semilogy(xs, [r["ttft_avg_s"] for r in rows], "o-")
    ax[0].set_ylabel("avg TTFT (s)")
    ax[0].set_title(f"Synthetic x{rate_scale}", fontsize=9)
    ax[1].plot(xs, [r["tbt_avg_s"] * 1e3 for r in rows], "o-", label="avg")
    ax[1].plot(xs, [r["tbt_p90_s"] * 1e3 for r in rows], "s-", label="P90")
    ax[1].set_ylabel("TBT (ms)")
    ax[1].legend(fontsize=8)
    ax[1].set_title(f"Synthetic x{rate_scale}", fontsize=9)
    for slo in TBT_SLOS:
        ax[2].plot(xs, [r["effective_capacity"][slo] for r in rows], "o-", label=slo)
    ax[2].set_ylabel("effective request share")
    ax[2].legend(fontsize=8)
    ax[2].set_title(f"Synthetic x{rate_scale}", fontsize=9)
    for name, lab in (("synthetic", "Synthetic"),
                      ("synthetic_conversation_outputs", "outputs x343/149")):
        ax[3].plot(xs, [c["request_rate"] for c in cap[name]], "o-", label=lab)
    ax[3].set_ylabel("req/s with >= 90% effective")
    ax[3].set_title("effective request capacity (TBT 100 ms)", fontsize=9)
    ax[3].legend(fontsize=8)
    for a in ax:
        a.tick_params(axis="x", rotation=30, labelsize=8)
        a.grid(alpha=0.3)
    fig.suptitle("16 nodes, mooncake policy, no rejection")
    save_png(fig, out / "sim_fig15_pd_ratio.png")


def plot_capacity(data: FigureData, out: Path) -> None:
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    for i, slo in enumerate(TBT_SLOS):
        for name, runs in data.numbers.items():
            ax[i].plot([r["request_rate"] for r in runs],
                       [r["effective_capacity"][slo] for r in runs], "o-", label=name)
        ax[i].set_title(f"TTFT <= 30 s, TBT <= {slo[4:]}")
        ax[i].set_xlabel("request rate (req/s)")
        ax[i].set_ylabel("effective request share")
        ax[i].legend(fontsize=8)
        ax[i].grid(alpha=0.3)
    save_png(fig, out / "sim_capacity_vs_colocated.png")


def plot_peers(data: FigureData, out: Path) -> None:
    res = {k: v for k, v in data.numbers.items() if k != "basis"}
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.6))
    for i, rs in enumerate(res):
        pols = list(res[rs])
        x = range(len(pols))
        ax[i].bar([j - 0.2 for j in x], [res[rs][p]["ttft_avg_s"] for p in pols], 0.4,
                  label="avg TTFT")
        ax[i].bar([j + 0.2 for j in x], [res[rs][p]["ttft_p90_s"] for p in pols], 0.4,
                  label="P90 TTFT")
        ax[i].set_xticks(list(x), pols, rotation=20, fontsize=8)
        ax[i].set_yscale("log")
        ax[i].set_ylabel("seconds")
        ax[i].set_title(f"Synthetic x{rs}, 8P+8D", fontsize=9)
        ax[i].legend(fontsize=8)
    fig.suptitle(f"{data.numbers.get('basis', 'exact')} estimators", fontsize=9)
    save_png(fig, out / f"sim_peers{_suffix(data)}.png")


def plot_bandwidth(data: FigureData, out: Path) -> None:
    d = data.numbers
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.semilogx(d["nic_gbps"], d["ttft_avg_s"], "o-")
    ax.set_xlabel("NIC bandwidth per node (Gbps)")
    ax.set_ylabel("avg TTFT (s)")
    ax.grid(alpha=0.3)
    save_png(fig, out / "sim_bandwidth.png")


def plot_oscillation(data: FigureData, out: Path) -> None:
    """Decode load, prefill load and admissions over time, per rejection rule."""
    d = data.numbers
    labels = {"current_load": "reject on current load",
              "predicted_load": "reject on predicted load (at join)"}
    fig, ax = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True)
    for name, ser in data.series.items():
        st = d["variants"][name]
        t = ser["times_s"]
        ax[0].plot(t, [x * 1e3 for x in ser["decode_step_s"]], lw=0.9,
                   label=f"{labels[name]} (CV {st['decode_step_s']['cv']:.2f})")
        ax[1].plot(t, ser["prefill_backlog_s"], lw=0.9,
                   label=f"{labels[name]} (CV {st['prefill_backlog_s']['cv']:.2f})")
        ax[2].plot(t, ser["admitted_per_s"][:len(t)], lw=0.9, label=labels[name])
    ax[0].axhline(d["tbt_slo_ms"], color="k", ls="--", lw=0.8, label="TBT SLO")
    ax[0].set_ylabel("decode step (ms)")
    ax[1].set_ylabel("prefill backlog per node (s)")
    ax[2].set_ylabel("admitted req/s")
    ax[2].set_xlabel("simulated time (s)")
    for a in ax:
        a.legend(fontsize=7, loc="upper right")
        a.grid(alpha=0.3)
    fig.suptitle(f"early rejection under overload: {d['prefill']}P+{d['decode']}D, Synthetic "
                 f"x{d['rate_scale']}, TBT SLO {d['tbt_slo_ms']:.0f} ms, {d['basis']} estimators",
                 fontsize=9)
    save_png(fig, out / f"sim_oscillation{_suffix(data)}.png")
