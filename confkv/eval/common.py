"""Shared pieces of the evals: text loading, matched-byte policies, the batched teacher-forced loop.

Every policy of an eval runs as one row of a single ragged ``ConfKVCache`` batch: rows see the
same tokens one step at a time (decode_one_token), so each policy sees exactly the cache it
would see while decoding, and the model's weights are read once per step for all policies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from confkv.cache import ConfKVCache
from confkv.decode import decode_one_token, prefill
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, parse_policy

StepHook = Callable[[int, torch.Tensor, ConfKVCache], None]


def load_text_tokens(tokenizer, path: str | Path, tokens: int, offset_chars: int = 0) -> torch.Tensor:
    """The first ``tokens`` token ids (T,) of a text file after skipping ``offset_chars`` characters."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    if tokens < 2:
        raise ValueError(f"--tokens must be >= 2 to score anything, got {tokens}")
    if offset_chars < 0:
        raise ValueError(f"--offset-chars must be >= 0, got {offset_chars}")
    text = path.read_text(encoding="utf-8", errors="replace")[offset_chars:]
    # Tokenize only as much text as needed (about 4 characters per token, generous margin).
    ids = tokenizer(text[: tokens * 12], add_special_tokens=False).input_ids
    if len(ids) < tokens:
        raise ValueError(f"{path} has only {len(ids)} tokens after offset {offset_chars}, need {tokens}")
    return torch.tensor(ids[:tokens], dtype=torch.long)


def geometry_of(model) -> KVGeometry:
    return KVGeometry.from_config(model.config, next(model.parameters()).dtype)


def matched_policies(specs: list[str], geometry: KVGeometry, match: str | None) -> list[CachePolicy]:
    """Parse ``specs``; with ``match`` (a reference spec) every evicting policy gets the
    reference's peak KV byte bound as its byte budget (resolved to the largest token budget
    that fits, per policy: INT8 storage buys more tokens, pyramid splits them by depth)."""
    policies = [parse_policy(s) for s in specs]
    if match is None:
        return policies
    reference = match_reference(match)
    target = reference.resolve(geometry).peak_bytes_bound(geometry)
    return [p.replace(bytes=target) if p.evicts else p for p in policies]


def match_reference(match: str) -> CachePolicy:
    """The --match-bytes reference policy (must evict, else it has no byte bound)."""
    reference = parse_policy(match)
    if not reference.evicts:
        raise ValueError(f"--match-bytes needs an evicting reference policy, got {match!r}")
    return reference


@dataclass
class BatchRun:
    """Per-row outcome of a teacher-forced batch: nll (B, steps), bytes sampled every step."""

    nll: torch.Tensor
    mean_bytes: list[float]
    peak_bytes: list[int]
    mean_cold_bytes: list[float]
    seconds: float
    cache: ConfKVCache
    extra: dict = field(default_factory=dict)


@torch.no_grad()
def teacher_forced_batch(
    model,
    cache: ConfKVCache,
    ids: torch.Tensor,
    on_step: StepHook | None = None,
    progress: bool = False,
    desc: str = "tokens",
    partial: Callable[[BatchRun], None] | None = None,
    partial_every: int = 0,
) -> BatchRun:
    """Feed the same ids (T,) to every row, one token per step after the first.

    Returns the NLL of tokens 1..T-1 for every row (B, T-1). ``on_step(i, logits, cache)`` runs
    after step i's logits (B, V) were observed (budgets already set for the next step), so a
    hook may override budgets (schedule replay) or read distributions (KL shift).
    ``partial(run_so_far)`` is called every ``partial_every`` steps (checkpoints of long runs)."""
    rows = len(cache.seqs)
    steps = ids.shape[0] - 1
    nll = torch.empty(rows, steps)
    byte_sum = [0.0] * rows
    cold_sum = [0.0] * rows
    start = time.perf_counter()
    device = next(model.parameters()).device
    ids = ids.to(device)
    logits = prefill(model, cache, ids[:1].expand(rows, 1))
    for i in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
        nll[:, i] = torch.nn.functional.cross_entropy(
            logits.float(), ids[i + 1].expand(rows), reduction="none"
        ).cpu()
        for b, seq in enumerate(cache.seqs):
            byte_sum[b] += seq.nbytes()
            cold_sum[b] += seq.cold_nbytes()
        if on_step is not None:
            on_step(i, logits, cache)
        if partial is not None and partial_every and (i + 1) % partial_every == 0 and i + 1 < steps:
            partial(_snapshot(nll, byte_sum, cold_sum, i + 1, start, cache))
        if i + 1 < steps:
            logits = decode_one_token(model, cache, ids[i + 1].expand(rows))
    return _snapshot(nll, byte_sum, cold_sum, steps, start, cache)


def _snapshot(
    nll: torch.Tensor, byte_sum: list[float], cold_sum: list[float], done: int, start: float, cache
) -> BatchRun:
    """The run so far: NLL of the first ``done`` scored tokens (same as a shorter run's)."""
    return BatchRun(
        nll=nll[:, :done],
        mean_bytes=[s / done for s in byte_sum],
        peak_bytes=[seq.stats.peak_bytes for seq in cache.seqs],
        mean_cold_bytes=[s / done for s in cold_sum],
        seconds=time.perf_counter() - start,
        cache=cache,
    )


def recall_fields(seq, mean_cold_bytes: float) -> dict:
    """Cold-tier figures of one sequence (all zero without ``recall=1``): bytes, recalls, drops."""
    return {
        "peak_cold_bytes": int(seq.stats.peak_cold_bytes),
        "mean_cold_bytes": float(mean_cold_bytes),
        "recalled_tokens": int(seq.stats.recalled_tokens),
        "cold_dropped_tokens": int(seq.stats.cold_dropped_tokens),
        "recall_steps": int(seq.stats.recall_steps),
    }
