"""ConfKVCache in real HF models: exactness, positions after eviction, bytes, batching, HF generate."""

from __future__ import annotations

import pytest
import torch

from confkv.cache import ConfKVCache
from confkv.decode import (
    decode_one_token,
    generate,
    prefill,
    prefill_chunk_size,
    sample,
    teacher_forced_logits,
)
from confkv.memory import KVGeometry
from confkv.policies import parse_policy
from confkv.processor import ConfidenceProcessor
from confkv.recall import SUMMARY_SHARE, cold_positions
from tests.helpers import banded_mask, reference_logits, tiny_causal_lm, tiny_llama


def test_full_reproduces_model_logits(tiny_model, token_ids):
    ref = reference_logits(tiny_model, token_ids)
    got = teacher_forced_logits(tiny_model, ConfKVCache.for_model(tiny_model, "full"), token_ids)
    assert (got - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("spec, n, sinks", [("window:n=32", 32, 0), ("sinks:s=4,n=32", 32, 4)])
def test_window_and_sinks_equal_banded_attention(tiny_model, token_ids, spec, n, sinks):
    ids = token_ids[:, :150]
    ref = reference_logits(tiny_model, ids, banded_mask(150, n, sinks))
    cache = ConfKVCache.for_model(tiny_model, spec)
    got = teacher_forced_logits(tiny_model, cache, ids)
    assert (got - ref).abs().max() <= 1e-4
    assert cache.get_seq_length() == 150  # true positions continue after eviction
    assert cache.seqs[0].tokens_per_layer() == [n] * 3


def test_chunked_prefill_matches_full_forward(tiny_model, token_ids):
    ref = reference_logits(tiny_model, token_ids)
    cache = ConfKVCache.for_model(tiny_model, "full")
    got = teacher_forced_logits(tiny_model, cache, token_ids, prefix=200)
    assert (got - ref[:, 199:]).abs().max() <= 1e-4


SPECS = [
    "full",
    "window:n=40",
    "sinks:s=4,n=40",
    "h2o:n=40",
    "random:n_high=48,n_low=24,p=8,s=2",
    "recency:n_high=48,n_low=24,p=8,s=2",
    "attention:n_high=48,n_low=24,p=8,s=2",
    "confkv:n_high=48,n_low=24,p=8,s=2",
    "confkv:n_high=48,n_low=24,p=8,s=2,slack=8",
    "confkv:n_high=48,n_low=24,p=8,s=2,int8=1,w=16,pyramid=1",
]


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_are_exact_and_peak_within_budget(tiny_model, token_ids, spec):
    geo = KVGeometry.from_config(tiny_model.config, torch.float32)
    policy = parse_policy(spec)
    cache = ConfKVCache.for_model(tiny_model, policy)
    teacher_forced_logits(tiny_model, cache, token_ids, prefix=100)
    seq = cache.seqs[0]
    stored = sum(t.nbytes for store in seq.stores for t in store.kv_views())
    assert seq.nbytes() == stored
    bound = geo.full_bytes(300) if not policy.evicts else policy.peak_bytes_bound(geo)
    assert 0 < seq.stats.peak_bytes <= bound
    if policy.evicts:
        assert max(seq.tokens_per_layer()) <= max(policy.layer_budgets(policy.budget_rule().peak, 3))


def test_a_prompts_first_chunk_may_fill_the_budget(tiny_model, token_ids):
    """An empty cache takes a chunk as large as its budget (a prompt that fits is one forward);
    once it holds the protected tokens, a chunk is the budget less them. Peak stays in bound."""
    geo = KVGeometry.from_config(tiny_model.config, torch.float32)
    hot = int(48 * (1 - SUMMARY_SHARE))
    cases = [("confkv:n_high=48,n_low=24,p=8,s=2", 48, 38), ("h2o:n=48", 48, None),
             ("confkv:n_high=48,n_low=24,p=8,s=2,recall=1", hot, hot - 10),
             ("confkv:n_high=48,n_low=24,p=8,s=2,int8=1,w=16", 16, 16)]  # fmt: skip
    for spec, first, later in cases:
        cache = ConfKVCache.for_model(tiny_model, spec)
        seq = cache.seqs[0]
        assert prefill_chunk_size(cache, 256) == first, spec
        assert prefill_chunk_size(cache, 12) == 12, spec
        prefill(tiny_model, cache, token_ids[:, :first])
        assert seq.tokens_per_layer() == [first] * 3 and not any(seq.stats.evictions_per_step), spec
        later = later if later is not None else 48 - seq.policy.protected - seq.policy.s
        assert prefill_chunk_size(cache, 256) == later, spec
        prefill(tiny_model, cache, token_ids[:, first:200])
        assert seq.stats.peak_bytes <= seq.policy.peak_bytes_bound(geo), spec


@pytest.mark.parametrize("total, chunks", [(100, [36, 26, 26, 12]), (90, [36, 26, 16, 12]), (30, [30])])
def test_the_final_prompt_chunk_holds_the_observation_window(
    tiny_model, token_ids, monkeypatch, total, chunks
):
    """recall=1: the first chunk fills the hot share of the budget (48 * 0.75), later ones leave
    the protected tokens (p + s = 10), and the final chunk, which the prompt-end probe reads,
    holds the whole observation window (obs 32, at most a quarter of the budget: 12)."""
    import confkv.decode as decode

    seen = []
    real_forward, real_end = decode.forward, decode.prompt_end_forward
    monkeypatch.setattr(
        decode, "forward", lambda m, c, ids, **kw: seen.append(ids.shape[1]) or real_forward(m, c, ids, **kw)
    )
    monkeypatch.setattr(
        decode, "prompt_end_forward", lambda m, c, ids: seen.append(-ids.shape[1]) or real_end(m, c, ids)
    )
    cache = ConfKVCache.for_model(tiny_model, "confkv:n_high=48,n_low=24,p=8,s=2,recall=1")
    prefill(tiny_model, cache, token_ids[:, :total])
    assert seen[: len(chunks)] == [*chunks[:-1], -chunks[-1]]  # then the probe's own forwards


def test_slack_amortizes_eviction(tiny_model, token_ids):
    """With slack=8 eviction runs about every 8th step, and the budget still holds."""
    runs = {}
    for slack in (0, 8):
        cache = ConfKVCache.for_model(tiny_model, f"window:n=40,slack={slack}")
        teacher_forced_logits(tiny_model, cache, token_ids[:, :200])
        steps = cache.seqs[0].stats.evictions_per_step
        runs[slack] = sum(1 for e in steps if e)
        assert max(cache.seqs[0].tokens_per_layer()) <= 40
    assert runs[8] * 6 < runs[0]


def test_byte_budget_spec_caps_peak_bytes(tiny_model, token_ids):
    geo = KVGeometry.from_config(tiny_model.config, torch.float32)
    target = parse_policy("window:n=40").peak_bytes_bound(geo)
    for spec in ["window", "h2o", "confkv:p=8,s=2", "confkv:p=8,s=2,int8=1,w=16"]:
        cache = ConfKVCache.for_model(tiny_model, f"{spec}{',' if ':' in spec else ':'}bytes={target}")
        teacher_forced_logits(tiny_model, cache, token_ids, prefix=120)
        assert cache.seqs[0].stats.peak_bytes <= target, spec


def test_batched_ragged_decode_equals_each_alone(tiny_model, token_ids):
    specs = ["full", "window:n=24", "confkv:n_high=32,n_low=16,p=4,s=2,int8=1,w=8", "h2o:n=24"]
    prompts = [token_ids[:, :n] for n in (20, 35, 50, 27)]
    alone = []
    for spec, prompt in zip(specs, prompts, strict=True):
        alone.append(generate(tiny_model, ConfKVCache.for_model(tiny_model, spec), prompt, 12).tokens)
    caches = [ConfKVCache.for_model(tiny_model, s) for s in specs]
    logits = torch.stack([prefill(tiny_model, c, p)[0] for c, p in zip(caches, prompts, strict=True)])
    batch = ConfKVCache([c.seqs[0] for c in caches])
    together = [[] for _ in specs]
    for _ in range(12):
        tokens = sample(logits)
        for row, tok in zip(together, tokens.tolist(), strict=True):
            row.append(tok)
        logits = decode_one_token(tiny_model, batch, tokens)
    assert together == alone


def test_hf_generate_with_confidence_processor():
    model = tiny_llama()
    from confkv.attention import enable

    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(0))
    plain = model.generate(ids, max_new_tokens=15, do_sample=False)
    enable(model)
    cache = ConfKVCache.for_model(model, "full")
    ours = model.generate(
        ids,
        past_key_values=cache,
        max_new_tokens=15,
        do_sample=False,
        logits_processor=[ConfidenceProcessor(cache)],
    )
    assert torch.equal(plain, ours)
    cache = ConfKVCache.for_model(model, "confkv:n_high=24,n_low=12,p=4,s=2")
    proc = ConfidenceProcessor(cache)
    model.generate(ids, past_key_values=cache, max_new_tokens=15, do_sample=False, logits_processor=[proc])
    assert len(proc.history) == 15 and max(cache.seqs[0].tokens_per_layer()) <= 24


