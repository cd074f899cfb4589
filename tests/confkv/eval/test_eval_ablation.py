"""Matched-rate ablation: every row follows confkv's budget schedule and evicts identically."""

from __future__ import annotations

import pytest
import torch

from confkv.eval.ablation import ablation_policies, ordering, run_ablation
from confkv.eval.ppl import PplConfig, run_ppl
from confkv.policies import parse_policy

SPEC = "confkv:n_high=16,n_low=10,p=4,s=2,tau=0.02"


def tokens(n: int = 60) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(3))


def test_ablation_rows_share_confkv_fields():
    rows = ablation_policies(parse_policy(SPEC))
    assert [p.name for p in rows] == ["confkv", "random", "recency", "attention"]
    for p in rows:
        assert (p.n_high, p.n_low, p.tau, p.p, p.s) == (16, 10, 0.02, 4, 2)


def test_identical_eviction_schedule(llama):
    results, order = run_ablation(llama, tokens(), SPEC)
    first = results["confkv"]["evictions_per_step"]
    assert sum(first) > 0  # something was evicted, at several steps
    assert len({i for i, n in enumerate(first) if n}) > 3
    for name in ("random", "recency", "attention"):
        assert results[name]["evictions_per_step"] == first, name
        assert results[name]["evicted_tokens"] == results["confkv"]["evicted_tokens"]
    assert order["identical_schedule"] is True
    assert set(order["budget_schedule"]) <= {10, 16}


def test_confkv_row_follows_its_own_schedule(llama):
    """The leading confkv row scores exactly as confkv run alone (replay does not touch it)."""
    results, _ = run_ablation(llama, tokens(), SPEC)
    alone = run_ppl(llama, tokens(), PplConfig((SPEC,)))
    assert results["confkv"]["ppl"] == pytest.approx(alone[SPEC]["ppl"], rel=1e-5)


def test_ordering_reports_whether_the_paper_order_holds():
    fake = {
        n: {"ppl": v, "resolved_policy": n}
        for n, v in {"random": 9.0, "recency": 8.0, "attention": 8.0, "confkv": 7.0}.items()
    }
    assert ordering(fake)["met"] is True
    fake["confkv"]["ppl"] = 8.5
    assert ordering(fake)["met"] is False
    assert ordering(fake)["by_ppl"][0] == "random"
