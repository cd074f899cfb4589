"""KL-shift statistics and the memory eval on a tiny model."""

from __future__ import annotations

import pytest
import torch

from confkv.eval.common import geometry_of
from confkv.eval.klshift import KLShiftConfig, correlations, kl_divergence, run_klshift
from confkv.eval.memory import run_memory
from confkv.policies import parse_policy


def test_kl_divergence_zero_for_equal_and_positive_otherwise():
    a = torch.randn(3, 50)
    assert torch.allclose(kl_divergence(a, a), torch.zeros(3), atol=1e-6)
    assert (kl_divergence(a, torch.randn(3, 50)) > 0).all()


def test_correlations_of_a_perfectly_decreasing_relation():
    x = [i / 50 for i in range(50)]
    y = [1 - v**2 for v in x]
    out = correlations(x, y, resamples=200)
    assert out["spearman_r"] == pytest.approx(-1.0)
    assert out["pearson_r"] < -0.9
    lo, hi = out["pearson_ci95"]
    assert lo <= out["pearson_r"] <= hi + 1e-9
    with pytest.raises(ValueError, match="sampled steps"):
        correlations([1.0, 2.0], [1.0, 2.0], resamples=20)


def test_run_klshift_samples_after_k(llama):
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0))
    summary, samples = run_klshift(llama, ids, KLShiftConfig(recent=16, every=4, bootstrap=50))
    # logits of step i saw i+1 tokens; sampled where i+1 > 16 and (i+1-16) % 4 == 0, i < 59
    assert samples["step"] == [i for i in range(59) if i + 1 > 16 and (i + 1 - 16) % 4 == 0]
    assert all(k >= 0 for k in samples["kl"])
    assert summary["n"] == len(samples["kl"])
    assert -1 <= summary["pearson_r"] <= 1
    assert summary["peak_kv_bytes"] == parse_policy("window:n=16").peak_bytes_bound(geometry_of(llama))


def test_klshift_config_validation():
    with pytest.raises(ValueError):
        KLShiftConfig(recent=0)
    with pytest.raises(ValueError):
        KLShiftConfig(every=0)


def test_memory_full_grows_and_window_is_bounded(llama):
    prompt = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0))
    results = run_memory(llama, prompt, ["full", "window:n=8", "confkv:n_high=12,n_low=8,p=2,s=1"], 30)
    geometry = geometry_of(llama)
    assert results["full"]["tokens_seen"] == 20 + 29
    assert results["full"]["peak_kv_bytes"] == geometry.full_bytes(49)
    assert results["window:n=8"]["peak_kv_bytes"] == parse_policy("window:n=8").peak_bytes_bound(geometry)
    assert results["window:n=8"]["mean_kv_bytes"] < results["full"]["mean_kv_bytes"]
    conf = parse_policy("confkv:n_high=12,n_low=8,p=2,s=1")
    assert results["confkv:n_high=12,n_low=8,p=2,s=1"]["peak_kv_bytes"] <= conf.peak_bytes_bound(geometry)
