"""Recall tier: exact round trips, hot budget never exceeded, conservation of tokens, and
``recall=0`` bit-for-bit equal to the cache before the tier existed."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from confkv_kernels.reference import decode_attention_ref, quantize_int8_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.attention import enable
from confkv.cache import ConfKVCache
from confkv.cold import ColdStore
from confkv.decode import forward, prefill, teacher_forced_logits
from confkv.memory import KVGeometry
from confkv.policies import parse_policy
from confkv.recall import RecallMode, RecallTier, cold_positions
from confkv.storage import LayerStore
from tests.helpers import tiny_llama

GEOM = KVGeometry(n_layers=1, n_kv_heads=2, head_dim=16, dtype_bytes=4)
RECALL_SPECS = [
    "confkv:n_high=64,n_low=48,p=8,s=2,int8=1,w=16,recall=1,page=8,trigger=gate",
    "confkv:n_high=64,n_low=48,p=8,s=2,int8=1,w=16,recall=1,page=8",
    "confkv:n_high=64,n_low=48,p=8,s=2,recall=1,page=8,trigger=random,rate=0.3",
    "confkv:n_high=64,n_low=48,p=8,s=2,recall=1,page=16,trigger=every,every=5,pyramid=1",
    "h2o:n=64,recall=1,page=8",
    "sinks:s=4,n=64,int8=1,w=16,recall=1,page=8,rtok=16,cold_bytes=20000,vote=sum",
    "window:n=64,recall=1,page=4,trigger=every,every=3",
    "confkv:int8=1,w=16,p=16,recall=1,bytes=40000,page=8,obs=4",
    "confkv:n_high=64,n_low=48,p=8,s=2,int8=1,w=16,recall=1,page=8,vote=sum,pool=1,norm=max",
    # no n_high - n_low room: an unsure step swaps rtok tokens instead of filling
    "confkv:n_high=64,n_low=64,p=8,s=2,int8=1,w=16,recall=1,page=8,trigger=gate,tau=0.5,rtok=16,attn=sum",
    # the deepest pyramid layer sits at p+s+1: no slot to spare for a page summary (fuzz)
    "confkv:n_high=24,n_low=20,p=8,s=2,pyramid=1,int8=1,w=8,recall=1,page=4,trigger=gate",
]


def _int8_tokens(n: int, start: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k8, ks = quantize_int8_ref(torch.randn(2, n, 16, generator=g))
    v8, vs = quantize_int8_ref(torch.randn(2, n, 16, generator=g))
    pos = torch.arange(start, start + n)
    return {
        "k": k8,
        "v": v8,
        "ks": ks,
        "vs": vs,
        "pos": pos,
        "ema": torch.rand(n, generator=g),
        "cum": torch.rand(n, generator=g),
    }


def test_cold_store_allocates_no_slot_past_the_pages_of_positions_seen():
    """Pages are position-aligned, so a tier can never use more slots than the pages of the
    positions it has seen: it allocates no more (no doubling past them), and its allocated bytes
    stay within the policy's worst case that a worker reserves in its host pool."""
    cold = ColdStore(GEOM, page=8, device="cpu")
    tokens = _int8_tokens(41, start=0)
    first = torch.arange(0, 21)  # a prefill chunk: positions 0..20, pages 0-2
    cold.add({name: t.index_select(0 if t.dim() == 1 else 1, first) for name, t in tokens.items()})
    assert cold.page_id.shape[0] == 3 and cold.reserved_bytes() == 3 * 8 * GEOM.int8_token_bytes
    for i in range(21, 41):  # decode steps, one token each
        one = torch.tensor([i])
        cold.add({name: t.index_select(0 if t.dim() == 1 else 1, one) for name, t in tokens.items()})
        assert cold.page_id.shape[0] <= -(-(i + 1) // 8)
    policy = parse_policy("h2o:n=16,recall=1,page=8")
    assert cold.reserved_bytes() <= policy.worst_case_cold_bytes(GEOM, 41)
    assert cold.nbytes() == 41 * GEOM.int8_token_bytes <= cold.reserved_bytes()


def test_page_is_bounded():
    assert parse_policy("confkv:recall=1,page=1024").page == 1024
    with pytest.raises(ValueError, match="page must be <= 1024"):
        parse_policy("confkv:recall=1,page=100000")


def test_cold_round_trip_is_exact():
    cold = ColdStore(GEOM, page=8, device="cpu")
    tokens = _int8_tokens(37, start=5)
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(3))
    first, second = perm[:20], perm[20:]
    for part in (first, second):  # evicted in two batches, out of order
        cold.add({name: t.index_select(0 if t.dim() == 1 else 1, part) for name, t in tokens.items()})
    assert cold.n_tokens == 37 and cold.nbytes() == 37 * GEOM.int8_token_bytes
    back = cold.take(torch.tensor(sorted(cold.slot_of.values())))
    order = back["pos"].argsort()
    assert torch.equal(back["pos"][order], tokens["pos"])
    for name in ("k", "v"):
        assert torch.equal(back[name][:, order], tokens[name])
    for name in ("ks", "vs"):
        assert torch.equal(back[name][:, order], tokens[name])
    for name in ("ema", "cum"):
        assert torch.equal(back[name][order], tokens[name])
    # recalled tokens leave shadows: stored (counted), never recalled again while hot
    assert cold.n_tokens == 0 and cold.n_shadow == 37 and cold.nbytes() == 37 * GEOM.int8_token_bytes
    assert int(cold.page_counts().sum()) == 0 and not bool(cold.valid.any())
    # a page of shadows only holds no cold token: its summary is not a live (hot) summary
    assert cold.n_pages == 0 and cold.summary_bytes() == 0 and len(cold.slot_of) == 6
    # evicted again (new scores): they turn valid in place, and a second recall is exact too
    back["ema"], back["cum"] = back["ema"] + 1, back["cum"] + 2
    k8_before = cold.k8.clone()
    cold.add({name: t for name, t in back.items()})
    assert cold.n_tokens == 37 and cold.n_shadow == 0 and torch.equal(cold.k8, k8_before)
    again = cold.take(torch.tensor(sorted(cold.slot_of.values())))
    order2 = again["pos"].argsort()
    for name in ("k", "v", "ks", "vs"):
        assert torch.equal(again[name][:, order2], tokens[name])
    for name, plus in (("ema", 1), ("cum", 2)):
        assert torch.equal(again[name][order2], tokens[name] + plus)
    # a bounded tier drops shadow-only pages first and counts no token as lost
    assert cold.drop_to(0, 0) == 0 and cold.dropped_tokens == 0
    assert cold.n_shadow == 0 and cold.n_pages == 0 and cold.summary_bytes() == 0 and cold.nbytes() == 0


