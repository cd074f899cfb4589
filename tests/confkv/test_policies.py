"""Policy specs, budgets, selection and the matched-rate schedule."""

from __future__ import annotations

import pytest
import torch

from confkv.budgets import GatedBudget, pyramid_split
from confkv.confidence import ConfidenceWeights, confidence
from confkv.memory import KVGeometry
from confkv.policies import MATCHED_RATE, POLICIES, TokenStats, parse_policy, select_keep
from confkv.policies.confkv import NORMS
from confkv.policies.select import kept_mask, one_out, rank_rows
from confkv.sequence import SequenceCache

DEFAULT_SPECS = [
    "full",
    "window:n=64",
    "sinks:s=4,n=64",
    "h2o:n=64",
    "random",
    "recency",
    "attention",
    "confkv",
    "confkv:n_high=512,n_low=256,tau=0.5,p=64,int8=1,pyramid=1",
    "confkv:int8=1,recall=1",
    "confkv:int8=1,recall=1,norm=max,n_low=448,pool=1,vote=sum",
    "h2o:n=64,recall=1",
]


@pytest.mark.parametrize("spec", DEFAULT_SPECS)
def test_spec_round_trips(spec):
    policy = parse_policy(spec)
    assert parse_policy(policy.spec()) == policy


def test_recall_specs_take_the_recall_defaults_unless_given():
    """``confkv`` with recall=1 ranks for reading (facts come back through the cold tier);
    without recall, and for keys a spec gives, nothing changes."""
    plain, recall = parse_policy("confkv:int8=1"), parse_policy("confkv:int8=1,recall=1")
    assert (plain.norm, plain.n_low, plain.pool) == ("max", 448, 1)
    assert (recall.norm, recall.n_low, recall.pool) == ("rank", 480, 5)
    given = parse_policy("confkv:int8=1,recall=1,norm=free,pool=3")
    assert (given.norm, given.n_low, given.pool) == ("free", 480, 3)
    assert parse_policy("confkv:recall=1,norm=max,n_low=448,pool=1").spec() == (
        "confkv:recall=1,n_low=448,norm=max,pool=1"
    )
    assert parse_policy("h2o:n=64,recall=1") == parse_policy("h2o:n=64").replace(recall=True)


