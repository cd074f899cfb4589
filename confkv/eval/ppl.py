"""``confkv eval ppl``: teacher-forced perplexity with per-step eviction, all policies in one batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from confkv.cache import ConfKVCache
from confkv.eval.common import BatchRun, geometry_of, matched_policies, recall_fields, teacher_forced_batch


@dataclass(frozen=True)
class PplConfig:
    specs: tuple[str, ...]
    match_bytes: str | None = None

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError("ppl: at least one policy is needed")
        if len(set(self.specs)) != len(self.specs):
            raise ValueError(f"ppl: duplicate policy specs in {list(self.specs)}")


def row_result(run: BatchRun, row: int) -> dict:
    """One policy's JSON entry (DESIGN.md shape plus detail)."""
    seq = run.cache.seqs[row]
    nll = run.nll[row]
    return {
        "ppl": math.exp(float(nll.mean())),
        "nll": float(nll.mean()),
        "peak_kv_bytes": int(run.peak_bytes[row]),
        "mean_kv_bytes": float(run.mean_bytes[row]),
        "seconds": run.seconds,
        "resolved_policy": seq.policy.spec(),
        "peak_tokens_per_layer": seq.policy.budget_rule().peak if seq.policy.evicts else None,
        "evicted_tokens": int(seq.stats.evicted_tokens),
        **recall_fields(seq, run.mean_cold_bytes[row]),
    }


def _results(run: BatchRun, specs: tuple[str, ...]) -> dict:
    results = {spec: row_result(run, b) for b, spec in enumerate(specs)}
    for entry in results.values():
        entry["batch_rows"] = len(specs)
        entry["scored_tokens"] = int(run.nll.shape[1])
    return results


def run_ppl(
    model,
    ids: torch.Tensor,
    config: PplConfig,
    progress: bool = False,
    on_step=None,
    checkpoint: Callable[[dict], None] | None = None,
    checkpoint_every: int = 0,
) -> dict:
    """ids (T,) -> {spec: result}; ``seconds`` is the wall time of the whole batch (shared).
    ``checkpoint(results_so_far)`` runs every ``checkpoint_every`` tokens (long runs)."""
    policies = matched_policies(list(config.specs), geometry_of(model), config.match_bytes)
    cache = ConfKVCache.for_model(model, policies)
    partial = (lambda run: checkpoint(_results(run, config.specs))) if checkpoint else None
    run = teacher_forced_batch(
        model, cache, ids, on_step, progress, "ppl", partial=partial, partial_every=checkpoint_every
    )
    return _results(run, config.specs)
