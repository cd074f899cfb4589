"""The eval plots: drawn from result dicts and traces alone (no model), readable markers."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from confkv.eval.plots import frontier_plot, rolling_mean, trace_plot, unsure_steps  # noqa: E402


def test_unsure_steps_are_the_high_budget_ones():
    assert unsure_steps([256, 512, 256, 512, 512]) == [False, True, False, True, True]
    assert unsure_steps([512, 512]) == [False, False]  # one budget all along: no band
    assert unsure_steps([None, None]) == [False, False]  # ``full``: unbounded


def test_rolling_mean_is_the_share_of_unsure_steps_in_the_window():
    """The budget panel's curve: a budget flipping every step reads as a steady 50%, not a barcode."""
    assert rolling_mean([0.0, 1.0, 1.0, 0.0], 2) == [0.0, 0.5, 1.0, 0.5]
    flips = [float(i % 2) for i in range(100)]
    assert all(v == 0.5 for v in rolling_mean(flips, 10)[10:])


def test_plots_write_pngs(tmp_path):
    results = {
        s: {"ppl": 30 + i, "peak_kv_bytes": (i + 1) * 2**20} for i, s in enumerate(["full", "window:n=8"])
    }
    assert frontier_plot(results, tmp_path / "f.png").stat().st_size > 1000
    trace = [
        {"step": i, "confidence": 0.5, "budget": 64 if i % 3 else 128, "kv_bytes": 1000 * i}
        for i in range(30)
    ]
    assert trace_plot(trace, tmp_path / "t.png", marker=10).stat().st_size > 1000
    full = [{"step": i, "confidence": 0.5, "budget": None, "kv_bytes": 1000 * i} for i in range(5)]
    assert trace_plot(full, tmp_path / "full.png").stat().st_size > 1000
