"""Draw docs/img/architecture.png: mooncaked's roles and the KV path.

    .venv/bin/python docs/img/architecture.py        # rewrites architecture.png beside it
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("architecture.png")

CONDUCTOR = "#dbe8f7"
PREFILL = "#fde3c8"
DECODE = "#d9f0d3"
STORE = "#f3f3f3"
KV = "#c0392b"
CTRL = "#34495e"


def box(ax, x, y, w, h, title, lines, color, title_size=12):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15",
                                fc=color, ec="#555555", lw=1.2, zorder=2))
    ax.text(x + w / 2, y + h - 0.28, title, ha="center", va="top", fontsize=title_size,
            weight="bold", zorder=3)
    ax.text(x + w / 2, y + h - 0.72, "\n".join(lines), ha="center", va="top", fontsize=9,
            linespacing=1.35, zorder=3)


def arrow(ax, a, b, label="", color=CTRL, style="-|>", lw=1.6, ls="-", rad=0.0,
          label_at=0.5, dx=0.0, dy=0.0, size=8.5, ha="center"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=14, color=color, lw=lw,
                                 linestyle=ls, connectionstyle=f"arc3,rad={rad}", zorder=4))
    if label:
        x = a[0] + (b[0] - a[0]) * label_at + dx
        y = a[1] + (b[1] - a[1]) * label_at + dy
        ax.text(x, y, label, ha=ha, va="center", fontsize=size, color=color, zorder=5,
                bbox=dict(fc="white", ec="none", pad=1.0, alpha=0.9))


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 7.2), dpi=130)
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 7.2)
    ax.axis("off")

    # Client and conductor.
    box(ax, 0.2, 5.3, 2.0, 1.4, "client", ["OpenAI API", "(curl, openai SDK)"], "white")
    box(ax, 3.4, 5.0, 5.2, 1.9, "conductor", [
        "OpenAI-compatible API  ·  global cache index",
        "Algorithm 1: prefill node by predicted TTFT",
        "(queue + prefix transfer + compute), decode by TBT",
        "predicted SLO miss  →  429 at once",
    ], CONDUCTOR)

    # Legend, top right.
    ax.plot([9.1, 9.6], [6.55, 6.55], color=CTRL, lw=1.6)
    ax.text(9.7, 6.55, "control path (HTTP)", va="center", fontsize=9, color=CTRL)
    ax.plot([9.1, 9.6], [6.15, 6.15], color=KV, lw=2.6)
    ax.text(9.7, 6.15, "KV path (transfer engine:\nTCP, or RDMA where present)", va="center",
            fontsize=9, color=KV)

    # The store pool behind the workers.
    ax.add_patch(FancyBboxPatch((0.2, 0.15), 11.6, 3.85, boxstyle="round,pad=0.02,rounding_size=0.2",
                                fc=STORE, ec="#999999", lw=1.0, ls="--", zorder=1))
    ax.text(6.0, 0.42, "KV store: every worker's spare DRAM pooled into one cache of "
            "hash-chained blocks  (key(i) = xxh3(key(i-1) ‖ tokens of block i))",
            ha="center", va="center", fontsize=9.5, style="italic", color="#444444", zorder=3)

    box(ax, 0.6, 1.55, 3.0, 2.0, "prefill node A", [
        "store shard: prefix cached", "model computes only the", "uncached suffix"], PREFILL)
    box(ax, 4.5, 1.55, 3.0, 2.0, "prefill node B", [
        "store shard: holds a", "longer prefix", "(pulled copies stay: hot", "prefixes replicate)"],
        PREFILL)
    box(ax, 8.6, 1.55, 3.0, 2.0, "decode node", [
        "store shard = page pool", "pages reserved per request", "continuous batching"], DECODE)

    # Control path.
    arrow(ax, (2.2, 6.2), (3.4, 6.2), "① request")
    arrow(ax, (3.4, 5.55), (2.2, 5.55), "⑦ tokens (SSE)\nor 429")
    arrow(ax, (4.6, 5.0), (2.6, 3.55), "③ prefill (pages,\nprefix plan)\n→ first token",
          label_at=0.5, dx=-0.45)
    arrow(ax, (7.9, 5.0), (9.4, 3.55), "② reserve\npages", label_at=0.5, dx=-0.45)
    arrow(ax, (10.6, 3.55), (8.6, 5.3), "⑥ token stream", label_at=0.45, dx=0.85)
    arrow(ax, (5.6, 3.55), (5.9, 5.0), "cache events\n→ index", color="#7f8c8d", ls="--",
          label_at=0.5, dx=0.1, size=8)

    # KV path.
    arrow(ax, (4.5, 2.55), (3.6, 2.55), "④ READ\n(one-sided)", color=KV, lw=2.2,
          label_at=0.5, dy=0.45, size=8.5)
    ax.plot([2.1, 2.1, 10.1], [1.55, 0.95, 0.95], color=KV, lw=2.6, zorder=4,
            solid_joinstyle="round")
    arrow(ax, (10.1, 0.95), (10.1, 1.55), color=KV, lw=2.6)
    ax.text(6.0, 1.15, "⑤ each layer's KV WRITTEN into the decode node's reserved pages "
            "while the next layer computes", ha="center", va="center", fontsize=8.5, color=KV,
            zorder=5, bbox=dict(fc=STORE, ec="none", pad=1.0))

    fig.tight_layout(pad=0.3)
    fig.savefig(OUT)
    print(OUT)


if __name__ == "__main__":
    main()