def test_cold_shadows_are_dropped_before_cold_tokens():
    cold = ColdStore(GEOM, page=8, device="cpu")
    cold.add(_int8_tokens(16, start=0))  # pages 0 and 1
    cold.take(torch.tensor([cold.slot_of[0]]))  # page 0 is hot now: shadows only
    assert cold.n_pages == 1 and cold.nbytes() == 16 * GEOM.int8_token_bytes
    assert cold.drop_to(1, 8) == 0  # the shadow-only page goes, no cold token is lost
    assert list(cold.slot_of) == [1] and cold.n_tokens == 8 and cold.n_shadow == 0
    assert cold.drop_to(0, 1 << 62) == 8 and cold.dropped_tokens == 8


def test_cold_drop_margin_drops_below_the_bound_least_attended_first():
    cold = ColdStore(GEOM, page=8, device="cpu")
    tokens = _int8_tokens(80, start=0)  # pages 0..9
    tokens["cum"] = torch.arange(80, dtype=torch.float32).flip(0)  # older pages more attended
    cold.add(tokens)
    assert cold.drop_to(10, 1 << 62, margin=0.5) == 0  # within the bound: nothing moves
    assert cold.drop_to(8, 1 << 62, margin=0.5) == 8 * 6  # over it: down to 8 - 4 pages
    assert sorted(cold.slot_of) == [0, 1, 2, 3] and cold.n_pages == 4 and cold.dropped_tokens == 48
    # the token bound takes the same margin: 32 stored tokens over 24 -> at most 12 left
    assert cold.drop_to(4, 24, margin=0.5) == 24 and sorted(cold.slot_of) == [0]
    assert cold.n_tokens == 8 and cold.nbytes() == 8 * GEOM.int8_token_bytes


def test_cold_forget_from_drops_valid_and_shadow_tokens():
    cold = ColdStore(GEOM, page=8, device="cpu")
    cold.add(_int8_tokens(20, start=0))  # pages 0, 1, 2 (4 tokens)
    cold.take(torch.tensor([cold.slot_of[1]]))
    cold.forget_from(12)  # page 1 keeps 8..11 as shadows, page 2 goes
    assert sorted(cold.slot_of) == [0, 1] and cold.n_tokens == 8 and cold.n_shadow == 4
    assert cold.n_pages == 1  # page 1 holds shadows only
    assert cold.nbytes() == 12 * GEOM.int8_token_bytes