def test_for_model_switches_a_plain_hf_model_to_confkv_attention():
    """A model loaded with plain transformers (sdpa attention) works with ``for_model`` as is: the
    same tokens as one switched by hand, evicting or not (before, it silently attended only to the
    new tokens, or failed on a mask of the wrong length)."""
    from confkv.attention import enable

    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(1))
    for spec in ("full", "window:n=16", "confkv:n_high=24,n_low=16,p=4,int8=1,w=4"):
        plain = tiny_llama(layers=2)
        assert plain.config._attn_implementation != "confkv"
        got = generate(plain, ConfKVCache.for_model(plain, spec), ids, 12).tokens
        switched = tiny_llama(layers=2)
        enable(switched)
        assert got == generate(switched, ConfKVCache.for_model(switched, spec), ids, 12).tokens, spec


def test_a_model_switched_away_from_confkv_attention_fails_clearly():
    model = tiny_llama(layers=2)
    cache = ConfKVCache.for_model(model, "full")
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="attended without Conf-KV.*enable"):
        generate(model, cache, torch.ones(1, 5, dtype=torch.long), 3)


def test_hf_generate_refuses_a_left_padded_batch():
    """Each row attends causally over its own cache, so pads would be attended: refused with a
    way out, instead of tokens that silently differ from each prompt alone."""
    model = tiny_llama(layers=2)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 101, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    ids[1, :8], mask[1, :8] = 0, 0
    cache = ConfKVCache.for_model(model, "full", batch_size=2)
    with pytest.raises(ValueError, match="no padding mask.*cache of its own"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False)
    unpadded = ConfKVCache.for_model(model, "full", batch_size=2)  # an all-ones mask is fine
    ones = torch.ones_like(mask)
    out = model.generate(ids, attention_mask=ones, past_key_values=unpadded, max_new_tokens=2)
    assert out.shape == (2, 22)


