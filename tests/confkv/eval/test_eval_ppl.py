"""ppl harness: full equals HF's loss-based perplexity; keep-everything policies equal full."""

from __future__ import annotations

import math

import pytest
import torch

from confkv.eval.common import geometry_of, matched_policies
from confkv.eval.ppl import PplConfig, run_ppl
from confkv.policies import parse_policy

T = 48


def ids(vocab: int = 128, n: int = T, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


def hf_ppl(model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        loss = model(input_ids=tokens.view(1, -1), labels=tokens.view(1, -1), use_cache=False).loss
    return math.exp(float(loss))


def test_full_equals_hf_loss_ppl(llama):
    tokens = ids()
    results = run_ppl(llama, tokens, PplConfig(("full",)))
    assert results["full"]["ppl"] == pytest.approx(hf_ppl(llama, tokens), rel=1e-4)


def test_policies_that_keep_everything_equal_full(llama):
    tokens = ids()
    keep_all = f"confkv:n_high={T},n_low={T},p=4"
    specs = ("full", f"window:n={T}", f"sinks:s=4,n={T}", f"h2o:n={2 * T}", keep_all)
    results = run_ppl(llama, tokens, PplConfig(specs))
    for spec in specs:
        assert results[spec]["ppl"] == pytest.approx(results["full"]["ppl"], rel=1e-5), spec
        assert results[spec]["evicted_tokens"] == 0


def test_evicting_policy_differs_and_respects_its_bytes(llama):
    tokens = ids()
    results = run_ppl(llama, tokens, PplConfig(("full", "window:n=8")))
    assert results["window:n=8"]["ppl"] != pytest.approx(results["full"]["ppl"], rel=1e-6)
    assert results["window:n=8"]["evicted_tokens"] > 0
    bound = parse_policy("window:n=8").peak_bytes_bound(geometry_of(llama))
    assert results["window:n=8"]["peak_kv_bytes"] <= bound
    assert results["full"]["peak_kv_bytes"] == geometry_of(llama).full_bytes(T - 1)
    assert results["window:n=8"]["mean_kv_bytes"] < results["full"]["mean_kv_bytes"]


def test_batch_rows_are_independent(llama):
    """A policy's row in a batch scores exactly as the same policy run alone."""
    tokens = ids()
    alone = run_ppl(llama, tokens, PplConfig(("confkv:n_high=16,n_low=12,p=4,s=2",)))
    batched = run_ppl(llama, tokens, PplConfig(("full", "window:n=8", "confkv:n_high=16,n_low=12,p=4,s=2")))
    spec = "confkv:n_high=16,n_low=12,p=4,s=2"
    assert batched[spec]["ppl"] == pytest.approx(alone[spec]["ppl"], rel=1e-5)
    assert batched[spec]["peak_kv_bytes"] == alone[spec]["peak_kv_bytes"]


def test_match_bytes_scales_every_evicting_policy_to_the_reference(llama):
    geometry = geometry_of(llama)
    specs = ["full", "window:n=16", "h2o", "confkv:p=4,s=2"]
    specs += ["confkv:int8=1,w=4,p=4,s=2", "confkv:pyramid=1,p=4"]
    policies = matched_policies(specs, geometry, "window:n=16")
    target = parse_policy("window:n=16").peak_bytes_bound(geometry)
    resolved = [p.resolve(geometry) for p in policies]
    assert resolved[0].spec() == "full"
    for policy in resolved[1:]:
        assert policy.peak_bytes_bound(geometry) <= target
        assert policy.scaled_to_peak(policy.budget_rule().peak + 1).peak_bytes_bound(geometry) > target
    assert resolved[4].budget_rule().peak > 16  # INT8 storage buys more tokens for the same bytes


def test_match_bytes_results_stay_within_reference_bytes(llama):
    tokens = ids()
    specs = ("window:n=16", "sinks:s=2,n=64", "confkv:int8=1,w=4,p=4,s=2")
    results = run_ppl(llama, tokens, PplConfig(specs, match_bytes="window:n=16"))
    ref = results["window:n=16"]["peak_kv_bytes"]
    for spec in specs:
        assert results[spec]["peak_kv_bytes"] <= ref, spec


def test_config_validation():
    with pytest.raises(ValueError, match="duplicate"):
        PplConfig(("full", "full"))
    with pytest.raises(ValueError, match="at least one"):
        PplConfig(())