def test_every_policy_is_registered():
    assert set(POLICIES) == {"full", "window", "sinks", "h2o", "random", "recency", "attention", "confkv"}


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("", "empty"),
        ("nope", "unknown policy"),
        ("window:n=abc", "not a valid int"),
        ("window:q=3", "unknown key"),
        ("window:n", "key=value"),
        ("confkv:n_high=10,n_low=20", "n_low"),
        ("confkv:tau=2", "tau"),
        ("full:int8=1", "full"),
        ("window:n=0", "budget"),
        ("window:n=8,n=9", "twice"),
        ("confkv:w_ent=0.9", "sum to 1"),
        ("window:bytes=-5", "bytes"),
    ],
)
def test_bad_specs_raise_value_error(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_policy(spec)


def test_confidence_is_high_for_peaked_and_low_for_flat():
    flat = torch.zeros(1000)
    peaked = torch.zeros(1000)
    peaked[3] = 30.0
    assert confidence(flat).item() == pytest.approx(0.3 * 0.5 + 0.3 * 1e-3, abs=1e-4)
    assert confidence(peaked).item() > 0.99
    w = ConfidenceWeights(1.0, 0.0, 0.0)
    assert confidence(flat, w).item() == pytest.approx(0.0, abs=1e-5)


def test_gated_budget():
    rule = GatedBudget(512, 256, 0.5)
    assert rule(None) == 512 and rule(0.2) == 512 and rule(0.9) == 256


@pytest.mark.parametrize("total, layers, slope", [(512, 30, 0.5), (100, 7, 0.9), (64, 1, 0.5), (33, 4, 0.3)])
def test_pyramid_sums_to_flat_total_and_decreases(total, layers, slope):
    sizes = pyramid_split(total, layers, slope, minimum=5)
    assert sum(sizes) == total * layers
    assert all(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
    assert min(sizes) >= 5


def test_select_keep_protects_recent_and_sinks():
    positions = torch.arange(20)
    scores = -positions.float()  # prefers old tokens
    keep = select_keep(scores, positions, keep=8, protect_from=16, sinks=2)
    assert keep.sum() == 8
    assert keep[16:].all() and keep[:2].all()


def test_byte_budget_resolves_to_largest_fitting_tokens():
    geo = KVGeometry(n_layers=30, n_kv_heads=3, head_dim=64, dtype_bytes=4)
    ref = parse_policy("window:n=512").peak_bytes_bound(geo)
    for spec in ["window", "sinks", "h2o", "confkv", "confkv:int8=1", "confkv:int8=1,pyramid=1"]:
        pol = parse_policy(f"{spec}{',' if ':' in spec else ':'}bytes={ref}").resolve(geo)
        assert pol.peak_bytes_bound(geo) <= ref
        assert pol.scaled_to_peak(pol.budget_rule().peak + 1).peak_bytes_bound(geo) > ref
    int8 = parse_policy(f"confkv:int8=1,bytes={ref}").resolve(geo)
    assert int8.budget_rule().peak > 2 * 512  # INT8 buys more than twice the tokens


def test_matched_rate_policies_follow_identical_schedule():
    """Same confidence trace -> random/recency/attention evict exactly what confkv evicts, when it does."""
    geo = KVGeometry(n_layers=3, n_kv_heads=2, head_dim=8, dtype_bytes=4)
    trace = torch.rand(120, generator=torch.Generator().manual_seed(0)).tolist()
    counts = {}
    for name in MATCHED_RATE:
        seq = SequenceCache(parse_policy(f"{name}:n_high=24,n_low=12,p=4,s=2"), geo, torch.float32, "cpu")
        g = torch.Generator().manual_seed(3)
        for c in trace:
            for layer in range(3):
                seq.before_append(layer, 1)
                seq.append(layer, torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g))
                mass = torch.rand(len(seq.stores[layer]), generator=g)
                seq.after_attention(layer, mass[: seq.stores[layer].q.n], mass[seq.stores[layer].q.n :])
            seq.observe_confidence(c)
        counts[name] = (seq.stats.evictions_per_step, seq.tokens_per_layer())
    assert sum(counts["confkv"][0]) > 0
    for name in MATCHED_RATE:
        assert counts[name] == counts["confkv"], name


def _sink_heavy_stats() -> TokenStats:
    """12 tokens: a sink holding almost all the attention, then an old heavy hitter (position 4)
    among lightly attended tokens; ``now`` = 12."""
    ema = torch.full((12,), 1e-3)
    ema[0] = 1.0  # the sink
    ema[4] = 5e-3  # attended 5x more than its neighbours, 200x less than the sink
    return TokenStats(torch.arange(12), ema, ema.clone(), 12)


def test_confkv_norm_max_lets_the_sink_hide_the_heavy_hitter():
    """norm=max (the seed's score): the sink's mass squashes every other EMA towards 0, so
    recency outranks the heavy hitter; free and rank keep it above its newer neighbours."""
    stats = _sink_heavy_stats()
    old = parse_policy("confkv:n_high=12,n_low=8,p=2,s=1,norm=max").score(stats)
    assert old[4] < old[5]  # recency wins
    expected = 0.9 * stats.ema / stats.ema.max() + 0.1 * stats.recency()
    assert torch.equal(old, expected)  # bit for bit the seed's formula
    for norm in ("free", "rank"):
        scores = parse_policy(f"confkv:n_high=12,n_low=8,p=2,s=1,norm={norm}").score(stats)
        assert scores[4] > scores[5:10].max(), norm


def test_confkv_rank_norm_is_the_ema_order():
    stats = TokenStats(torch.arange(6), torch.tensor([5.0, 0.1, 3.0, 0.2, 9.0, 0.0]), torch.zeros(6), 6)
    scores = parse_policy("confkv:n_high=6,n_low=4,p=1,s=0,alpha=1,norm=rank").score(stats)
    assert scores.tolist() == pytest.approx([0.8, 0.2, 0.6, 0.4, 1.0, 0.0])


def test_confkv_attn_picks_the_received_attention_signal():
    """attn=ema ranks by the EMA, sum by the cumulative mass (H2O's signal), mean by the
    cumulative mass over each token's age."""
    positions = torch.tensor([0, 1, 2, 3])
    ema = torch.tensor([0.0, 3.0, 2.0, 1.0])
    cum = torch.tensor([8.0, 1.0, 3.0, 2.0])  # over ages 4, 3, 2, 1: means 2, 1/3, 1.5, 2
    stats = TokenStats(positions, ema, cum, 4)
    spec = "confkv:n_high=4,n_low=3,p=1,s=0,alpha=1,norm=max"
    assert parse_policy(spec).score(stats).tolist() == pytest.approx([0.0, 1.0, 2 / 3, 1 / 3])
    assert parse_policy(spec + ",attn=sum").score(stats).tolist() == pytest.approx([1.0, 0.125, 0.375, 0.25])
    assert parse_policy(spec + ",attn=mean").score(stats).tolist() == pytest.approx([1.0, 1 / 6, 0.75, 1.0])
    with pytest.raises(ValueError, match="attn"):
        parse_policy("confkv:attn=max")


def test_confkv_vn_weights_received_attention_by_the_value_norm():
    """vn=1 (VATP): a token that draws attention but carries a near-zero value ranks below one
    that draws less attention and carries a large value; without value norms it is an error."""
    positions = torch.tensor([0, 1, 2, 3])
    ema = torch.tensor([0.6, 0.3, 0.1, 0.2])
    stats = TokenStats(positions, ema, torch.zeros(4), 4, value_norm=torch.tensor([0.01, 2.0, 1.0, 1.0]))
    spec = "confkv:n_high=4,n_low=3,p=1,s=0,alpha=1,norm=rank"
    assert parse_policy(spec).score(stats).tolist() == pytest.approx([1.0, 2 / 3, 0.0, 1 / 3])
    assert parse_policy(spec + ",vn=1").score(stats).tolist() == pytest.approx([0.0, 1.0, 1 / 3, 2 / 3])
    assert parse_policy(spec + ",vn=1").needs_values and not parse_policy(spec).needs_values
    with pytest.raises(ValueError, match="value_norm"):
        parse_policy(spec + ",vn=1").score(TokenStats(positions, ema, torch.zeros(4), 4))


def test_value_norms_are_the_dequantized_values_l1_norms_in_meta_order():
    from confkv.storage import LayerStore

    store = LayerStore(2, 8, torch.float32, "cpu", int8=True, window=3)
    v = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(0))
    store.append(torch.randn(2, 7, 8), v)
    store.demote_old()
    assert store.q.n == 4 and store.fp.n == 3
    by_pos = dict(zip(store.meta("pos").tolist(), store.value_norms().tolist(), strict=True))
    want = v.abs().sum(-1).mean(0)
    for pos in range(7):
        assert by_pos[pos] == pytest.approx(want[pos].item(), rel=0.02 if pos < 4 else 1e-6)