def test_hf_beam_search_reorders_rows_and_keeps_each_beams_budget():
    model = tiny_llama(layers=2)
    ids = torch.randint(1, 101, (1, 40), generator=torch.Generator().manual_seed(3))
    plain = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False)
    cache = ConfKVCache.for_model(model, "full", batch_size=3)
    assert torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=8, num_beams=3), plain)
    for spec, budget in (("confkv:n_high=24,n_low=16,p=4,int8=1,w=4", 24), ("h2o:n=16", 16)):
        cache = ConfKVCache.for_model(model, spec, batch_size=3)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, num_beams=3, do_sample=False)
        assert out.shape == (1, 52)
        assert len({id(s) for s in cache.seqs}) == 3  # a beam taken twice continues as a copy
        assert all(max(s.tokens_per_layer()) <= budget for s in cache.seqs)
    with pytest.raises(ValueError, match="batch_size=rows"):
        one_row = ConfKVCache.for_model(model, "full")
        model.generate(ids, past_key_values=one_row, max_new_tokens=2, num_beams=2)


def test_rows_are_selected_and_copied_independently(tiny_model, token_ids):
    cache = ConfKVCache.for_model(tiny_model, "h2o:n=24", batch_size=2)
    logits = prefill(tiny_model, cache, token_ids[:, :30].expand(2, -1))
    decode_one_token(tiny_model, cache, sample(logits))  # a decode batch: rows of one arena on CPU
    first = cache.seqs[0]
    cache.reorder_cache(torch.tensor([0, 0]))
    assert cache.seqs[0] is first and cache.seqs[1] is not first
    assert all(st.fp.home is None for st in cache.seqs[1].stores)  # the row was copied, not the arena
    for a, b in zip(cache.seqs[0].stores, cache.seqs[1].stores, strict=True):
        assert torch.equal(a.meta("pos"), b.meta("pos")) and a.fp.t["k"] is not b.fp.t["k"]
    cache.batch_repeat_interleave(2)
    assert len(cache.seqs) == 4
    with pytest.raises(ValueError, match="do not select"):
        cache.batch_select_indices(torch.tensor([4]))
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(10)


