"""``ConfKVCache``: a transformers ``Cache`` holding one ``SequenceCache`` per batch row.

The model calls ``update(k, v, layer)``; we evict to make room, append, and hand the layer to
the ``confkv`` attention function (registered in ``confkv.attention``), which attends over the
mixed INT8/FP storage and returns the attention mass that feeds the EMA.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from confkv.arena import DecodeArena, arena_for
from confkv.confidence import confidence
from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, parse_policy
from confkv.sequence import SequenceCache

_HANDOFF = threading.local()
_DRIVER = threading.local()  # set while confkv.decode drives a forward (``driven``)


@contextlib.contextmanager
def driven() -> Iterator[None]:
    """Mark the forwards inside as confkv.decode's (chunked prefill with the prompt-end probe)."""
    before = getattr(_DRIVER, "on", False)
    _DRIVER.on = True
    try:
        yield
    finally:
        _DRIVER.on = before


@contextlib.contextmanager
def all_or_nothing(seqs: Sequence[SequenceCache]) -> Iterator[None]:
    """A forward that fails part-way (an error in layer k, out of memory) leaves none of its
    tokens behind: layers 0..k-1 had stored them, so every sequence rolls back to the position
    it had before (``SequenceCache.rollback``) and a retry feeds them once, at the right
    positions. Evictions made on the way stand, as if the tokens had been read and dropped."""
    starts = [seq.seen_tokens for seq in seqs]
    try:
        yield
    except BaseException:
        roll_back(seqs, starts)
        raise


def roll_back(seqs: Sequence[SequenceCache], starts: Sequence[int]) -> None:
    """Every sequence forgets what any of its layers stored at positions >= its start."""
    for seq, start in zip(seqs, starts, strict=True):
        if any(store.next_pos != start for store in seq.stores):
            seq.rollback(start)


def is_driven() -> bool:
    """Whether this thread's forward is confkv.decode's (it passes each row's own positions)."""
    return getattr(_DRIVER, "on", False)


def pending_cache(layer_idx: int) -> ConfKVCache | None:
    """The ConfKVCache whose ``update`` just ran for ``layer_idx`` on this thread (if any)."""
    cache = getattr(_HANDOFF, "cache", None)
    if cache is not None and _HANDOFF.layer == layer_idx:
        _HANDOFF.cache = None
        return cache
    return None