def test_confkv_norm_is_validated():
    with pytest.raises(ValueError, match="norm"):
        parse_policy("confkv:norm=softmax")


def test_confkv_pool_keeps_the_span_around_a_heavy_hitter():
    """pool=3: each token scores the max of itself and its kept neighbours by position, in
    whatever order the store holds them; pool=1 is the unpooled score."""
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # store order is not position order
    ema = torch.tensor([0.05, 0.1, 0.9, 0.2, 0.0, 0.3])[order]  # by position: 2 is the heavy hitter
    stats = TokenStats(order, ema, torch.zeros(6), 6)
    plain = parse_policy("confkv:n_high=6,n_low=4,p=1,s=0,alpha=1,norm=rank").score(stats)
    pooled = parse_policy("confkv:n_high=6,n_low=4,p=1,s=0,alpha=1,norm=rank,pool=3").score(stats)
    by_pos = dict(zip(order.tolist(), pooled.tolist(), strict=True))
    plain_by_pos = dict(zip(order.tolist(), plain.tolist(), strict=True))
    assert [by_pos[i] for i in range(6)] == pytest.approx([0.4, 1.0, 1.0, 1.0, 0.8, 0.8])
    assert [plain_by_pos[i] for i in range(6)] == pytest.approx([0.2, 0.4, 1.0, 0.6, 0.0, 0.8])
    for bad in ("pool=0", "pool=2"):
        with pytest.raises(ValueError, match="pool"):
            parse_policy(f"confkv:{bad}")


ROW_SPECS = [
    "window:n=16",
    "sinks:n=16,s=2",
    "h2o:n=16",
    "recency:n_high=16,n_low=12,p=3,s=2",
    "attention:n_high=16,n_low=12,p=3,s=2",
    *(f"confkv:n_high=16,n_low=12,p=3,s=2,norm={norm},pool={pool}" for norm in NORMS for pool in (1, 3, 5)),
    *(f"confkv:n_high=16,n_low=12,p=3,s=2,norm=rank,attn={attn}" for attn in ("sum", "mean")),
]