def test_a_sliding_window_model_is_refused_past_its_window_unless_the_policy_keeps_within_it():
    """Mistral-style layers attend over the last W positions only; Conf-KV attention has no window
    mask, so a cache holding an older key fails with a way out instead of attending past W."""
    from transformers import MistralConfig, MistralForCausalLM

    model = tiny_causal_lm(MistralConfig, MistralForCausalLM, sliding_window=16)
    short = torch.randint(1, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = model.generate(short, max_new_tokens=4, do_sample=False)[0, 12:].tolist()
    assert generate(model, ConfKVCache.for_model(model, "full"), short, 4).tokens == plain  # within W
    long = torch.randint(1, 101, (1, 30), generator=torch.Generator().manual_seed(5))
    for spec in ("full", "h2o:n=12"):  # h2o keeps old heavy hitters: past the window
        with pytest.raises(ValueError, match="sliding window of 16.*window:n=16"):
            generate(model, ConfKVCache.for_model(model, spec), long, 10)
    plain = model.generate(long, max_new_tokens=10, do_sample=False)[0, 30:].tolist()
    got = generate(model, ConfKVCache.for_model(model, "window:n=16"), long, 10, chunk_size=1).tokens
    assert got == plain  # one token at a time, window:n=W is the model's own sliding window


def test_without_a_confkv_cache_a_sliding_window_layer_keeps_its_window():
    """The fallback attention (model switched to confkv, no Conf-KV cache) applies the window."""
    from transformers import MistralConfig, MistralForCausalLM

    from confkv.attention import enable

    model = tiny_causal_lm(MistralConfig, MistralForCausalLM, sliding_window=8)
    ids = torch.randint(1, 101, (1, 30), generator=torch.Generator().manual_seed(2))
    ref_logits, ref = model(ids).logits, model.generate(ids, max_new_tokens=6, do_sample=False)
    enable(model)
    assert (model(ids).logits - ref_logits).abs().max() <= 1e-5
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref)


def test_a_model_whose_attention_soft_caps_its_logits_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = tiny_causal_lm(Gemma2Config, Gemma2ForCausalLM, head_dim=16)
    with pytest.raises(ValueError, match="soft-capping"):
        generate(model, ConfKVCache.for_model(model, "full"), torch.ones(1, 8, dtype=torch.long), 2)


