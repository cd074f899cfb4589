"""``confkv eval ablation``: random / recency / attention on Conf-KV's exact eviction schedule.

All four policies are rows of one batch. After every step the confkv row has chosen its next
budget from its own confidence; the three ablation rows are then forced to that same budget
(``SequenceCache.set_budget``), so they evict the same number of tokens at the same steps and
differ only in *which* tokens they drop.
"""

from __future__ import annotations

import dataclasses

import torch

from confkv.cache import ConfKVCache
from confkv.eval.common import geometry_of, matched_policies, teacher_forced_batch
from confkv.eval.ppl import row_result
from confkv.policies import MATCHED_RATE, POLICIES, CachePolicy, GatedPolicy

EXPECTED = "random > recency >= attention > confkv"


def ablation_policies(confkv: CachePolicy) -> list[CachePolicy]:
    """confkv (resolved, no byte budget) first, then each ablation with the same schedule fields."""
    shared = {f.name: getattr(confkv, f.name) for f in dataclasses.fields(GatedPolicy)}
    rows = [confkv]
    for name in MATCHED_RATE:
        if name != "confkv":
            rows.append(POLICIES[name](**shared))
    return rows


class ScheduleReplay:
    """Step hook: row 0 leads; every other row gets row 0's budget. Keeps the schedule."""

    def __init__(self) -> None:
        self.schedule: list[int] = []

    def __call__(self, step: int, logits: torch.Tensor, cache: ConfKVCache) -> None:
        budget = cache.seqs[0].budget
        self.schedule.append(budget)
        for seq in cache.seqs[1:]:
            seq.set_budget(budget)


def ordering(results: dict) -> dict:
    """Policies from worst to best perplexity, and whether the paper's ordering holds."""
    ppl = {r["resolved_policy"].split(":")[0]: r["ppl"] for r in results.values()}
    by_ppl = sorted(ppl, key=lambda name: ppl[name], reverse=True)
    met = ppl["random"] > ppl["recency"] >= ppl["attention"] > ppl["confkv"]
    return {"by_ppl": by_ppl, "expected": EXPECTED, "met": bool(met)}


def run_ablation(
    model, ids: torch.Tensor, spec: str = "confkv", match_bytes: str | None = None, progress: bool = False
) -> tuple[dict, dict]:
    """ids (T,) -> ({name: result}, ordering). Each result also carries ``evictions_per_step``."""
    geometry = geometry_of(model)
    confkv = matched_policies([spec], geometry, match_bytes)[0].resolve(geometry)
    policies = ablation_policies(confkv)
    cache = ConfKVCache.for_model(model, policies)
    replay = ScheduleReplay()
    run = teacher_forced_batch(model, cache, ids, on_step=replay, progress=progress, desc="ablation")
    results = {}
    for b, policy in enumerate(policies):
        entry = row_result(run, b)
        entry["evictions_per_step"] = list(cache.seqs[b].stats.evictions_per_step)
        entry["batch_rows"] = len(policies)
        results[policy.name] = entry
    first = results["confkv"]["evictions_per_step"]
    same = all(r["evictions_per_step"] == first for r in results.values())
    order = ordering(results)
    order["identical_schedule"] = bool(same)
    order["budget_schedule"] = replay.schedule
    return results, order
