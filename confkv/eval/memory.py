"""``confkv eval memory``: peak and mean KV bytes per policy over a long greedy generation.

One batch: every row prefills the same prompt, then greedily continues its *own* text (rows
diverge), so each policy's footprint is that of real decoding. Bytes are the exact stored
bytes (INT8 payload + scales + FP window), sampled after every step.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from confkv.cache import ConfKVCache
from confkv.decode import decode_one_token, prefill, sample
from confkv.eval.common import geometry_of, matched_policies, recall_fields


@torch.no_grad()
def run_memory(
    model,
    prompt: torch.Tensor,
    specs: list[str],
    new_tokens: int,
    match_bytes: str | None = None,
    progress: bool = False,
    chunk_size: int = 256,
) -> dict:
    """prompt (T,) -> {spec: {peak_kv_bytes, mean_kv_bytes, final_kv_bytes, seconds, ...}}."""
    if new_tokens < 1:
        raise ValueError(f"memory: new_tokens must be >= 1, got {new_tokens}")
    policies = matched_policies(specs, geometry_of(model), match_bytes)
    cache = ConfKVCache.for_model(model, policies)
    rows = len(policies)
    start = time.perf_counter()
    logits = prefill(model, cache, prompt.view(1, -1).expand(rows, -1), chunk_size)
    byte_sum = [0.0] * rows
    cold_sum = [0.0] * rows
    for step in tqdm(range(new_tokens), desc="memory", disable=not progress, leave=False):
        tokens = sample(logits)
        for b, seq in enumerate(cache.seqs):
            byte_sum[b] += seq.nbytes()
            cold_sum[b] += seq.cold_nbytes()
        if step + 1 < new_tokens:
            logits = decode_one_token(model, cache, tokens)
    seconds = time.perf_counter() - start
    results = {}
    for b, spec in enumerate(specs):
        seq = cache.seqs[b]
        results[spec] = {
            "peak_kv_bytes": int(seq.stats.peak_bytes),
            "mean_kv_bytes": byte_sum[b] / new_tokens,
            "final_kv_bytes": int(seq.nbytes()),
            "seconds": seconds,
            "resolved_policy": seq.policy.spec(),
            "tokens_seen": int(seq.seen_tokens),
            "batch_rows": rows,
            **recall_fields(seq, cold_sum[b] / new_tokens),
        }
    return results
