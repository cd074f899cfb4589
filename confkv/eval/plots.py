"""PNG plots for the evals (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MARKERS = "osD^v<>PX*"


def frontier_plot(results: dict, out: str | Path, metric: str = "ppl") -> Path:
    """Perplexity (or accuracy) vs peak KV MiB: one marker per policy, named in a legend (points of
    policies at the same bytes overlap, so labels next to them would too); log x so that ``full``
    does not squeeze the rest into one corner."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (spec, r) in enumerate(results.items()):
        x, y = r["peak_kv_bytes"] / 2**20, r[metric]
        ax.scatter([x], [y], s=46, marker=MARKERS[i % len(MARKERS)], color=colors[i % len(colors)],
                   alpha=0.85, label=f"{spec}: {y:.2f} at {x:.1f} MiB", zorder=3)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("peak KV cache (MiB, exact stored bytes, log scale)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs peak KV bytes ({'lower' if metric == 'ppl' else 'higher'} is better)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def unsure_steps(budgets: list[int | None]) -> list[bool]:
    """Steps at the high budget (the model was unsure); none when the budget never changes."""
    known = [b for b in budgets if b is not None]
    if not known or min(known) == max(known):
        return [False] * len(budgets)
    high = max(known)
    return [b == high for b in budgets]


def trace_plot(trace: list[dict], out: str | Path, marker: int | None = None, title: str = "") -> Path:
    """Confidence, budget and cache size per step; ``marker`` = step where the question arrives.

    The budget is drawn as a step line over a shaded band marking the unsure steps (high budget),
    with their share in the label: a per-step bar of two values reads as a solid barcode."""
    plt = _pyplot()
    steps = [t["step"] for t in trace]
    budgets = [t["budget"] for t in trace]
    unsure = unsure_steps(budgets)
    share = sum(unsure) / len(unsure) if unsure else 0.0
    fig, axes = plt.subplots(3, 1, figsize=(8, 6), sharex=True)
    axes[0].plot(steps, [t["confidence"] for t in trace], lw=0.6)
    axes[0].set_ylabel("confidence", fontsize=8)
    known = [b if b is not None else float("nan") for b in budgets]
    axes[1].step(steps, known, where="post", lw=1.0, color="C1")
    if any(unsure):
        axes[1].fill_between(steps, 0, 1, where=unsure, step="post", color="C3", alpha=0.25, lw=0,
                             transform=axes[1].get_xaxis_transform(),
                             label=f"unsure (high budget): {share:.0%} of steps")  # fmt: skip
        axes[1].legend(fontsize=7, loc="lower right")
    axes[1].set_ylabel("budget (tokens/layer)", fontsize=8)
    axes[2].plot(steps, [t["kv_bytes"] / 2**20 for t in trace], lw=0.8)
    axes[2].set_ylabel("KV MiB", fontsize=8)
    for ax in axes:
        if marker is not None:
            ax.axvline(marker, color="red", ls="--", lw=0.8)
    axes[-1].set_xlabel("token (red: the question starts)")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def scatter_plot(
    x: list[float], y: list[float], out: str | Path, xlabel: str, ylabel: str, title: str
) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter(x, y, s=6, alpha=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