def test_attention_over_recalled_cache_equals_never_evicted():
    """INT8 tokens evicted and recalled attend exactly like tokens that never left."""
    store = LayerStore(2, 16, torch.float32, "cpu", int8=True, window=4)
    g = torch.Generator().manual_seed(0)
    store.append(torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g))
    store.demote_old()  # 36 INT8 + 4 FP

    def attend(s):
        q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(9))
        k8, k8s, v8, v8s, kf, vf = s.kv_views()
        off8 = torch.tensor([0, k8.shape[1]], dtype=torch.int32)
        offf = torch.tensor([0, kf.shape[1]], dtype=torch.int32)
        return decode_attention_ref(q, k8, k8s, v8, v8s, kf, vf, off8, offf, 0.25)[0]

    before = attend(store)
    cold = ColdStore(GEOM, page=8, device="cpu")
    evict = torch.zeros(len(store), dtype=torch.bool)
    evict[torch.tensor([1, 2, 3, 9, 10, 17, 30, 31])] = True
    cold.add(store.evict_int8(~evict))
    assert len(store) == 32
    back = cold.take(torch.tensor(sorted(cold.slot_of.values())))
    back["pin"] = torch.zeros(back["pos"].shape[0], dtype=torch.long)
    store.insert_int8(back)
    assert torch.allclose(attend(store), before, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    batches=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=5),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 10_000),
)
def test_merged_page_bounds_cover_every_cold_key(batches, scale, seed):
    """Bounds widened batch by batch still hold every key: scores upper-bound the true max q.k."""
    g = torch.Generator().manual_seed(seed)
    cold = ColdStore(GEOM, page=8, device="cpu")
    positions = torch.randperm(64, generator=g)
    used = 0
    for n in batches:
        part = positions[used : used + n]
        used += n
        k8, ks = quantize_int8_ref(torch.randn(2, n, 16, generator=g) * scale)
        z = torch.zeros(n)
        cold.add({"k": k8, "v": k8, "ks": ks, "vs": ks, "pos": part, "ema": z, "cum": z})
    q = torch.randn(4, 3, 16, generator=g)
    scores = cold.scores(q, torch.zeros(4, 3), 1.0)
    keys = cold.k8.float() * cold.ks.float().unsqueeze(-1)  # (P, Hkv, S, D)
    for slot in cold.slot_of.values():
        valid = cold.valid[slot]
        k = keys[slot][:, valid]  # (Hkv, n, D)
        true = torch.einsum("hmd,hnd->hmn", q.reshape(2, 6, 16), k).max()
        assert scores[slot] >= true - 1e-4 * (1 + true.abs())


@pytest.mark.parametrize("spec", RECALL_SPECS)
def test_hot_bytes_within_budget_and_tokens_conserved(tiny_model, token_ids, spec):
    cache = ConfKVCache.for_model(tiny_model, spec)
    seq = cache.seqs[0]
    bound = seq.policy.peak_bytes_bound(seq.geometry)
    peaks = []
    original = seq._refresh_bytes

    def spy(layer):
        original(layer)
        peaks.append(seq.nbytes())

    seq._refresh_bytes = spy
    teacher_forced_logits(tiny_model, cache, token_ids[:, :240], prefix=150)
    assert max(peaks) <= bound and seq.stats.peak_bytes <= bound
    peak_budgets = seq.policy.layer_budgets(seq.rule.peak, seq.geometry.n_layers)
    for layer, (store, cold) in enumerate(zip(seq.stores, seq.tier.cold, strict=True)):
        assert len(store) <= peak_budgets[layer]
        # every token seen is hot, cold, or dropped by the bounded cold tier (and counted)
        assert len(store) + cold.n_tokens + cold.dropped_tokens == seq.seen_tokens
        queued = cold.nbytes()
        cold.settle()  # queued evictions go into their pages; counts were exact before
        assert cold.nbytes() == queued
        per_slot = cold.valid.sum(1)
        assert per_slot.tolist() == cold.counts and cold.n_pages == int((per_slot > 0).sum())
        stored = cold.valid | cold.shadow  # shadows: recalled tokens' payload, kept for re-eviction
        assert not bool((cold.valid & cold.shadow).any())
        assert cold.nbytes() == sum(
            t[stored].nbytes for t in (cold.k8.transpose(1, 2), cold.v8.transpose(1, 2))
        ) + sum(t[stored].nbytes for t in (cold.ks.transpose(1, 2), cold.vs.transpose(1, 2)))
        # a shadow is exactly the hot INT8 token at its position, and only hot tokens have one
        slot_off = cold.shadow.nonzero()
        if slot_off.numel():
            shadow_pos = cold.page_id[slot_off[:, 0]] * cold.page + slot_off[:, 1]
            hot_pos = store.q.view("pos")
            assert bool(torch.isin(shadow_pos, hot_pos).all())
            at = (hot_pos.unsqueeze(1) == shadow_pos.unsqueeze(0)).float().argmax(0)
            for name, mine in (("k", cold.k8), ("v", cold.v8), ("ks", cold.ks), ("vs", cold.vs)):
                hot = store.q.view(name)[:, at]
                assert torch.equal(mine[slot_off[:, 0], :, slot_off[:, 1]].transpose(0, 1), hot)
        # hot bytes = stored hot tensors + live page summaries
        assert seq.layer_bytes[layer] == store.nbytes() + cold.summary_bytes()
    assert seq._cold_bytes == seq.cold_nbytes() <= seq.stats.peak_cold_bytes  # tracked per layer
    assert seq.stats.recalled_tokens > 0
    if seq.policy.cold_bytes:
        assert seq.stats.peak_cold_bytes <= seq.policy.cold_bytes
        # the host memory it holds too: its page slots, whole, stay within the bound
        assert seq.cold_reserved_bytes() <= seq.policy.cold_bytes
    assert seq.cold_reserved_bytes() <= seq.policy.worst_case_cold_bytes(seq.geometry, seq.seen_tokens)


