"""The ``confkv`` attention function, registered in transformers' ``AttentionInterface``.

It attends over each sequence's mixed INT8/FP storage through ``confkv_kernels`` (Triton on
CUDA, the PyTorch reference elsewhere), and feeds the per-key attention mass back to the cache.
Memory during a prefill chunk of M queries is O(M * N) per head group, never O(T^2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from confkv_kernels import Backend, chunk_attention, decode_attention, default_backend
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from confkv.arena import DecodeArena
from confkv.batched import PackedCache, fold_attention, packed_attention, padded_decode_attention
from confkv.cache import is_driven, pending_cache, roll_back
from confkv.sequence import SequenceCache

ATTN_IMPLEMENTATION = "confkv"


def _offsets(lengths: list[int], device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lengths, device=device).cumsum(0)
    return out


def _needs_mass(seq: SequenceCache, layer: int) -> bool:
    """Whether attending ``layer`` must go through the mixed-storage kernels: the policy ranks
    by received attention, the sequence has a recall tier, or INT8 tokens are stored. Otherwise
    (``full``, ``window``, ``sinks`` and the like, FP only) a decode query is plain SDPA."""
    return seq.policy.needs_attention or seq.tier is not None or seq.stores[layer].q.n > 0


def _sdpa_decode(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (Hq, 1, D) over FP-only storage views kf, vf (Hkv, N, D), in place (no copy)."""
    out = F.scaled_dot_product_attention(q[None], kf[None], vf[None], scale=scaling, enable_gqa=True)
    return out[0]


