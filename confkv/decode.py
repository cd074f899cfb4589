"""The decode loop as small named functions (gpt-fast style): prefill, decode_one_token, sample.

Every forward feeds the newest logits' confidence to the cache, which picks each sequence's
budget for the next step. Prompts are processed in chunks with eviction between chunks, so the
peak KV stays within the budget for prompts of any length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from confkv.cache import ConfKVCache, all_or_nothing, driven
from confkv.recall import SUMMARY_SHARE, RecallMode


@dataclass
class GenerationResult:
    tokens: list[int]
    trace: list[dict] = field(default_factory=list)
    stop_reason: str = "length"


def prefill_chunk_size(cache: ConfKVCache, requested: int) -> int:
    """Largest chunk that keeps every sequence within its budget and FP window: the budget less
    the tokens eviction may not remove (the sinks and the protected recent window, or fewer
    while a layer holds fewer), so a prompt's first chunk may fill a whole budget."""
    size = requested
    for seq in cache.seqs:
        pol = seq.policy
        if pol.evicts:
            size = min(size, _room(seq))
        if pol.int8:
            size = min(size, pol.w)
    return max(1, size)


def _room(seq) -> int:
    """Tokens a chunk may bring to ``seq`` without any layer going over its budget. With recall,
    page summaries may take up to SUMMARY_SHARE of a budget."""
    pol = seq.policy
    share = 1 - SUMMARY_SHARE if pol.recall else 1.0
    keep = pol.protected + pol.s
    return min(
        int(budget * share) - min(len(store), keep)
        for budget, store in zip(seq.layer_budgets, seq.stores, strict=True)
    )


def next_prefill_chunk(cache: ConfKVCache, remaining: int, requested: int) -> int:
    """Length of the next chunk of a prompt with ``remaining`` tokens left: the largest that
    fits (``prefill_chunk_size``), except that the final chunk holds the whole observation
    window, so the prompt-end probe sees the full question."""
    step = prefill_chunk_size(cache, requested)
    if remaining <= step:
        return remaining
    tail = min(step, observation_window(cache))
    return step if remaining - step >= tail else remaining - tail