@pytest.mark.parametrize(
    "spec",
    ["h2o:n=64,recall=1,page=8", "confkv:n_high=64,n_low=48,p=8,s=2,int8=1,w=16,recall=1,page=8"],
)
def test_prompt_end_only_tiers_keep_no_page_bounds(tiny_model, token_ids, spec):
    """With no decode-step trigger (the default, ``trigger=prompt``) nothing scores pages by their
    key bounds (the prompt-end probe reads the cold keys), so the tier keeps none: no hot bytes,
    no hot slots for summaries, and the same page limit as a tier with bounds. A gated tier on
    the same text keeps them."""
    cache = ConfKVCache.for_model(tiny_model, spec)
    seq = cache.seqs[0]
    assert seq.policy.recall_trigger == "prompt"
    teacher_forced_logits(tiny_model, cache, token_ids[:, :240], prefix=150)
    assert seq.stats.recalled_tokens > 0 and seq.cold_nbytes() > 0
    for layer, (store, cold) in enumerate(zip(seq.stores, seq.tier.cold, strict=True)):
        assert not cold.bounds and cold.n_pages > 0 and cold.summary_bytes() == 0
        assert cold.lo8.numel() == cold.hi8.numel() == cold.sscale.numel() == 0 and not cold._pending
        assert seq.hot_budget(layer) == seq.layer_budgets[layer]
        assert seq.layer_bytes[layer] == store.nbytes()
        with pytest.raises(RuntimeError, match="no key bounds"):
            cold.scores(torch.zeros(4, 1, 16), torch.zeros(4, 1), 0.25)
    if spec.startswith("confkv"):  # the same tier with the confidence gate keeps bounds
        gated = ConfKVCache.for_model(tiny_model, spec + ",trigger=gate")
        teacher_forced_logits(tiny_model, gated, token_ids[:, :240], prefix=150)
        assert sum(c.summary_bytes() for c in gated.seqs[0].tier.cold) > 0
        assert gated.seqs[0].tier.max_pages == seq.tier.max_pages


@pytest.mark.parametrize("tokens", [None, 0, 3])
def test_a_cold_bound_below_one_page_per_layer_keeps_nothing_cold(tiny_model, token_ids, tokens):
    """``cold_bytes`` smaller than one page per layer (1 byte; less than one INT8 token; three
    tokens of a page of 8) is a bound of zero page slots, not "no bound" (1 // n_layers once read
    as unbounded and overran a worker's host pool; fuzz): nothing is stored or allocated."""
    geometry = ConfKVCache.for_model(tiny_model, "sinks:s=4,n=48").seqs[0].geometry
    per_token = geometry.n_layers * geometry.int8_token_bytes
    cold_bytes = 1 if tokens is None else tokens * per_token + per_token - 1
    cache = ConfKVCache.for_model(tiny_model, f"sinks:s=4,n=48,recall=1,page=8,cold_bytes={cold_bytes}")
    seq = cache.seqs[0]
    assert seq.policy.cold_slots_per_layer(geometry) == 0
    teacher_forced_logits(tiny_model, cache, token_ids[:, :160], prefix=100)
    assert seq.stats.peak_cold_bytes == 0 and seq.cold_nbytes() == 0 and seq.cold_reserved_bytes() == 0
    assert seq.stats.cold_dropped_tokens > 0
    assert seq.stats.cold_dropped_tokens == seq.stats.evicted_tokens > 0  # every eviction is counted