def _attend_one(seq: SequenceCache, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (Hq, M, D) of one sequence -> (Hq, M, D); updates that sequence's statistics."""
    if q.shape[1] == 1 and q.device.type == "cpu" and not _needs_mass(seq, layer):
        store = seq.stores[layer]
        out = _sdpa_decode(q, store.fp.view("k"), store.fp.view("v"), scaling)
        seq.settle(layer)
        return out
    seq.maybe_recall(layer, q, scaling)
    store = seq.stores[layer]
    k8, k8s, v8, v8s, kf, vf = store.kv_views()
    m = q.shape[1]
    if m == 1:
        off8 = torch.tensor([0, k8.shape[1]], dtype=torch.int32, device=q.device)
        offf = torch.tensor([0, kf.shape[1]], dtype=torch.int32, device=q.device)
        out, mass8, massf = decode_attention(q.transpose(0, 1), k8, k8s, v8, v8s, kf, vf, off8, offf, scaling)
        out = out.transpose(0, 1)
    else:
        q_pos = torch.arange(store.next_pos - m, store.next_pos, device=q.device)
        posf = store.fp.view("pos")
        out, mass8, massf = chunk_attention(q, k8, k8s, v8, v8s, kf, vf, q_pos, posf, scaling)
    seq.after_attention(layer, mass8.sum(0), massf.sum(0))
    return out


def _attend_batched_decode(seqs: list[SequenceCache], layer: int, q: torch.Tensor, scaling: float):
    """One fused ragged call for a decode batch on the Triton path: q (B, Hq, 1, D)."""
    for b, seq in enumerate(seqs):
        seq.maybe_recall(layer, q[b], scaling)
    views = [s.stores[layer].kv_views() for s in seqs]
    k8, k8s, v8, v8s, kf, vf = (torch.cat([v[i] for v in views], dim=1) for i in range(6))
    off8 = _offsets([v[0].shape[1] for v in views], q.device)
    offf = _offsets([v[4].shape[1] for v in views], q.device)
    out, mass8, massf = decode_attention(q[:, :, 0], k8, k8s, v8, v8s, kf, vf, off8, offf, scaling)
    m8, mf = mass8.sum(0), massf.sum(0)
    for b, seq in enumerate(seqs):
        seq.after_attention(layer, m8[off8[b] : off8[b + 1]], mf[offf[b] : offf[b + 1]])
    return out.unsqueeze(2)


def _attend_padded_decode(seqs: list[SequenceCache], layer: int, q: torch.Tensor, scaling: float):
    """A decode batch on the CPU reference path: q (B, Hq, 1, D). Sequences whose statistics
    need the attention mass (or that hold INT8 tokens) in one padded call per layer; FP-only
    sequences of policies that do not rank by attention by the same SDPA call as alone."""
    rows = [b for b, seq in enumerate(seqs) if _needs_mass(seq, layer)]
    if not rows:  # all FP-only and attention-free: each by SDPA over its storage, as alone
        rows_q = zip(seqs, q.unbind(0), strict=True)
        return torch.stack([_attend_one(seq, layer, qb, scaling) for seq, qb in rows_q])
    if len(rows) < len(seqs):
        out = torch.empty_like(q)
        for b, seq in enumerate(seqs):
            if b not in rows:
                out[b] = _attend_one(seq, layer, q[b], scaling)
        if rows:
            index = torch.tensor(rows, device=q.device)
            ranked = _attend_padded_decode([seqs[b] for b in rows], layer, q[index], scaling)
            out.index_copy_(0, index, ranked)
        return out
    for b, seq in enumerate(seqs):
        seq.maybe_recall(layer, q[b], scaling)
    views = [s.stores[layer].kv_views() for s in seqs]
    out, masses = padded_decode_attention(q[:, :, 0], views, scaling)
    fold_attention(seqs, layer, masses)
    return out.unsqueeze(2)


def _attend_arena(arena: DecodeArena | None, seqs: list[SequenceCache], layer: int, q, scaling: float):
    """A decode batch whose FP windows are rows of ``arena`` (``confkv.arena``), FP only, no
    recall tier, and one way of attending for all (every member ranks by received attention
    with one decay, or none does), and this layer's new tokens went in by one batch append
    (``fresh``): one call over the arena's rows, q (B, Hq, 1, D). None when the batch is not
    like that (the padded workspace path serves it)."""
    if arena is None or not arena.uniform or arena.fresh != layer or arena.seqs != seqs:
        return None
    arena.fresh = -1  # this layer's batch append (``ConfKVCache.store``) is read once
    # No settle: uniform members are FP only without a recall tier, so settle would only
    # ``_fit`` the layer, which ``make_room`` did before the append (a budget holds at least
    # the protected tokens plus one, so the new token always fits).
    return arena.attend(layer, q[:, :, 0], scaling, arena.decay).unsqueeze(2)


def _attend_decode_batch(
    seqs: list[SequenceCache], layer: int, q: torch.Tensor, scaling: float, arena: DecodeArena | None = None
):
    """q (B, Hq, 1, D), one token per sequence: Triton's ragged kernel, else one call over the
    batch's arena, else the padded CPU call."""
    if default_backend(q.device) is Backend.TRITON:
        return _attend_batched_decode(seqs, layer, q, scaling)
    out = _attend_arena(arena, seqs, layer, q, scaling)
    return out if out is not None else _attend_padded_decode(seqs, layer, q, scaling)


def _fallback(query, key, value, scaling, window: int | None = None):
    """No Conf-KV cache in use: plain causal attention (keeps the model usable without our cache),
    over the last ``window`` positions on a sliding-window layer."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    m, n = query.shape[2], key.shape[2]
    mask = torch.ones(m, n, dtype=torch.bool, device=query.device).tril(diagonal=n - m)
    if window:
        mask = mask.triu(diagonal=n - m - window + 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out


# attention arguments some models pass that change the result, which these kernels do not apply:
# refused rather than ignored (ignoring them would change every token without a word)
_UNSUPPORTED = {"softcap": "logit soft-capping (Gemma 2)", "s_aux": "learned attention sinks (gpt-oss)"}


def _check_positions(seqs: list[SequenceCache], m: int, position_ids: torch.Tensor | None) -> None:
    """Rows at different positions (a ragged batch joined from caches of their own) need each
    row's own positions, as confkv.decode passes them; ``model.generate`` gives every row one
    offset (the cache's first row), which would rotate the other rows' keys wrongly."""
    starts = [seq.stores[0].next_pos - m for seq in seqs]
    if len(set(starts)) == 1:
        return
    fed = None if position_ids is None else position_ids[:, 0].expand(len(seqs)).tolist()
    if fed != starts:
        raise ValueError(
            f"the rows of this cache are at positions {starts} but were fed at {fed}: feed a ragged "
            "batch with confkv.decode (decode_one_token, forward), which passes each row's positions "
            "(cache.positions_for_next), not with model.generate"
        )


def _check_window(seqs: list[SequenceCache], layer: int, window: int) -> None:
    """A sliding-window layer (Mistral, Gemma's local layers) must not see a key ``window`` or more
    positions behind its newest query; Conf-KV attention has no window mask, so refuse instead
    of attending past the window (the policy ``window:n=W`` never holds such a key)."""
    for seq in seqs:
        store = seq.stores[layer]
        if store.next_pos <= window or not len(store):  # no key can be that far back yet
            continue
        if store.next_pos - 1 - int(store.meta_view("pos").min()) >= window:
            raise ValueError(
                f"layer {layer} of this model attends over a sliding window of {window} tokens and "
                f"Conf-KV attention has no window mask: past {window} tokens, use window:n={window} "
                "(or a smaller n), which keeps only the last positions, or a shorter context"
            )


def confkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, Hq, M, D) -> (attn_output (B, M, Hq, D), None) as transformers expects."""
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    layer = module.layer_idx
    cache = pending_cache(layer)
    try:
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"this model's attention uses {what} ({name}): Conf-KV attention does not")
        if cache is not None and layer == 0 and not cache.packed and not is_driven():
            _check_positions(cache.seqs, query.shape[2], kwargs.get("position_ids"))
        if cache is not None and kwargs.get("sliding_window"):
            _check_window(cache.seqs, layer, kwargs["sliding_window"])
    except ValueError:
        if cache is not None:  # refused: this forward's tokens leave the layers that stored them
            fed = cache.lengths if isinstance(cache, PackedCache) else [query.shape[2]] * len(cache.seqs)
            starts = [seq.stores[layer].next_pos - m for seq, m in zip(cache.seqs, fed, strict=True)]
            roll_back(cache.seqs, starts)
        raise
    if cache is None:
        out = _fallback(query, key, value, scaling, kwargs.get("sliding_window"))
    elif isinstance(cache, PackedCache):
        out = packed_attention(cache, layer, query, scaling, _attend_one, _attend_decode_batch)
    elif query.shape[2] == 1 and len(cache.seqs) > 1:
        out = _attend_decode_batch(cache.seqs, layer, query, scaling, cache.arena)
    else:
        out = torch.stack([_attend_one(s, layer, query[b], scaling) for b, s in enumerate(cache.seqs)])
    return out.transpose(1, 2).contiguous(), None


def padding_guard(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs) -> None:
    """The mask function transformers calls for ``confkv`` attention (its 2D ``attention_mask``
    comes here, already sized to the keys). Each sequence attends causally over its own cache,
    so no mask is built; a mask that hides a key (a left-padded batch) cannot be honoured
    and is refused, instead of letting the pads be attended and the tokens silently change."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "Conf-KV attention takes no padding mask: a padded batch would attend to its pads. Prefill "
            "each prompt in a cache of its own (confkv.decode.prefill), then decode them together in "
            "ConfKVCache([c.seqs[0] for c in caches]), or generate one sequence at a time (without a "
            "Conf-KV cache, switch the model back first: model.set_attn_implementation('sdpa'))"
        )
    return None


def register() -> None:
    """Register the attention function and its mask guard once (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, confkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_guard)


def enable(model) -> None:
    """Switch ``model`` to the ``confkv`` attention implementation."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