@pytest.mark.parametrize("spec", ["full", "confkv:n_high=24,n_low=16,p=4,int8=1,w=4,recall=1", "h2o:n=16"])
def test_a_forward_that_fails_part_way_leaves_no_token_behind(spec):
    """Layer 0 has stored the chunk when layer 1 fails: every layer (and the cold tier) ends at
    the position it had before, and feeding the chunk again works as if the first try never ran
    (exactly, where the first try evicted nothing)."""
    model = tiny_llama(layers=3)
    ids = torch.randint(1, 101, (2, 40), generator=torch.Generator().manual_seed(6))
    cache, clean = (
        ConfKVCache.for_model(model, spec, batch_size=2),
        ConfKVCache.for_model(model, spec, batch_size=2),
    )
    prefill(model, cache, ids[:, :30])
    prefill(model, clean, ids[:, :30])
    hook = model.model.layers[1].register_forward_pre_hook(
        lambda *_: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    try:
        with pytest.raises(RuntimeError, match="boom"):
            prefill(model, cache, ids[:, 30:])
    finally:
        hook.remove()
    for seq in cache.seqs:
        assert all(store.next_pos == 30 and int(store.meta("pos").max()) < 30 for store in seq.stores)
        if seq.tier is not None:
            for cold in seq.tier.cold:
                cold.settle()
                held = cold.valid | cold.shadow  # (P, S): slots that stand for a token
                assert bool((cold_positions(cold)[held] < 30).all())
    again, reference = prefill(model, cache, ids[:, 30:]), prefill(model, clean, ids[:, 30:])
    if spec == "full":
        torch.testing.assert_close(again, reference)
    assert [s.seen_tokens for s in cache.seqs] == [40, 40]


def test_a_ragged_batch_fed_one_offset_for_every_row_is_refused():
    """``model(...)`` / ``model.generate`` give every row the first row's offset; rows prefilled
    alone to different lengths need their own positions, which confkv.decode passes."""
    model = tiny_llama(layers=2)
    caches = [ConfKVCache.for_model(model, "full") for _ in range(2)]
    prompts = [torch.randint(1, 101, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 20)]
    logits = torch.cat([prefill(model, c, p) for c, p in zip(caches, prompts, strict=True)])
    batch = ConfKVCache([c.seqs[0] for c in caches])
    tokens = sample(logits)
    with pytest.raises(ValueError, match=r"positions \[12, 20\] but were fed at \[12, 12\]"), torch.no_grad():
        model(input_ids=tokens.view(2, 1), past_key_values=batch)
    assert [s.seen_tokens for s in batch.seqs] == [12, 20]  # the refused step left nothing behind
    decode_one_token(model, batch, tokens)  # per-row positions: fine
    positions = batch.positions_for_next(1)
    with torch.no_grad():
        model(input_ids=sample(logits).view(2, 1), position_ids=positions, past_key_values=batch)
    assert [s.seen_tokens for s in batch.seqs] == [14, 22]


def test_api_errors_are_value_errors(tiny_model):
    cache = ConfKVCache.for_model(tiny_model, "full")
    with pytest.raises(ValueError, match="empty prompt"):
        prefill(tiny_model, cache, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_model, cache, torch.ones(1, 3, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="unknown policy"):
        ConfKVCache.for_model(tiny_model, "lru")


def test_nucleus_sampling_draws_only_from_the_top_p_mass():
    """top_p keeps the smallest set of most likely tokens whose mass reaches top_p: here the
    top two (0.5 + 0.3 >= 0.7); the top token always stays; top_p=1 is plain sampling."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().expand(400, 4)
    g = torch.Generator().manual_seed(0)
    drawn = sample(logits, 1.0, g, top_p=0.7)
    assert set(drawn.tolist()) == {0, 1}
    assert set(sample(logits, 1.0, g, top_p=1e-9).tolist()) == {0}
    assert set(sample(logits, 1.0, g, top_p=1.0).tolist()) == {0, 1, 2, 3}