class ConfKVLayer(CacheLayerMixin):
    """Per-layer facade so transformers' generic Cache code sees familiar objects."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, owner: ConfKVCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.longest(self.layer_idx) + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1


class ConfKVCache(Cache):
    """Batch of per-sequence Conf-KV caches (ragged lengths allowed).

    Build from a model: ``ConfKVCache.for_model(model, "confkv:n_high=512")`` or with one policy
    per batch row. Sequences can also be assembled from existing ``SequenceCache`` objects
    (continuous batching in the worker).
    """

    packed = False  # one row holding several sequences' tokens (``confkv.batched.PackedCache``)
    arena: DecodeArena | None = None  # the decode batch's shared FP rows (``confkv.arena``)
    _probe_warned = False

    def __init__(self, sequences: list[SequenceCache]):
        if not sequences:
            raise ValueError("ConfKVCache needs at least one sequence")
        self.seqs = sequences
        n_layers = sequences[0].geometry.n_layers
        super().__init__(layers=[ConfKVLayer(self, i) for i in range(n_layers)])

    @classmethod
    def for_model(
        cls,
        model,
        policies: CachePolicy | str | Sequence[CachePolicy | str],
        batch_size: int = 1,
        seed: int = 0,
    ) -> ConfKVCache:
        """A cache for ``model``, one sequence per policy (or ``batch_size`` of one policy). The
        model's attention is switched to ``confkv`` here (``confkv.attention.enable``): any other
        attention would read only the new tokens that ``update`` hands back."""
        from confkv.attention import enable  # attention imports this module

        if isinstance(policies, (str, CachePolicy)):
            policies = [policies] * batch_size
        enable(model)
        param = next(model.parameters())
        geometry = KVGeometry.from_config(model.config, param.dtype)
        seqs = [
            SequenceCache(
                parse_policy(p) if isinstance(p, str) else p, geometry, param.dtype, param.device, seed
            )
            for p in policies
        ]
        return cls(seqs)

    # -- transformers Cache API -----------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        """key/value (B, Hkv, M, D) of the new tokens; stored, then attended by ``attend``."""
        if key_states.shape[0] != len(self.seqs) and not self.packed:
            raise ValueError(
                f"batch of {key_states.shape[0]} rows for a cache of {len(self.seqs)} sequences (build "
                "it with ConfKVCache.for_model(model, spec, batch_size=rows): beam search needs batch x "
                "num_beams)"
            )
        if getattr(_HANDOFF, "cache", None) is self:  # the last layer's hand-off was never attended
            _HANDOFF.cache = None
            raise RuntimeError(
                f"layer {_HANDOFF.layer} attended without Conf-KV, so it saw only the new tokens: build "
                "the cache with ConfKVCache.for_model(model, ...) or call confkv.attention.enable(model)"
            )
        self.store(key_states, value_states, layer_idx)
        _HANDOFF.cache, _HANDOFF.layer = self, layer_idx
        return key_states, value_states

    def store(self, key_states, value_states, layer_idx: int) -> None:
        """Evict to make room, then append row b's new tokens to sequence b (a decode batch
        whose FP windows share a ``DecodeArena``: all rows in one indexed write)."""
        m = key_states.shape[2]
        if layer_idx == 0:  # once per forward: the batch's arena, while it decodes together
            self.arena = arena_for(self.seqs) if m == 1 and len(self.seqs) > 1 else None
            if m > 1 and not self._probe_warned and not is_driven():
                self._warn_no_probe()
        arena = self.arena if m == 1 else None
        if arena is None:
            for seq in self.seqs:
                seq.before_append(layer_idx, m)
        elif not arena.inert:  # inert members have nothing to evict or demote
            arena.make_room(layer_idx, m)
        if arena is not None:
            if arena.holds(layer_idx, room=1):
                arena.append(layer_idx, key_states, value_states)
                return
            arena.fresh = -1
        for b, seq in enumerate(self.seqs):
            seq.append(layer_idx, key_states[b], value_states[b])

    def _warn_no_probe(self) -> None:
        """A prompt fed by someone else than confkv.decode (``model.generate``) skips the recall
        tier's prompt-end probe: say so once, instead of recalling less without a word."""
        if any(seq.tier is not None for seq in self.seqs):
            self._probe_warned = True
            warnings.warn(
                "recall=1: this prompt was not fed through confkv.decode.prefill/generate (or the "
                "worker), so the prompt-end probe that recalls what it asks about did not run; "
                "only confkv's gated decode-step recall acts",
                UserWarning,
                stacklevel=4,
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (not stored): new tokens get their true position from this."""
        return self.seqs[0].stores[layer_idx].next_pos

    def longest(self, layer_idx: int) -> int:
        return max(len(s.stores[layer_idx]) for s in self.seqs)

    @property
    def max_batch_size(self) -> int:
        return len(self.seqs)

    # -- rows for beam and contrastive search (transformers' Cache API) ----------------------------
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i continues the old row ``beam_idx[i]``."""
        self._rows([int(j) for j in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows([int(j) for j in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows([j for j in range(len(self.seqs)) for _ in range(repeats)])

    def _rows(self, order: list[int]) -> None:
        """The rows become the old rows ``order``: a row taken twice continues as an independent
        copy (its stores, statistics, confidence history and cold tier)."""
        if any(not 0 <= j < len(self.seqs) for j in order) or not order:
            raise ValueError(f"row indices {order} do not select from a cache of {len(self.seqs)} sequences")
        taken: set[int] = set()
        rows = []
        for j in order:
            row = self.seqs[j]
            if j in taken:
                for store in row.stores:  # out of a decode arena first: copy the row, not the batch
                    store.fp.own()
                row = copy.deepcopy(row)
            rows.append(row)
            taken.add(j)
        self.seqs, self.arena = rows, None

    def crop(self, max_length: int) -> None:
        """Assisted decoding rolls the cache back; evicted tokens cannot be restored exactly."""
        raise ValueError(
            "ConfKVCache cannot be cropped (assisted or prompt-lookup decoding): tokens already evicted "
            "would not come back; generate without an assistant model"
        )

    # -- Conf-KV ------------------------------------------------------------------------------------
    def observe_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) of the newest position -> confidence (B,), fed to every sequence with
        its policy's weights; sets each sequence's budget for the next step."""
        rows_by_weights: dict = {}
        for row, seq in enumerate(self.seqs):
            rows_by_weights.setdefault(seq.confidence_weights, []).append(row)
        values = torch.empty(len(self.seqs))
        for weights, rows in rows_by_weights.items():  # one batched softmax per distinct weighting
            same = len(rows) == len(self.seqs)  # the usual case: no copy of the (B, V) logits
            values[rows] = confidence(logits if same else logits[rows], weights).cpu()
        for seq, c in zip(self.seqs, values.tolist(), strict=True):
            seq.observe_confidence(c)
        return values

    def positions_for_next(self, n_new: int = 1) -> torch.Tensor:
        """(B, n_new) true positions of the next tokens of every sequence (ragged batches)."""
        starts = torch.tensor([s.seen_tokens for s in self.seqs])
        return starts.unsqueeze(1) + torch.arange(n_new).unsqueeze(0)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.seqs)

    @property
    def peak_bytes(self) -> int:
        return max(s.stats.peak_bytes for s in self.seqs)
