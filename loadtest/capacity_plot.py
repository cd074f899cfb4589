"""Plots of a capacity report: throughput and TTFT against concurrent sessions, per policy."""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, rows in report["results"].items():
        n = [r["sessions"] for r in rows]
        line = ax_tp.plot(n, [r["throughput_tok_s"] for r in rows], marker="o", label=policy)[0]
        color = line.get_color()
        ax_ttft.plot(n, [(r["ttft_ms_p50"] or 0) / 1000 for r in rows], marker="o", color=color,
                     label=f"{policy} p50")  # fmt: skip
        ax_ttft.plot(n, [(r["ttft_ms_p95"] or 0) / 1000 for r in rows], marker="x", ls="--", color=color,
                     label=f"{policy} p95")  # fmt: skip
        cap = report.get("capacity", {}).get(policy)
        if cap:
            ax_tp.axvline(cap, color=color, ls=":", lw=1)
            ax_ttft.axvline(cap, color=color, ls=":", lw=1)
    ax_tp.set(xlabel="concurrent sessions", ylabel="aggregate tokens/s")
    ax_tp.set_title("throughput (dotted line: capacity)")
    ax_ttft.set(xlabel="concurrent sessions", ylabel="time to first token (s)", title="TTFT")
    ax_tp.legend(fontsize=8)
    ax_ttft.legend(fontsize=8)
    pool_mib = report["kv_pool_bytes"] / 2**20
    limit = report["max_context"]
    fig.suptitle(f"{report['model']}: one worker, KV pool {pool_mib:.0f} MiB, context limit {limit}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