def test_a_prompt_fed_by_model_generate_warns_that_the_probe_did_not_run(tiny_model, token_ids):
    """``model.generate`` feeds the prompt itself, so the prompt-end probe cannot run: a recall
    cache says so once (a warning), rather than recalling less without a word; confkv.decode's
    own prefill does not warn, and neither does a cache without a recall tier."""
    import warnings

    from confkv.decode import generate

    ids = token_ids[:, :120]
    spec = "h2o:n=48,recall=1,page=8"
    cache = ConfKVCache.for_model(tiny_model, spec)
    with pytest.warns(UserWarning, match="prompt-end probe") as caught:
        tiny_model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        tiny_model.generate(
            ids, past_key_values=ConfKVCache.for_model(tiny_model, "h2o:n=48"), max_new_tokens=2
        )
    assert sum("prompt-end probe" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*prompt-end probe.*")
        generate(tiny_model, ConfKVCache.for_model(tiny_model, spec), ids, 3)


def test_gated_recall_reads_cold_only_on_unsure_steps(tiny_model, token_ids):
    """trigger=gate: recall events happen at the prompt end and on steps with c < tau only."""
    cache = ConfKVCache.for_model(
        tiny_model, "confkv:n_high=64,n_low=40,p=8,s=2,recall=1,page=8,tau=0.02,trigger=gate"
    )
    seq = cache.seqs[0]
    fired = []
    decide = seq.tier.decide

    def spy(unsure):
        fired.append((unsure, decide(unsure)))
        return fired[-1][1]

    seq.tier.decide = spy
    teacher_forced_logits(tiny_model, cache, token_ids[:, :160], prefix=80)
    assert fired and all(f == u for u, f in fired)


def test_gated_recall_without_room_swaps_on_unsure_steps(tiny_model, token_ids):
    """n_low = n_high leaves an unsure step no room to fill: it swaps up to ``rtok`` tokens with
    the lowest-scored hot ones (the hot size stays), and confident steps read nothing cold."""
    spec = "confkv:n_high=64,n_low=64,p=8,s=2,recall=1,page=8,tau=0.5,rtok=16,trigger=gate"
    cache = ConfKVCache.for_model(tiny_model, spec)
    seq = cache.seqs[0]
    modes = []
    decide = seq.tier.decide

    def spy(unsure):  # every other step unsure (a random model's confidence barely moves)
        unsure = len(modes) % 2 == 0
        fire = decide(unsure)
        modes.append((unsure, seq.tier.mode))
        return fire

    seq.tier.decide = spy
    teacher_forced_logits(tiny_model, cache, token_ids[:, :200], prefix=80)
    assert {m for u, m in modes if u} == {RecallMode.SWAP}
    assert {m for u, m in modes if not u} == {RecallMode.NONE}
    events = [e for e in seq.tier.pop_events() if e.mode == "swap"]
    assert events and max(e.tokens for e in events) <= 16
    assert all(len(store) <= 64 for store in seq.stores)


def test_stok_bounds_decode_step_swaps_and_leaves_prompt_end_recall_to_rtok(tiny_model, token_ids):
    """``stok`` caps what one decode-step swap brings back; the prompt-end probe keeps ``rtok``'s
    rule (0: half the budget), and ``stok=0`` falls back to ``rtok`` (every older spec's meaning)."""

    def make(spec: str) -> RecallTier:
        return RecallTier(parse_policy(spec), GEOM, "cpu", torch.Generator())

    tier = make("confkv:n_high=64,n_low=64,p=8,recall=1,trigger=gate,stok=8")
    assert tier.swap_tokens(64, step=True) == 8
    assert tier.swap_tokens(64) == 32  # prompt end: half the budget
    tier = make("confkv:n_high=64,n_low=64,p=8,recall=1,rtok=16")
    assert tier.swap_tokens(64, step=True) == tier.swap_tokens(64) == 16
    # in a run: every decode-step swap brings back at most stok tokens
    spec = "confkv:n_high=64,n_low=64,p=8,s=2,recall=1,page=4,trigger=every,every=2,stok=8"
    cache = ConfKVCache.for_model(tiny_model, spec)
    teacher_forced_logits(tiny_model, cache, token_ids[:, :200], prefix=80)
    steps = [e for e in cache.seqs[0].tier.pop_events() if e.position > 80]
    assert steps and max(e.tokens for e in steps) <= 8
    with pytest.raises(ValueError, match="stok"):
        parse_policy("confkv:recall=1,stok=-1")
    with pytest.raises(ValueError, match="only with recall=1"):
        parse_policy("confkv:stok=8")
    with pytest.raises(ValueError, match="stok sizes decode-step swaps"):
        parse_policy("confkv:recall=1,stok=8")  # prompt-end recall only: it would do nothing


def test_keys_of_a_trigger_not_used_are_refused():
    """A key that only a trigger the spec does not use reads would change nothing: it is an error,
    not a silent no-op (``rate`` without ``trigger=random``, ``every`` without ``trigger=every``)."""
    for spec, key in (("h2o:recall=1,rate=0.2", "rate"), ("confkv:recall=1,trigger=gate,every=2", "every")):
        with pytest.raises(ValueError, match=f"{key} applies only with trigger="):
            parse_policy(spec)
    assert parse_policy("h2o:recall=1,trigger=random,rate=0.2").rate == 0.2
    assert parse_policy("sinks:recall=1,trigger=every,every=2").every == 2


def test_recall_spec_validation():
    bad_specs = (
        "full:recall=1",
        "h2o:recall=1,trigger=gate",
        "confkv:recall=1,trigger=random",
        "confkv:recall=1,trigger=every",
        "confkv:recall=1,page=0",
        "confkv:recall=1,cold_bytes=-1",
        "confkv:recall=1,vote=max",
    )
    for bad in bad_specs:
        with pytest.raises(ValueError):
            parse_policy(bad)
    assert parse_policy("confkv:int8=1,recall=1").recall_trigger == "prompt"  # the default
    assert parse_policy("confkv:int8=1,recall=1,trigger=gate").recall_trigger == "gate"
    assert parse_policy("h2o:recall=1").recall_trigger == "prompt"
    # recall keys without recall=1 would silently do nothing: they are refused, with the fix
    for idle in ("h2o:n=64,page=8", "confkv:rtok=8,int8=1", "window:n=16,recall=0,vote=sum,cold_bytes=9"):
        with pytest.raises(ValueError, match=r"appl(y|ies) only with recall=1 \(add recall=1\)"):
            parse_policy(idle)


# Kept positions, greedy tokens and peak bytes of a teacher-forced run on the tiny Llama,
# produced by the cache before the recall tier existed (commit e2d42bd): recall=0 is unchanged.
SEED_FINGERPRINTS = {
    "window:n=48": "e2550ed1264f5e88",
    "sinks:s=4,n=48": "6330ebc50fdbd7e8",
    "h2o:n=48": "3b5a7bcb85e7fad7",
    "h2o:n=48,int8=1,w=16": "2c306a0cf573b680",
    "confkv:n_high=48,n_low=40,p=8,s=2": "6836e4ebb129c69e",
    "confkv:n_high=48,n_low=40,p=8,s=2,int8=1,w=16,pyramid=1": "b7223742fb24949f",
    "random:n_high=48,n_low=40,p=8,s=2": "47b36a7f3b0b6bf0",
    "recency:n_high=48,n_low=40,p=8,s=2": "fd71fefb1ddf093f",
    "attention:n_high=48,n_low=40,p=8,s=2,slack=4": "3f4bb481634b9da8",
}


@pytest.fixture(scope="module")
def tiny_llama_model():
    """The exact tiny Llama the fingerprints were taken on (seed 0)."""
    model = tiny_llama(layers=3, seed=0)
    enable(model)
    return model


def _seed_teacher_forced(model, cache: ConfKVCache, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """``teacher_forced_logits`` with the seed's prefill schedule: every chunk the size of the
    budget less the protected tokens (the cache may now take a budget-sized first chunk), so the
    fingerprints compare the cache's behaviour, not where a prompt is cut."""
    seq = cache.seqs[0]
    pol = seq.policy
    size = min(256, min(seq.layer_budgets) - pol.protected - pol.s) if pol.evicts else 256
    size = min(size, pol.w) if pol.int8 else size
    last = (prefix - 1) // size * size  # where the final chunk starts
    for start in range(0, last, size):
        forward(model, cache, ids[:, start : start + size])
    return teacher_forced_logits(model, cache, ids[:, last:], prefix=prefix - last)  # one final chunk


@pytest.mark.parametrize("spec", sorted(SEED_FINGERPRINTS))
def test_recall_off_is_bit_for_bit_the_seed_cache(tiny_llama_model, spec):
    ids = torch.randint(0, 101, (1, 200), generator=torch.Generator().manual_seed(1))
    cache = ConfKVCache.for_model(tiny_llama_model, spec)
    logits = _seed_teacher_forced(tiny_llama_model, cache, ids, prefix=64)
    seq = cache.seqs[0]
    fingerprint = {
        "pos": [sorted(s.meta("pos").tolist()) for s in seq.stores],
        "argmax": logits.argmax(-1).tolist(),
        "peak": seq.stats.peak_bytes,
    }
    digest = hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest()[:16]
    assert digest == SEED_FINGERPRINTS[spec]


def test_generate_trace_shows_recall_events_and_cold_bytes(tiny_model, token_ids):
    from confkv.decode import generate

    cache = ConfKVCache.for_model(tiny_model, "h2o:n=48,recall=1,page=8,trigger=every,every=2")
    out = generate(tiny_model, cache, token_ids[:, :120], max_new_tokens=6, trace=True)
    events = [e for row in out.trace for e in row["recalls"]]
    assert events and {"position", "layer", "mode", "pages", "tokens"} <= set(events[0])
    assert out.trace[0]["recalls"][0]["mode"] == "swap"  # the prompt end
    assert all(row["cold_bytes"] > 0 for row in out.trace)
    assert sum(e["tokens"] for e in events) == cache.seqs[0].stats.recalled_tokens
    # ``confkv generate`` puts the tier's totals in the trace header and its summary line
    from confkv.cli.generate import cold_fields, cold_line

    seq = cache.seqs[0]
    head = cold_fields(seq)
    assert head["recalled_tokens"] == seq.stats.recalled_tokens > 0
    assert head["peak_cold_bytes"] >= head["cold_bytes"] == out.trace[-1]["cold_bytes"] > 0
    assert head["recall_steps"] == 3 and f"recalled {seq.stats.recalled_tokens} tokens" in cold_line(seq)
    plain = ConfKVCache.for_model(tiny_model, "h2o:n=48").seqs[0]
    assert cold_fields(plain) == {} and cold_line(plain) == ""


def test_worst_case_cold_bytes_and_plan_host_column():
    from confkv.plan import PlanRequest, make_plan, resolve_model

    geometry = KVGeometry(n_layers=30, n_kv_heads=3, head_dim=64, dtype_bytes=4)
    assert parse_policy("confkv:int8=1").worst_case_cold_bytes(geometry, 4096) == 0
    every = 4096 * geometry.int8_token_bytes * 30
    assert parse_policy("confkv:int8=1,recall=1").worst_case_cold_bytes(geometry, 4096) == every
    # cold_bytes counts whole pages per layer: 10**6 / 30 layers holds 2 pages of 32 INT8 tokens
    pages = 10**6 // 30 // (32 * geometry.int8_token_bytes)
    assert pages == 2
    bounded = parse_policy("h2o:recall=1,cold_bytes=1e6").worst_case_cold_bytes(geometry, 4096)
    assert bounded == pages * 32 * geometry.int8_token_bytes * 30 <= 10**6
    plan = make_plan(
        PlanRequest(
            model=resolve_model("qwen2.5-32b"),
            memory_bytes=141 * 2**30,
            policy=parse_policy("confkv:int8=1,recall=1"),
            context_tokens=1000,
            generated_tokens=24,
        )
    )
    assert plan["host_bytes_per_session"] > plan["session_bytes_worst"] > 0


def test_prompt_end_reselection_takes_what_the_probe_ranks_first(tiny_model, token_ids):
    """reselect: protected tokens stay, hot tokens and whole cold pages are chosen by importance
    within the capacity, at most max_recall tokens come back, and the top-ranked cold page wins."""
    cache = ConfKVCache.for_model(tiny_model, "h2o:n=64,recall=1,page=8")
    prefill(tiny_model, cache, token_ids[:, :200])
    seq = cache.seqs[0]
    tier, store, cold = seq.tier, seq.stores[0], seq.tier.cold[0]
    assert cold.n_tokens > 0
    length = seq.seen_tokens
    g = torch.rand(length, generator=torch.Generator().manual_seed(0)) * 0.1
    target = next(iter(cold.slot_of))  # a cold page id
    g[target * 8 : target * 8 + 8] = 5.0
    pos = store.meta("pos")
    protected = pos >= length - seq.policy.protected
    capacity = seq.hot_budget(0) - int(protected.sum())
    keep, slots = tier.reselect(0, store, g, protected, capacity, max_recall=16)
    assert bool(keep[protected].all())
    taken = int(cold.page_counts()[slots].sum())
    assert taken <= 16
    assert int((keep & ~protected).sum()) + taken <= capacity
    assert cold.slot_of[target] in slots.tolist()
    # the chosen hot tokens are the most important unprotected ones
    chosen, dropped = g[pos[keep & ~protected]], g[pos[~keep]]
    if chosen.numel() and dropped.numel():
        assert float(chosen.min()) >= float(dropped.max())


def test_prompt_end_recall_keeps_the_hot_budget(tiny_model, token_ids):
    """A whole prompt end (probe, rollback, re-selection, tail) never exceeds the hot budget and
    conserves tokens; recalled tokens come back with their true positions."""
    cache = ConfKVCache.for_model(tiny_model, "confkv:n_high=64,n_low=48,p=8,s=2,recall=1,page=8,obs=8")
    prefill(tiny_model, cache, token_ids[:, :220])
    seq = cache.seqs[0]
    assert seq.stats.recalled_tokens > 0
    for layer, store in enumerate(seq.stores):
        assert len(store) <= seq.layer_budgets[layer]
        pos = store.meta("pos")
        assert pos.unique().numel() == pos.numel() and int(pos.max()) < seq.seen_tokens
        cold = seq.tier.cold[layer]
        assert len(store) + cold.n_tokens + cold.dropped_tokens == seq.seen_tokens


def test_prompt_end_choice_survives_the_first_confident_step(tiny_model, token_ids):
    """A prompt that fits n_high but not n_low has nothing cold at the probe, yet the first
    confident step trims to n_low: the probe still runs, its choice fits the n_low budget and
    every token it pinned is still hot after that step (what the trim evicts goes cold)."""
    from confkv.decode import decode_one_token

    spec = "confkv:n_high=64,n_low=40,p=8,s=2,recall=1,page=8,obs=8"
    cache = ConfKVCache.for_model(tiny_model, spec)
    seq = cache.seqs[0]
    assert seq.needs_probe(8) is False  # empty cache: nothing to decide
    prefill(tiny_model, cache, token_ids[:, :60])
    assert seq.tier.cold_bytes() == 0 or seq.stats.evicted_tokens > 0
    pinned = []
    for layer, store in enumerate(seq.stores):
        mask = store.meta("pin") >= store.next_pos
        assert int(mask.sum()) <= seq.tier.floor_hot_budget(layer)
        pinned.append(set(store.meta("pos")[mask].tolist()))
    assert any(pinned), "the probe pinned nothing"
    seq.observe_confidence(1.0)  # sure: the next step keeps n_low
    decode_one_token(tiny_model, cache, token_ids[:, 60])
    for layer, store in enumerate(seq.stores):
        assert len(store) <= seq.layer_budgets[layer]
        assert pinned[layer] <= set(store.meta("pos").tolist())


def test_vote_last_weighs_each_head_by_the_last_query(tiny_model, token_ids):
    """``vote=last``: per query head, the last probe query's weight on every hot and cold token,
    relative to the hot set: exp(scaling q.k - logsumexp over the hot keys)."""
    from confkv_kernels.reference import dequantize_int8_ref

    cache = ConfKVCache.for_model(tiny_model, "h2o:n=64,int8=1,w=16,recall=1,page=8,vote=last")
    prefill(tiny_model, cache, token_ids[:, :150])
    seq = cache.seqs[0]
    tier, store, cold = seq.tier, seq.stores[0], seq.tier.cold[0]
    assert cold.n_tokens > 0 and store.q.n > 0
    hkv, d = store.fp.t["k"].shape[0], store.fp.t["k"].shape[-1]
    hq = 2 * hkv
    q = torch.randn(hq, 3, d, generator=torch.Generator().manual_seed(4))
    tier.vote(0, q, store, 0.25)  # vote=last: only the last of the 3 queries votes
    k8, k8s, _, _, kf, _ = store.kv_views()
    hot = torch.cat([dequantize_int8_ref(k8, k8s, torch.float32), kf.float()], dim=1)  # (Hkv, N, D)
    rows = cold.valid.nonzero(as_tuple=True)
    cold_keys = (cold.k8.float() * cold.ks.float().unsqueeze(-1)).permute(0, 2, 1, 3)[rows]  # (n, Hkv, D)
    pos, w = tier.hot_mass[0]
    cpos, cw = tier.cold_mass[0]
    assert w.shape == (hq, len(store)) and cw.shape == (hq, cold.n_tokens)
    for h in range(hq):
        qh = q[h, -1].float()
        hot_logits = hot[h // 2] @ qh * 0.25
        lse = hot_logits.logsumexp(0)
        torch.testing.assert_close(w[h], (hot_logits - lse).exp())
        torch.testing.assert_close(cw[h], (cold_keys[:, h // 2] @ qh * 0.25 - lse).exp())
    assert torch.equal(pos, store.meta("pos"))
    assert torch.equal(cpos, cold_positions(cold)[cold.valid])


def test_vote_last_ranks_what_one_head_points_at(tiny_model, token_ids):
    """One head of one layer puts most of its weight on a cold fact; every other head spreads
    over a long stretch and pours mass on the sinks and the recent window. ``vote=sum`` ranks
    the fact below that stretch, ``vote=last`` ranks it first; the sinks and the protected
    window get no vote (they are kept anyway)."""
    cache = ConfKVCache.for_model(tiny_model, "h2o:n=64,recall=1,page=8,vote=last")
    prefill(tiny_model, cache, token_ids[:, :120])
    seq = cache.seqs[0]
    tier = seq.tier
    length, fact = seq.seen_tokens, 40
    hq = 4
    for layer in range(len(seq.stores)):
        pos = torch.arange(length)
        w = torch.full((hq, length), 1e-4)
        w[:, :4] = 5.0  # sinks
        w[:, length - 8 :] = 5.0  # the protected window
        w[:, 60:100] = 0.3  # a long, locally attended stretch
        if layer == 0:
            w[1, fact] = 0.9  # one retrieval head
        tier.hot_mass[layer] = (pos, w)
        tier.cold_mass.pop(layer, None)
    last = tier.importance(length, (4, length - 8))
    assert int(last.argmax()) in range(fact - 3, fact + 4) and float(last[fact]) == float(last.max())
    # the same votes, summed over heads and layers (the ``sum`` probe's combination)
    for layer, (pos, w) in list(tier.hot_mass.items()):
        tier.hot_mass[layer] = (pos, w.sum(0))
    tier.policy = tier.policy.replace(vote="sum")
    summed = tier.importance(length, (4, length - 8))
    assert float(summed[fact]) < float(summed[70])
    tier.clear_probe()


def test_widened_bounds_equal_summarizing_the_new_keys_then_merging():
    """``_widen_bounds`` (scatter min/max) equals its kernel definition: summarize the new keys
    as pages (``summarize_pages``), then summarize {old lo, old hi, new lo, new hi}."""
    from confkv_kernels import summarize_pages

    g = torch.Generator().manual_seed(0)
    geom = KVGeometry(n_layers=1, n_kv_heads=3, head_dim=16, dtype_bytes=4)
    for _ in range(40):
        cold = ColdStore(geom, page=8, device="cpu")
        cold._grow(6, pages_seen=6)
        slots = torch.tensor([0, 2, 5])
        cold.lo8[:] = torch.randint(-128, 0, cold.lo8.shape, dtype=torch.int8, generator=g)
        cold.hi8[:] = torch.randint(0, 127, cold.hi8.shape, dtype=torch.int8, generator=g)
        cold.sscale[:] = (torch.rand(cold.sscale.shape, generator=g) * 0.1).half()
        cold.sscale[2] = 0  # a page without bounds yet
        local = torch.cat([torch.arange(3), torch.randint(0, 3, (9,), generator=g)])  # <= 8 per page
        k8, ks = quantize_int8_ref(torch.randn(3, 12, 16, generator=g) * 3)
        offset = torch.cat([(local[: i + 1] == local[i]).sum().view(1) - 1 for i in range(12)])
        block_k = torch.zeros(3, 3, 8, 16, dtype=torch.int8)
        block_s = torch.zeros(3, 3, 8, dtype=torch.float16)
        block_valid = torch.zeros(3, 8, dtype=torch.bool)
        block_k[local, :, offset] = k8.transpose(0, 1)
        block_s[local, :, offset] = ks.transpose(0, 1)
        block_valid[local, offset] = True
        new_lo, new_hi, new_s = summarize_pages(block_k, block_s, block_valid)
        old_lo, old_hi, old_s = cold.lo8[slots], cold.hi8[slots], cold.sscale[slots]
        had = (old_s != 0).any(-1)
        want = summarize_pages(
            torch.stack([old_lo, old_hi, new_lo, new_hi], dim=2),
            torch.stack([old_s, old_s, new_s, new_s], dim=2),
            torch.stack([had, had, torch.ones_like(had), torch.ones_like(had)], dim=1),
        )
        cold._widen_bounds(slots, local, k8, ks)
        for got, expected in zip((cold.lo8[slots], cold.hi8[slots], cold.sscale[slots]), want, strict=True):
            assert torch.equal(got, expected)
