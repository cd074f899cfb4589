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


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def trace_plot(trace: list[dict], out: str | Path, marker: int | None = None, title: str = "") -> Path:
    """Confidence, budget and cache size per step; ``marker`` = step where the question arrives.

    The gated budget flips between two values nearly every step, so drawn per step it is a solid
    barcode. The middle panel draws instead the share of unsure (high-budget) steps over a rolling
    window, shaded: the same curve reads as the mean budget on the left axis (N_low at 0%, N_high
    at 100%) and as the share of unsure steps on the right. Confidence gets the same rolling mean
    over its raw trace."""
    plt = _pyplot()
    steps = [t["step"] for t in trace]
    budgets = [t["budget"] for t in trace]
    unsure = unsure_steps(budgets)
    window = max(1, min(32, len(trace) // 20))
    fig, axes = plt.subplots(3, 1, figsize=(9, 6.5), sharex=True, height_ratios=[1, 1.1, 0.8])
    conf = [t["confidence"] for t in trace]
    axes[0].plot(steps, conf, lw=0.4, color="C0", alpha=0.35, label="per token")
    axes[0].plot(steps, rolling_mean(conf, window), lw=1.4, color="C0", label=f"mean of {window} tokens")
    axes[0].set_ylabel("confidence")
    axes[0].set_ylim(0, 1.05)
    if any(unsure):
        _budget_share_panel(axes[1], steps, budgets, unsure, window)
    else:  # one budget all along (or ``full``: unbounded): nothing flips, a step line reads well
        known = [b if b is not None else float("nan") for b in budgets]
        axes[1].step(steps, known, where="post", lw=1.2, color="C1", label="budget")
        axes[1].set_ylabel("budget\n(tokens/layer)")
        if all(b is None for b in budgets):
            axes[1].text(0.5, 0.5, "unbounded (no budget)", transform=axes[1].transAxes, ha="center")
    axes[2].plot(steps, [t["kv_bytes"] / 2**20 for t in trace], lw=1.2, color="C2", label="stored KV")
    axes[2].set_ylabel("KV MiB")
    axes[2].set_ylim(bottom=0)
    # legends where each panel's curve is not: under the confidence, above the share, right of the ramp
    for i, (ax, where, columns) in enumerate(
        zip(axes, ("lower left", "upper right", "lower right"), (3, 2, 1), strict=True)
    ):
        if marker is not None:
            ax.axvline(marker, color="red", ls="--", lw=1.0, label="question starts" if i == 0 else None)
        ax.grid(alpha=0.25)
        ax.legend(fontsize=7, loc=where, framealpha=0.9, ncol=columns)
    axes[-1].set_xlabel("token")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def _budget_share_panel(ax, steps: list[int], budgets: list, unsure: list[bool], window: int) -> None:
    known = [b for b in budgets if b is not None]
    low, high = min(known), max(known)
    share = rolling_mean([float(u) for u in unsure], window)
    mean_budget = [low + s * (high - low) for s in share]
    overall = sum(unsure) / len(unsure)
    ax.fill_between(steps, low, mean_budget, color="C1", alpha=0.35, lw=0,
                    label=f"unsure steps, {window}-token window ({overall:.0%} overall)")  # fmt: skip
    ax.plot(steps, mean_budget, lw=1.2, color="C1", label="mean budget")
    ax.axhline(low + overall * (high - low), color="C1", ls=":", lw=1.0, label="mean over the trace")
    ax.set_ylim(low - 0.08 * (high - low), high + 0.08 * (high - low))
    ax.set_yticks([low, (low + high) / 2, high], [f"N_low {low}", f"{(low + high) / 2:g}", f"N_high {high}"])
    ax.set_ylabel("budget\n(tokens/layer)")
    right = ax.twinx()
    right.set_ylim(*(100 * (y - low) / (high - low) for y in ax.get_ylim()))
    right.set_yticks([0, 50, 100], ["0%", "50%", "100%"])
    right.set_ylabel("unsure steps")


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
