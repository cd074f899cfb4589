"""A decode batch whose FP windows share a ``DecodeArena``: the same logits, statistics and
bytes as each sequence decoded alone, the same bits as the padded workspace path, and rows that
go back to storage of their own when the batch changes."""

from __future__ import annotations

import pytest
import torch

import confkv.cache
from confkv.arena import DecodeArena, arena_for, release_arena
from confkv.cache import ConfKVCache
from confkv.decode import forward, prefill
from tests.helpers import tiny_llama

RANKED = [
    "confkv:n_high=24,n_low=16,p=4,s=2,slack=3",
    "h2o:n=20",
    "confkv:decay=0.5,n_high=30,n_low=30,p=6,s=2",
]
PLAIN = ["full", "window:n=20", "sinks:n=18,s=2"]


@pytest.fixture
def model():
    from confkv.attention import enable

    m = tiny_llama(layers=2, seed=3)
    enable(m)
    return m


def _prefilled(model, policy: str, prompt_len: int):
    cache = ConfKVCache.for_model(model, policy)
    prefill(model, cache, torch.arange(1, prompt_len + 1)[None] % 97 + 1, chunk_size=8)
    return cache.seqs[0]


def _decode(model, seqs, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced decode steps, tokens (B, S) -> logits (S, B, V), one batched forward a step."""
    cache = ConfKVCache(seqs)
    return torch.stack([forward(model, cache, tokens[:, i : i + 1])[:, -1] for i in range(tokens.shape[1])])


def _meta(seq, name):
    return [store.meta(name) for store in seq.stores]


@pytest.fixture(autouse=True)
def _no_arena_left():
    yield
    release_arena()


@pytest.mark.parametrize("policies", [[RANKED[0]] * 3, [RANKED[1]] * 4, [RANKED[2]] * 2, PLAIN, ["full"] * 3])
def test_arena_batch_equals_each_sequence_alone(model, policies, monkeypatch):
    lengths = [17 + 5 * i for i in range(len(policies))]
    batch = [_prefilled(model, p, n) for p, n in zip(policies, lengths, strict=True)]
    alone = [_prefilled(model, p, n) for p, n in zip(policies, lengths, strict=True)]
    tokens = torch.randint(1, 90, (len(policies), 12), generator=torch.Generator().manual_seed(0))
    calls = []
    attend = DecodeArena.attend
    monkeypatch.setattr(
        DecodeArena, "attend", lambda self, layer, *a: calls.append(layer) or attend(self, layer, *a)
    )
    got = _decode(model, batch, tokens)
    monkeypatch.undo()
    arena = getattr(confkv.arena._LOCAL, "arena", None)
    assert isinstance(arena, DecodeArena) and arena.seqs == batch  # the batch really shared one
    assert all(store.fp.home is arena for seq in batch for store in seq.stores)
    if arena.uniform:  # every layer of every step attended over the arena's rows, none padded
        assert calls == list(range(len(batch[0].stores))) * tokens.shape[1]
    for b, seq in enumerate(alone):
        want = _decode(model, [seq], tokens[b : b + 1])[:, 0]
        torch.testing.assert_close(got[:, b], want, atol=2e-5, rtol=2e-5)
        for name in ("pos", "ema", "cum"):
            for x, y in zip(_meta(batch[b], name), _meta(seq, name), strict=True):
                torch.testing.assert_close(x, y, atol=2e-6, rtol=2e-5)
        assert batch[b].nbytes() == seq.nbytes() == sum(s.nbytes() for s in batch[b].stores)
        assert batch[b].stats.peak_bytes == seq.stats.peak_bytes
        assert batch[b].stats.evicted_tokens == seq.stats.evicted_tokens


@pytest.mark.parametrize("policies", [[RANKED[0]] * 3, [RANKED[1]] * 4, PLAIN])
def test_arena_equals_the_padded_workspace_path(model, policies, monkeypatch):
    """Ranked batches: bit for bit (same ops over the same slots; padding is masked). Plain
    ones: one masked SDPA against one SDPA per sequence, equal to rounding."""
    lengths = [15 + 4 * i for i in range(len(policies))]
    tokens = torch.randint(1, 90, (len(policies), 10), generator=torch.Generator().manual_seed(1))
    with_arena = [_prefilled(model, p, n) for p, n in zip(policies, lengths, strict=True)]
    got = _decode(model, with_arena, tokens)
    release_arena()
    monkeypatch.setattr(confkv.cache, "arena_for", lambda seqs: None)
    without = [_prefilled(model, p, n) for p, n in zip(policies, lengths, strict=True)]
    want = _decode(model, without, tokens)
    if policies[0] in RANKED:
        assert torch.equal(got, want)
        for a, b in zip(with_arena, without, strict=True):
            for name in ("pos", "ema", "cum"):
                assert all(torch.equal(x, y) for x, y in zip(_meta(a, name), _meta(b, name), strict=True))
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_statistics_past_the_live_slots_stay_zero(model):
    seqs = [_prefilled(model, RANKED[0], n) for n in (20, 26, 31)]
    _decode(model, seqs, torch.randint(1, 90, (3, 15), generator=torch.Generator().manual_seed(2)))
    arena = confkv.arena._LOCAL.arena
    for layer, t in enumerate(arena.layers):
        for row, seq in enumerate(seqs):
            n = seq.stores[layer].fp.n
            assert n < arena.cap
            for name in ("ema", "cum", "pin"):
                assert not t[name][row, n:].any(), (layer, row, name)


def test_members_leaving_the_batch_get_storage_of_their_own(model):
    seqs = [_prefilled(model, "h2o:n=20", n) for n in (18, 22, 25)]
    tokens = torch.randint(1, 90, (3, 4), generator=torch.Generator().manual_seed(4))
    _decode(model, seqs, tokens)
    first = confkv.arena._LOCAL.arena
    before = [[store.fp.view("k").clone() for store in seq.stores] for seq in seqs]
    _decode(model, seqs[:2], tokens[:2, :1])  # seqs[2] finished its turn: a new, smaller batch
    second = confkv.arena._LOCAL.arena
    assert second is not first and second.seqs == seqs[:2]
    assert all(store.fp.home is None for store in seqs[2].stores)
    for store, k in zip(seqs[2].stores, before[2], strict=True):
        assert torch.equal(store.fp.view("k"), k)  # untouched, now in tensors of its own
        assert (
            store.fp.t["k"].untyped_storage().data_ptr() != first.layers[0]["k"].untyped_storage().data_ptr()
        )
    release_arena()
    assert all(store.fp.home is None for seq in seqs for store in seq.stores)


def test_a_member_outgrowing_the_arena_moves_out_and_the_next_step_rebuilds(model):
    seqs = [_prefilled(model, "full", n) for n in (10, 12)]
    alone = [_prefilled(model, "full", n) for n in (10, 12)]
    steps = 80  # past the build-time headroom
    tokens = torch.randint(1, 90, (2, steps), generator=torch.Generator().manual_seed(5))
    got = _decode(model, seqs, tokens)
    assert confkv.arena._LOCAL.arena.cap >= 12 + steps  # rebuilt at least once, larger
    for b, seq in enumerate(alone):
        torch.testing.assert_close(
            got[:, b], _decode(model, [seq], tokens[b : b + 1])[:, 0], atol=2e-5, rtol=2e-5
        )
        assert seqs[b].nbytes() == seq.nbytes()


def test_no_arena_when_padding_would_double_the_slots(model):
    ragged = [_prefilled(model, "full", n) for n in (5, 7, 400)]
    assert arena_for(ragged) is None
    assert arena_for([_prefilled(model, "full", 5)]) is None  # one sequence: nothing to batch
    similar = [_prefilled(model, "full", n) for n in (100, 120)]
    assert arena_for(similar) is not None


@pytest.mark.parametrize(
    "policies",
    [
        ["h2o:n=20"] * 4,
        ["confkv:n_high=24,n_low=16,p=4,s=2,norm=rank,pool=3"] * 3,
        ["confkv:n_high=24,n_low=16,p=4,s=2,norm=rank,vn=1"] * 3,  # value norms read from the rows
        ["window:n=20", "h2o:n=22", "window:n=20", "h2o:n=22", "full"],  # two groups and an inert member
        ["confkv:n_high=24,n_low=16,p=4,s=2,slack=3"] * 3,  # slack: a member's layers evict together
    ],
)
def test_members_evicting_together_match_each_alone_slot_for_slot(model, policies, monkeypatch):
    """With slack 0 every member at its budget evicts at every layer of every step, in one
    ``evict_rows`` call per policy and step: each ends with exactly the slots (positions, keys, order)
    and counts it has alone, and with ``evict_by_rows(False)`` the batch takes the same path as
    alone."""
    import confkv.arena as arena_mod

    calls: list[int] = []
    real = arena_mod.evict_rows
    monkeypatch.setattr(
        arena_mod, "evict_rows", lambda t, seqs, *a: calls.append(len(seqs)) or real(t, seqs, *a)
    )
    lengths = [18 + 4 * i for i in range(len(policies))]
    tokens = torch.randint(1, 90, (len(policies), 10), generator=torch.Generator().manual_seed(5))
    batch = [_prefilled(model, p, n) for p, n in zip(policies, lengths, strict=True)]
    got = _decode(model, batch, tokens)
    assert calls and max(calls) >= 2
    release_arena()
    calls.clear()
    with arena_mod.evict_by_rows(False):
        one_by_one = [_prefilled(model, p, n) for p, n in zip(policies, lengths, strict=True)]
        assert torch.equal(_decode(model, one_by_one, tokens), got)
    assert not calls
    for b, policy in enumerate(policies):
        seq = _prefilled(model, policy, lengths[b])
        want = _decode(model, [seq], tokens[b : b + 1])[:, 0]
        torch.testing.assert_close(got[:, b], want, atol=2e-5, rtol=2e-5)
        for mine, other, theirs in zip(batch[b].stores, one_by_one[b].stores, seq.stores, strict=True):
            assert torch.equal(mine.meta("pos"), theirs.meta("pos"))
            assert torch.equal(mine.meta("pos"), other.meta("pos"))
            assert torch.equal(mine.fp.view("k"), other.fp.view("k"))
        assert batch[b].stats.evicted_tokens == seq.stats.evicted_tokens
        assert batch[b].stats.evictions_per_step == seq.stats.evictions_per_step
        assert batch[b].nbytes() == seq.nbytes()
