"""The report's three figures, rendered with matplotlib (Agg) to PNG bytes.

1. perplexity delta (percent) per configuration with its paired-bootstrap 95% CI;
2. TTFT against prompt length, cold and with a prefix-cache hit;
3. per-layer K and V scales (or amax, when the scales directory has a
   ``calibration.json``), one line per statically scaled configuration, with
   the spread over kv heads shaded.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["ppl_delta_figure", "ttft_figure", "scales_figure"]

DPI = 90
plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.grid": True, "grid.alpha": 0.3})


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def ppl_delta_figure(accuracy: dict, baseline: str, max_ppl_delta: float | None = None) -> bytes:
    labels = [k for k in accuracy if k != baseline]
    fig, ax = plt.subplots(figsize=(9, 0.55 * max(len(labels), 1) + 1.6))
    if not labels:
        ax.text(0.5, 0.5, "only the baseline was evaluated", ha="center", va="center", transform=ax.transAxes)
        return _png(fig)
    y = list(range(len(labels)))[::-1]
    d = [accuracy[k]["ppl_delta_pct"] for k in labels]
    # a percentile interval from few windows may not contain the point estimate: clamp the bars at 0
    lo = [max(accuracy[k]["ppl_delta_pct"] - accuracy[k]["ppl_delta_pct_ci95"][0], 0.0) for k in labels]
    hi = [max(accuracy[k]["ppl_delta_pct_ci95"][1] - accuracy[k]["ppl_delta_pct"], 0.0) for k in labels]
    ax.errorbar(d, y, xerr=[lo, hi], fmt="o", color="tab:blue", ecolor="tab:blue", capsize=5, ms=7)
    for yi, di in zip(y, d):
        ax.annotate(f"{di:+.2f}%", (di, yi), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    ax.axvline(0.0, color="black", lw=1)
    if max_ppl_delta is not None:
        ax.axvline(max_ppl_delta, color="tab:red", ls="--", lw=1.2, label=f"gate {max_ppl_delta:g}%")
        ax.legend(loc="lower right")
    ax.set_yticks(y, labels)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel(f"perplexity change vs {baseline} (%), paired-bootstrap 95% CI")
    ax.set_title("Perplexity delta per KV-cache configuration")
    return _png(fig)


def ttft_figure(latency: dict | None) -> bytes:
    fig, ax = plt.subplots(figsize=(9, 4.6))
    if not latency:
        ax.text(
            0.5, 0.5, "latency was not measured (--ttft-lengths none)", ha="center", va="center", transform=ax.transAxes
        )
        return _png(fig)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, lat) in enumerate(latency.items()):
        lengths = sorted(int(L) for L in lat["ttft"])
        c = colors[i % len(colors)]
        ax.plot(lengths, [lat["ttft"][str(L)]["cold"]["median_ms"] for L in lengths], "o-", color=c, label=f"{label}")
        ax.plot(lengths, [lat["ttft"][str(L)]["prefix_hit"]["median_ms"] for L in lengths], "s--", color=c, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title("Time to first token: solid = cold, dashed = prefix-cache hit")
    ax.legend(fontsize=9, ncol=2)
    return _png(fig)


def scales_figure(scales: dict) -> bytes:
    """``scales``: label -> {"quantity": "scale"|"amax", "source": ..., "k": [[per head] | None], "v": ...}."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.4), sharex=True)
    if not scales:
        for ax in axes:
            ax.text(
                0.5,
                0.5,
                "no statically scaled configuration (bf16, dynamic per-token-head modes only)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=10,
            )
        return _png(fig)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    quantities = {s["quantity"] for s in scales.values()}
    for ax, which in zip(axes, ("k", "v")):
        for i, (label, s) in enumerate(scales.items()):
            rows = [(li, vals) for li, vals in enumerate(s[which]) if vals]
            if not rows:
                continue
            x = [li for li, _ in rows]
            mean = [sum(v) / len(v) for _, v in rows]
            c = colors[i % len(colors)]
            ax.plot(x, mean, "o-", ms=4, color=c, label=f"{label} ({s['quantity']}, {s['source']})")
            if any(len(v) > 1 for _, v in rows):
                ax.fill_between(x, [min(v) for _, v in rows], [max(v) for _, v in rows], color=c, alpha=0.18)
        ax.set_yscale("log")
        ax.set_ylabel(f"{which.upper()} {'/'.join(sorted(quantities))}")
        ax.set_title(f"{'Key' if which == 'k' else 'Value'} cache, per layer (band: min..max over kv heads)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("layer")
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig)