def observation_window(cache: ConfKVCache) -> int:
    """Prompt-end probe length: the largest ``obs`` among the recall sequences (0: none), each at
    most a quarter of its smallest layer budget (the probed tail must leave room to re-select)."""
    return max(
        (max(1, min(s.policy.obs, min(s.layer_budgets) // 4)) for s in cache.seqs if s.policy.recall),
        default=0,
    )


@torch.no_grad()
def forward(model, cache: ConfKVCache, input_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
    """input_ids (B, M) at each sequence's next positions -> logits (B, M, V) or (B, 1, V)."""
    positions = cache.positions_for_next(input_ids.shape[1]).to(input_ids.device)
    with driven(), all_or_nothing(cache.seqs):
        out = model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
    return out.logits


@torch.no_grad()
def prefill(model, cache: ConfKVCache, input_ids: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """Process a prompt (B, T) chunk by chunk; returns the last position's logits (B, V)."""
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: at least one token is needed")
    total, start = input_ids.shape[1], 0
    while (size := next_prefill_chunk(cache, total - start, chunk_size)) < total - start:
        forward(model, cache, input_ids[:, start : start + size])
        start += size
    logits = prompt_end_forward(model, cache, input_ids[:, start:])[:, -1]
    cache.observe_logits(logits)
    return logits


@torch.no_grad()
def prompt_end_forward(model, cache: ConfKVCache, input_ids: torch.Tensor) -> torch.Tensor:
    """The final chunk of a prompt (B, M). With recall, its last ``obs`` tokens first run as a
    probe on the recall sequences that have cold tokens or will evict: every layer's queries
    vote for hot tokens and cold pages (exact attention mass, summed over layers), the probe is
    rolled back, each layer's hot set is re-selected and pinned by the votes (within the
    confident-step budget, so the first answer step keeps it), and the tail runs for real.
    -> logits (B, 1, V)."""
    probe = min(observation_window(cache), input_ids.shape[1])
    if probe == 0:
        return forward(model, cache, input_ids)
    with all_or_nothing(cache.seqs):  # a failure anywhere: the whole chunk, head included, unread
        head, tail = input_ids[:, :-probe], input_ids[:, -probe:]
        if head.shape[1]:
            forward(model, cache, head)
        rows = [b for b, s in enumerate(cache.seqs) if s.needs_probe(probe)]
        if not rows:
            return forward(model, cache, tail)
        sub = ConfKVCache([cache.seqs[b] for b in rows])
        starts = [s.seen_tokens for s in sub.seqs]
        for seq in sub.seqs:
            seq.arm(RecallMode.PROBE)
        try:
            forward(model, sub, tail[rows])
        finally:
            for seq in sub.seqs:
                seq.arm(RecallMode.NONE)
        for seq, start in zip(sub.seqs, starts, strict=True):
            seq.rollback(start)
            seq.recall_voted(incoming=probe)
        return forward(model, cache, tail)


@torch.no_grad()
def decode_one_token(model, cache: ConfKVCache, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B,) -> next logits (B, V); the cache's budgets follow the new confidence."""
    logits = forward(model, cache, tokens.view(-1, 1))[:, -1]
    cache.observe_logits(logits)
    return logits


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
):
    """(B, V) -> (B,) greedy when temperature == 0; with ``top_p`` < 1 only the smallest set of
    most likely tokens whose probability reaches ``top_p`` can be drawn (nucleus sampling)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _trace_row(step: int, token: int, cache: ConfKVCache) -> dict:
    seq = cache.seqs[0]
    rec = seq.record()
    return {
        "step": step,
        "token": token,
        "confidence": rec.confidence,
        "budget": rec.budget,
        "tokens_per_layer": rec.tokens_per_layer,
        "bytes_per_layer": rec.bytes_per_layer,
        "kv_bytes": sum(rec.bytes_per_layer),
        "cold_bytes": rec.cold_bytes,
        "recalls": [vars(e) for e in rec.recalls],
    }


@torch.no_grad()
def generate(
    model,
    cache: ConfKVCache,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    temperature: float = 0.0,
    chunk_size: int = 256,
    on_token: Callable[[int], bool | None] | None = None,
    trace: bool = False,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate for one sequence (B=1). ``on_token`` may return False to cancel."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if input_ids.shape[0] != 1 or len(cache.seqs) != 1:
        raise ValueError("generate() handles one sequence; the worker engine batches many")
    eos = eos_token_ids or set()
    result = GenerationResult(tokens=[])
    if max_new_tokens == 0:
        return result
    logits = prefill(model, cache, input_ids, chunk_size)
    for step in range(max_new_tokens):
        token = int(sample(logits, temperature, generator)[0])
        result.tokens.append(token)
        if trace:
            result.trace.append(_trace_row(step, token, cache))
        if token in eos:
            result.stop_reason = "eos"
            break
        if on_token is not None and on_token(token) is False:
            result.stop_reason = "cancelled"
            break
        if step + 1 < max_new_tokens:
            logits = decode_one_token(model, cache, torch.tensor([token], device=input_ids.device))
    return result


@torch.no_grad()
def teacher_forced_logits(
    model, cache: ConfKVCache, input_ids: torch.Tensor, prefix: int = 0
) -> torch.Tensor:
    """Feed (B, T) one token at a time after an optional chunked ``prefix``; returns logits
    (B, T - max(prefix, 1) + 1, V) predicting tokens max(prefix,1)..T. Each step sees exactly
    the cache it would see while decoding (eviction between every step)."""
    outs = []
    start = max(prefix, 1)
    outs.append(prefill(model, cache, input_ids[:, :start]).unsqueeze(1))
    for t in range(start, input_ids.shape[1]):
        outs.append(decode_one_token(model, cache, input_ids[:, t]).unsqueeze(1))
    return torch.cat(outs, dim=1)
