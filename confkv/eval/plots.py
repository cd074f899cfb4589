"""PNG plots for the evals (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def frontier_plot(results: dict, out: str | Path, metric: str = "ppl") -> Path:
    """Perplexity (or accuracy) vs peak KV MiB, one labelled point per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec, r in results.items():
        x, y = r["peak_kv_bytes"] / 2**20, r[metric]
        ax.scatter([x], [y])
        ax.annotate(spec, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("peak KV cache (MiB, exact stored bytes)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs peak KV bytes")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def trace_plot(trace: list[dict], out: str | Path, marker: int | None = None, title: str = "") -> Path:
    """Confidence, budget and cache size per step; ``marker`` = step where the question arrives."""
    plt = _pyplot()
    steps = [t["step"] for t in trace]
    fig, axes = plt.subplots(3, 1, figsize=(8, 6), sharex=True)
    series = (
        ("confidence", [t["confidence"] for t in trace]),
        ("budget (tokens/layer)", [t["budget"] for t in trace]),
        ("KV MiB", [t["kv_bytes"] / 2**20 for t in trace]),
    )
    for ax, (label, values) in zip(axes, series, strict=True):
        ax.plot(steps, values, lw=0.8)
        ax.set_ylabel(label, fontsize=8)
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