def _rows(lengths: list[int], seed: int):
    """Padded (R, N) statistics of ``lengths`` live slots each (positions shuffled, EMA with ties,
    garbage past the live slots) and each row alone as (n,) statistics."""
    g = torch.Generator().manual_seed(seed)
    r, n = len(lengths), max(lengths)
    pos = torch.randint(0, 999, (r, n), generator=g)
    ema = torch.randint(0, 4, (r, n), generator=g).float() / 4  # many exact ties
    cum = torch.rand(r, n, generator=g)
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    now = []
    for b, m in enumerate(lengths):
        pos[b, :m] = torch.randperm(m, generator=g) * 3 + b
        now.append(int(pos[b, :m].max()) + 1)
    rows = TokenStats(pos, ema, cum, torch.tensor(now).unsqueeze(1), None, valid)
    alone = [TokenStats(pos[b, :m], ema[b, :m], cum[b, :m], now[b]) for b, m in enumerate(lengths)]
    return rows, alone


@pytest.mark.parametrize("spec", ROW_SPECS)
def test_scores_over_rows_equal_each_row_alone_bit_for_bit(spec):
    """``CachePolicy.score`` on rows of several sequences (``confkv.evict_rows``) gives each row
    exactly its scores alone: every reduction is per row and over the live slots only."""
    policy = parse_policy(spec)
    assert policy.scores_rows
    for lengths in ([9, 14, 14, 5], [11, 11]):
        rows, alone = _rows(lengths, seed=len(lengths))
        got = policy.score(rows)
        for b, stats in enumerate(alone):
            assert torch.equal(got[b, : lengths[b]], policy.score(stats)), (spec, b)


def test_random_policy_does_not_score_rows():
    assert not parse_policy("random:n_high=16,n_low=12,p=3").scores_rows


def select_rows(*args) -> torch.Tensor:
    return kept_mask(rank_rows(*args))


def one_out_rows(*args) -> torch.Tensor | None:
    return one_out(rank_rows(*args))


def test_select_rows_equals_select_keep_per_row_ties_included():
    """One tie rule (score descending, then slot) alone and in a batch: equal scores keep the
    earlier slot; protected tokens are always kept; padding never is."""
    lengths, keeps = [12, 7, 12, 3], [5, 2, 9, 3]
    rows, alone = _rows(lengths, seed=7)
    scores = torch.randint(0, 3, rows.positions.shape, generator=torch.Generator().manual_seed(1)).float()
    protect_from = rows.now - 4
    mask = select_rows(scores, rows.positions, torch.tensor(keeps), protect_from, 2, rows.valid)
    assert not mask[~rows.valid].any()
    for b, stats in enumerate(alone):
        m = lengths[b]
        want = select_keep(scores[b, :m], stats.positions, keeps[b], stats.now - 4, 2)
        assert torch.equal(mask[b, :m], want), b
    first = select_keep(torch.zeros(6), torch.arange(10, 16), keep=3, protect_from=99, sinks=0)
    assert first.tolist() == [True, True, True, False, False, False]


def test_one_out_rows_is_the_slot_select_rows_drops():
    """The slack-0 steady state (one slot out of every row) without a sort: the same slot as
    ``select_rows`` drops, ties, protected slots and padding included; None otherwise."""
    lengths = [12, 7, 12, 4]
    rows, _ = _rows(lengths, seed=11)
    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        scores = torch.randint(0, 3, rows.positions.shape, generator=g).float()
        keeps = torch.tensor(lengths) - 1
        protect_from = rows.now - 3
        args = (scores, rows.positions, keeps, protect_from, 2, rows.valid)
        victims = one_out_rows(*args)
        mask = select_rows(*args)
        assert victims is not None
        assert torch.equal((~mask & rows.valid).nonzero()[:, 1], victims), trial
    assert one_out_rows(scores, rows.positions, keeps - 1, protect_from, 2, rows.valid) is None
    # a row whose unprotected slots are all needed drops none: not the one-out state
    assert (
        one_out_rows(scores, rows.positions, keeps, rows.positions.min() + 0 * rows.now, 2, rows.valid)
        is None
    )
