"""Engine: batched decoding equals each session alone, exact footprints, the pool is never exceeded."""

from __future__ import annotations

import pytest
import torch

from confkv.attention import enable
from confkv.batched import PackedCache, packed_forward
from confkv.cache import ConfKVCache
from confkv.decode import forward, generate
from confkv.sequence import seed_of
from tests.helpers import printable_byte_llama, tiny_llama
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.types import (
    ChatMessage,
    EngineConfig,
    FinishReason,
    InvalidRequest,
    PoolExhausted,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SessionState,
    TokenEvent,
    TurnDone,
    TurnRequest,
)

POLICIES = [
    "full",
    "window:n=24",
    "confkv:n_high=32,n_low=16,p=4,s=2",
    "confkv:n_high=40,n_low=20,p=4,s=2,int8=1,w=8,pyramid=1",
]
PROMPTS = [
    "Tell me about the weather in Bath.",
    "Hi",
    "A much longer question, so that the prompts are ragged and take several prefill chunks to feed.",
    "Why do elephants never forget their umbrellas on a Tuesday?",
]


def user(text: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage("user", text),)


def events_of(handle) -> tuple[list[TokenEvent], TurnDone]:
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    assert isinstance(events[-1], TurnDone)
    return events[:-1], events[-1]


def alone(model, policy: str, prompt: str, max_new: int, chunk: int) -> list[int]:
    codec = ByteChatCodec()
    ids = torch.tensor([codec.encode_chat(user(prompt))])
    cache = ConfKVCache.for_model(model, policy)
    return generate(model, cache, ids, max_new, set(codec.eos_ids), chunk_size=chunk).tokens


def exact_bytes(seq) -> int:
    return sum(store.nbytes() for store in seq.stores)


def test_batch_of_four_equals_each_alone(model, make_engine):
    engine = make_engine()
    handles = []
    for i, (policy, prompt) in enumerate(zip(POLICIES, PROMPTS, strict=True)):
        engine.open_session(f"s{i}", policy, [])
        handles.append(engine.submit(TurnRequest(f"s{i}", user(prompt), max_new_tokens=24)))
    sizes = []
    engine.on_step = lambda st: sizes.append(st.batch_size)
    engine.run_until_idle()
    assert max(sizes) == 4  # all four advanced in one forward
    for policy, prompt, handle in zip(POLICIES, PROMPTS, handles, strict=True):
        tokens, done = events_of(handle)
        got = [e.token_id for e in tokens] + ([ByteChatCodec.END] if done.reason is FinishReason.EOS else [])
        assert got == alone(model, policy, prompt, 24, 16), policy
        assert done.generated_tokens == len(got)


def test_footprint_equals_exact_cache_bytes_every_step(make_engine):
    engine = make_engine()
    for i, policy in enumerate(POLICIES):
        engine.open_session(f"s{i}", policy, [ChatMessage("system", "You are terse.")])
        engine.submit(TurnRequest(f"s{i}", user(PROMPTS[i]), max_new_tokens=12))
    while engine.step():
        fp = engine.footprint()
        by_id = {s.session_id: s for s in fp.sessions}
        for sid, session in engine.sessions.items():
            assert by_id[sid].kv_bytes == exact_bytes(session.seq)
            assert by_id[sid].kv_bytes <= by_id[sid].reserved_bytes
        assert fp.used_bytes == sum(exact_bytes(s.seq) for s in engine.sessions.values())
    fp = engine.footprint()
    assert fp.active_sessions == fp.queued_requests == 0 and fp.open_sessions == 4
    assert all(s.state is SessionState.IDLE and s.turns == 3 for s in fp.sessions)
    assert fp.reserved_bytes == fp.used_bytes  # idle sessions reserve what they hold


def test_each_session_draws_from_a_seed_of_its_own(make_engine):
    """A session's sequence is seeded from its id (``confkv.sequence.seed_of``), so a
    ``trigger=random`` control fires on different steps in different sessions, reproducibly."""
    engine = make_engine()
    for sid in ("alpha", "beta"):
        engine.open_session(sid, "h2o:n=24,recall=1,page=4,trigger=random,rate=0.5", [])
        engine.submit(TurnRequest(sid, user(PROMPTS[2]), max_new_tokens=4))
    while engine.step():
        pass
    seeds = {sid: s.seq.generator.initial_seed() for sid, s in engine.sessions.items()}
    assert seeds == {"alpha": seed_of("alpha"), "beta": seed_of("beta")}
    assert seeds["alpha"] != seeds["beta"]


def test_pool_limit_is_never_exceeded_and_queued_turns_complete(make_engine):
    probe = make_engine()
    one = probe.estimate(POLICIES[2], [], context_tokens=200, max_new=16).worst_case_bytes
    engine = make_engine(kv_pool_bytes=int(one * 2.5), max_queue=16)
    seen = []
    engine.on_step = lambda st: seen.append((st.used_bytes, engine.footprint(False).reserved_bytes))
    handles = []
    for i in range(6):
        engine.open_session(f"s{i}", POLICIES[2 + i % 2], [])
        handles.append(engine.submit(TurnRequest(f"s{i}", user(PROMPTS[i % 4] * 3), max_new_tokens=16)))
    assert engine.footprint().queued_requests == 6
    engine.run_until_idle()
    capacity = engine.config.kv_pool_bytes
    assert seen and all(used <= capacity and reserved <= capacity for used, reserved in seen)
    assert all(events_of(h)[1].reason in (FinishReason.EOS, FinishReason.MAX_TOKENS) for h in handles)


def test_turn_larger_than_the_pool_is_refused_with_a_reason(make_engine):
    engine = make_engine(kv_pool_bytes=10_000)
    engine.open_session("big", "full", [])
    with pytest.raises(PoolExhausted, match="pool holds 10000"):
        engine.submit(TurnRequest("big", user("hello there"), max_new_tokens=500))
    assert engine.session_report("big").state is SessionState.IDLE


def test_full_queue_is_refused(make_engine):
    engine = make_engine(max_queue=1)
    engine.open_session("a", "window:n=24", [])
    engine.open_session("b", "window:n=24", [])
    engine.submit(TurnRequest("a", user("one"), max_new_tokens=2))
    with pytest.raises(PoolExhausted, match="queue is full"):
        engine.submit(TurnRequest("b", user("two"), max_new_tokens=2))
    with pytest.raises(SessionBusy):
        engine.submit(TurnRequest("a", user("again"), max_new_tokens=2))


def test_idle_kv_is_released_under_pressure_and_rebuilt(make_engine):
    probe = make_engine()
    one = probe.estimate(POLICIES[1], [], context_tokens=120, max_new=8).worst_case_bytes
    engine = make_engine(kv_pool_bytes=int(one * 1.5))
    engine.open_session("a", POLICIES[1], [])
    engine.open_session("b", POLICIES[1], [])
    engine.submit(TurnRequest("a", user("first session"), max_new_tokens=8))
    engine.run_until_idle()
    assert engine.session_report("a").kv_bytes > 0
    engine.submit(TurnRequest("b", user("second session"), max_new_tokens=8))
    engine.run_until_idle()
    assert engine.session_report("a").kv_bytes == 0 and engine.session_report("a").turns == 2
    handle = engine.submit(TurnRequest("a", user("and again"), max_new_tokens=8))
    engine.run_until_idle()
    _, done = events_of(handle)
    # rebuilt from the transcript: this turn fed the whole conversation, not just a suffix
    assert done.prompt_tokens == done.context_tokens - done.generated_tokens + 1
    assert engine.session_report("a").turns == 4


def test_waiting_sessions_caches_make_room_when_nothing_runs(make_engine):
    """Every cache in the pool belongs to a session whose next turn waits behind the queue's head,
    and no turn runs: the head must not wait for good. Waiting sessions' caches are released
    (least recently used first) and every turn completes (a fuzz run found this deadlock)."""
    engine = make_engine()
    for sid in ("a", "b"):
        engine.open_session(sid, "full", [])
        engine.submit(TurnRequest(sid, user(PROMPTS[2]), max_new_tokens=4))
    engine.run_until_idle()
    held = engine.pool.reserved_bytes
    engine.pool.capacity_bytes = held + held // 4  # a's longer second turn fits only without b
    handles = [engine.submit(TurnRequest(sid, user(PROMPTS[2]), max_new_tokens=4)) for sid in ("a", "b")]
    assert engine.run_until_idle() > 0
    assert all(events_of(h)[1].reason in (FinishReason.EOS, FinishReason.MAX_TOKENS) for h in handles)
    assert engine.session_report("a").turns == 4 and engine.session_report("b").turns == 4
    assert engine.pool.reserved_bytes <= engine.pool.capacity_bytes


RECALL = "confkv:n_high=40,n_low=32,p=4,s=2,recall=1,page=8"
LONG_A = "The passkey is 4817. Remember it, then talk about the weather in Bath for a while. " * 2


@pytest.fixture(scope="module")
def printable():
    return printable_byte_llama()  # replies re-encode to the tokens fed: turns feed only suffixes


def _pressured(model, prompt: str = LONG_A, **overrides):
    """Room for one recall session's worst case and a half: b's turn needs a's room."""
    build = lambda **o: Engine(model, ByteChatCodec(), EngineConfig(**{"prefill_chunk": 16, **o}))  # noqa: E731
    one = build(kv_pool_bytes=1 << 30).estimate(RECALL, [], context_tokens=200, max_new=8).worst_case_bytes
    engine = build(kv_pool_bytes=int(one * 1.5), **overrides)
    for sid in ("a", "b"):
        engine.open_session(sid, RECALL, [])
    engine.submit(TurnRequest("a", user(prompt), max_new_tokens=8))
    engine.run_until_idle()
    return engine


def test_idle_recall_session_is_demoted_to_cold_and_resumes_without_rereading(printable):
    engine = _pressured(printable)
    before = engine.session_report("a")
    assert before.kv_bytes > 0 and before.cached_tokens > 6
    engine.submit(TurnRequest("b", user(LONG_A), max_new_tokens=8))
    engine.run_until_idle()
    after = engine.session_report("a")
    seq = engine.sessions["a"].seq
    assert engine.demoted_sessions == 1 and seq is not None
    assert after.cached_tokens == 2 + 4  # sinks + the recent window stay hot
    assert 0 < after.kv_bytes < before.kv_bytes and after.cold_bytes > before.cold_bytes
    summaries = sum(cold.summary_bytes() for cold in seq.tier.cold)  # page summaries are hot bytes
    assert after.kv_bytes == exact_bytes(seq) + summaries and after.context_tokens == before.context_tokens
    assert engine.pool.reserved("a") == after.kv_bytes  # the pool holds only the residue
    assert engine.host_pool.reserved("a") >= after.cold_bytes
    assert engine.pool.reserved_bytes <= engine.config.kv_pool_bytes
    handle = engine.submit(TurnRequest("a", user("What is the passkey?"), max_new_tokens=8))
    engine.run_until_idle()
    _, done = events_of(handle)
    # resumed: only the new turn was fed (its prompt follows the context it had), no re-read
    assert done.prompt_tokens == done.context_tokens - done.generated_tokens + 1 - before.context_tokens
    assert engine.sessions["a"].seq is seq


def test_idle_demotion_falls_back_to_release(printable):
    """Without host room for the cold tier (or with demotion off) idle KV is released, as before.
    The host pool charges an idle tier what it has allocated, so a tier whose page slots already
    cover every position seen demotes for free; a short first turn evicted nothing and holds no
    slots, so demoting it needs host room."""
    for overrides in ({"demote_idle": False}, {"host_pool_bytes": 400_000}):
        engine = _pressured(printable, prompt="The passkey is 4817.", **overrides)
        a = engine.sessions["a"]
        assert a.cold_reserved_bytes() == 0 and engine.host_pool.reserved("a") == 0
        assert a.policy.worst_case_cold_bytes(engine.geometry, a.seq.seen_tokens) > 0
        engine.submit(TurnRequest("b", user(LONG_A), max_new_tokens=8))
        if "host_pool_bytes" in overrides:  # room for b's turn beside idle a, not for a demoted a
            demoted_a = a.policy.worst_case_cold_bytes(engine.geometry, a.seq.seen_tokens)
            b_turn = engine.queue[0].cold_reserve_bytes
            engine.host_pool.capacity_bytes = engine.host_pool.reserved_bytes + b_turn + demoted_a - 1
        engine.run_until_idle()
        report = engine.session_report("a")
        assert engine.demoted_sessions == 0, overrides
        assert report.kv_bytes == 0 and report.cold_bytes == 0 and engine.sessions["a"].seq is None


def test_idle_tier_is_charged_its_allocated_pages(printable):
    """Between turns the host pool holds what a session's cold tier has allocated (whole page
    slots), not only the tokens stored in them."""
    engine = _pressured(printable, host_pool_bytes=400_000)
    a = engine.sessions["a"]
    assert 0 < a.cold_nbytes() < a.cold_reserved_bytes() == engine.host_pool.reserved("a")


def test_cancel_mid_stream_frees_kv_and_keeps_the_transcript(make_engine):
    engine = make_engine()
    engine.open_session("c", "full", [ChatMessage("system", "be brief")])
    handle = engine.submit(TurnRequest("c", user("count to one hundred"), max_new_tokens=50))
    for _ in range(5):
        engine.step()
    assert engine.session_report("c").kv_bytes > 0
    handle.cancel()
    engine.run_until_idle()
    tokens, done = events_of(handle)
    assert done.reason is FinishReason.CANCELLED and 0 < len(tokens) < 50
    report = engine.session_report("c")
    assert report.kv_bytes == report.reserved_bytes == 0 and report.turns == 1
    assert engine.footprint().used_bytes == 0


def test_drop_frees_everything(make_engine):
    engine = make_engine()
    engine.open_session("d", "window:n=24", [])
    engine.submit(TurnRequest("d", user("hello"), max_new_tokens=4))
    engine.run_until_idle()
    freed = engine.drop("d")
    assert freed > 0 and engine.footprint().used_bytes == 0
    with pytest.raises(SessionNotFound):
        engine.drop("d")


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda e: e.open_session("x", "confkv:n_high=banana", []), InvalidRequest),
        (lambda e: e.open_session("x", "nosuchpolicy", []), InvalidRequest),
        (lambda e: e.open_session("", "full", []), InvalidRequest),
        (lambda e: e.open_session("ok", "full", []), SessionExists),
        (lambda e: e.submit(TurnRequest("ghost", user("hi"))), SessionNotFound),
        (lambda e: e.submit(TurnRequest("ok", user("   "))), InvalidRequest),
        (lambda e: e.submit(TurnRequest("ok", user("x" * 32_001))), InvalidRequest),
        (lambda e: e.submit(TurnRequest("ok", (ChatMessage("robot", "hi"),))), InvalidRequest),
        (lambda e: e.submit(TurnRequest("ok", user("hi"), max_new_tokens=-1)), InvalidRequest),
    ],
)
def test_bad_input_raises_domain_errors(make_engine, call, error):
    engine = make_engine()
    engine.open_session("ok", "full", [])
    with pytest.raises(error):
        call(engine)
    engine.submit(TurnRequest("ok", user("still serving"), max_new_tokens=3))
    assert engine.run_until_idle() > 0


def test_background_thread_streams_and_stops(make_engine):
    engine = make_engine()
    engine.start()
    try:
        engine.open_session("t", POLICIES[2], [])
        handle = engine.submit(TurnRequest("t", user("stream please"), max_new_tokens=10))
        events = list(handle)
        assert isinstance(events[-1], TurnDone) and all(isinstance(e, TokenEvent) for e in events[:-1])
        assert "".join(e.text for e in events[:-1]) == events[-1].text or events[-1].text.endswith("\ufffd")
    finally:
        engine.stop(grace=1.0)
    with pytest.raises(Exception, match="shutting down"):
        engine.open_session("late", "full", [])


def test_ignore_eos_generates_exactly_max_new_tokens(make_engine):
    """Throughput benchmarks ask for a fixed length; EOS must not end those turns early."""
    engine = make_engine()
    lengths = {}
    for ignore in (False, True):
        for i, prompt in enumerate(PROMPTS):
            sid = f"e{int(ignore)}-{i}"
            engine.open_session(sid, "full", [])
            handle = engine.submit(TurnRequest(sid, user(prompt), max_new_tokens=40, ignore_eos=ignore))
            engine.run_until_idle()
            tokens, done = events_of(handle)
            lengths[sid] = (done.reason, done.generated_tokens)
    forced = [v for k, v in lengths.items() if k.startswith("e1")]
    assert all(reason is FinishReason.MAX_TOKENS and n == 40 for reason, n in forced)


def test_host_pool_for_cold_tiers_is_never_exceeded(make_engine):
    """recall=1 sessions reserve their worst-case cold tier in the host pool; the cold bytes in
    use never exceed it, turns that would not fit wait, and one that never fits is refused."""
    spec = "window:n=24,recall=1,page=8"
    engine = make_engine(host_pool_bytes=60_000, max_queue=16)
    seen = []
    engine.on_step = lambda st: seen.append(sum(s.cold_nbytes() for s in engine.sessions.values()))
    handles = []
    for i in range(3):
        engine.open_session(f"c{i}", spec, [])
        handles.append(engine.submit(TurnRequest(f"c{i}", user(PROMPTS[i % 4] * 2), max_new_tokens=8)))
    engine.run_until_idle()
    assert seen and max(seen) <= 60_000 and max(seen) > 0
    assert all(events_of(h)[1].reason in (FinishReason.EOS, FinishReason.MAX_TOKENS) for h in handles)
    assert engine.host_pool.reserved_bytes <= 60_000
    # the footprint (and its proto) reports the cold tiers beside the hot bytes
    from worker_svc.convert import footprint_to_proto

    fp = engine.footprint()
    assert fp.host_capacity_bytes == 60_000 and fp.host_reserved_bytes == engine.host_pool.reserved_bytes
    assert fp.host_used_bytes == sum(r.cold_bytes for r in fp.sessions) > 0
    wire = footprint_to_proto(fp)
    assert wire.host_used_bytes == fp.host_used_bytes
    assert sorted(r.cold_bytes for r in wire.sessions) == sorted(r.cold_bytes for r in fp.sessions)
    tiny = make_engine(host_pool_bytes=1_000)
    tiny.open_session("big", spec, [])
    with pytest.raises(PoolExhausted, match="host pool holds 1000"):
        tiny.submit(TurnRequest("big", user(PROMPTS[0] * 3), max_new_tokens=8))


def test_estimate_does_not_promise_a_turn_whose_cold_tier_never_fits(make_engine):
    """EstimateBytes' ``fits_pool`` once read the KV pool alone: it said yes to a recall=1 turn
    that ``submit`` refuses (RESOURCE_EXHAUSTED) because its cold tier exceeds the host pool."""
    spec = "window:n=24,recall=1,page=8"
    tiny = make_engine(host_pool_bytes=1_000)
    assert not tiny.estimate(spec, [], context_tokens=200, max_new=8).fits_pool
    assert tiny.estimate("window:n=24", [], context_tokens=200, max_new=8).fits_pool  # no cold tier
    assert tiny.estimate(spec + ",cold_bytes=1", [], context_tokens=200, max_new=8).fits_pool  # bounded
    assert make_engine().estimate(spec, [], context_tokens=200, max_new=8).fits_pool  # no host limit


# -- packed steps: arriving prompt chunks ride in the same forward as the others' decode tokens --
LONG = "A long prompt that arrives while the others decode, so it needs several prefill chunks. " * 2


def _forwards(model, calls: list[int]):
    """Count model forwards (one per engine step when prefill and decode are packed)."""
    return model.register_forward_hook(lambda *_: calls.append(1))


def _arrive_while_two_decode(engine: Engine, arriving: list[str]) -> dict:
    """Sessions of POLICIES[:2] start (30 new tokens) and decode; then sessions of ``arriving``
    submit LONG (20 new tokens). -> {(policy, prompt): handle}"""
    handles = {}
    for i, policy in enumerate(POLICIES[:2]):
        engine.open_session(f"s{i}", policy, [])
        handles[(policy, PROMPTS[i])] = engine.submit(
            TurnRequest(f"s{i}", user(PROMPTS[i]), max_new_tokens=30)
        )
    for _ in range(6):
        engine.step()  # s0, s1 are decoding now
    for i, policy in enumerate(arriving, start=2):
        engine.open_session(f"s{i}", policy, [])
        handles[(policy, LONG)] = engine.submit(TurnRequest(f"s{i}", user(LONG), max_new_tokens=20))
    return handles


def _assert_each_alone(model, handles: dict) -> None:
    """Every turn of ``_arrive_while_two_decode`` produced the tokens it produces alone."""
    for (policy, prompt), handle in handles.items():
        tokens, done = events_of(handle)
        got = [e.token_id for e in tokens] + ([ByteChatCodec.END] if done.reason is FinishReason.EOS else [])
        max_new = 30 if prompt in PROMPTS else 20
        assert got == alone(model, policy, prompt, max_new, 16), policy


def test_arrivals_while_others_decode_equal_each_alone(model, make_engine):
    engine = make_engine()
    calls: list[int] = []
    handles = _arrive_while_two_decode(engine, POLICIES[2:])
    hook = _forwards(model, calls)  # opening and submitting run no forward
    per_step = []
    while True:
        before = len(calls)
        if not engine.step():
            break
        per_step.append(len(calls) - before)
        for session in engine.sessions.values():
            if session.seq is not None:
                assert engine.session_report(session.session_id).kv_bytes == exact_bytes(session.seq)
    hook.remove()
    assert max(per_step) == 1  # every step, arriving prompt chunks included, was at most ONE forward
    _assert_each_alone(model, handles)


RECALL_POLICIES = [
    "confkv:n_high=40,n_low=24,p=4,s=2,int8=1,w=8,recall=1,page=4,obs=8",
    "h2o:n=24,recall=1,page=4,obs=8",
]


def test_recall_prompts_pack_but_for_the_probe_window_and_equal_each_alone(model, make_engine, monkeypatch):
    """A recall turn's prompt chunks ride in the packed forward with the decoding turns; only
    its probe window (the last ``obs`` tokens, capped at a quarter of the smallest budget) runs
    alone, through the probe; every turn's tokens are those it gets alone."""
    import worker_svc.engine as engine_mod

    ends: list[tuple[int, int]] = []  # (rows, tokens) of each prompt end run alone
    packed: list[int] = []  # prompt tokens of recall turns fed by packed forwards
    real_end, real_packed = engine_mod.prompt_end_forward, engine_mod.packed_forward

    def end(m, cache, ids):
        ends.append(tuple(ids.shape))
        return real_end(m, cache, ids)

    def packs(m, seqs, chunks):
        for seq, chunk in zip(seqs, chunks, strict=True):
            if seq.tier is not None and seq.seen_tokens < prompt:  # a prompt chunk, not a decode token
                packed.append(len(chunk))
        return real_packed(m, seqs, chunks)

    prompt = len(ByteChatCodec().encode_chat(user(LONG)))
    monkeypatch.setattr(engine_mod, "prompt_end_forward", end)
    monkeypatch.setattr(engine_mod, "packed_forward", packs)
    engine = make_engine()
    handles = _arrive_while_two_decode(engine, RECALL_POLICIES)
    engine.run_until_idle()
    assert sorted(ends) == [(1, 6), (1, 8)]  # h2o n=24: obs capped at 24 // 4; confkv: obs 8
    assert sum(packed) == 2 * prompt - 6 - 8 and max(packed) > 1  # every other prompt token was packed
    _assert_each_alone(model, handles)


def test_packed_forward_equals_separate_forwards():
    model = tiny_llama(layers=2, seed=3)
    enable(model)
    policies = ["full", "confkv:n_high=24,n_low=12,p=4,s=2,int8=1,w=8"]
    history = [torch.randint(1, 100, (1, n)) for n in (9, 21)]
    chunks = [[5], list(range(10, 22))]  # one decode token, one prompt chunk
    caches = [ConfKVCache.for_model(model, p) for p in policies]
    packed = [ConfKVCache.for_model(model, p) for p in policies]
    for cache, other, ids in zip(caches, packed, history, strict=True):
        forward(model, cache, ids)
        forward(model, other, ids)
    expected = torch.cat(
        [forward(model, c, torch.tensor([ids]))[:, -1] for c, ids in zip(caches, chunks, strict=True)]
    )
    got = packed_forward(model, [c.seqs[0] for c in packed], chunks)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches, packed, strict=True):
        assert a.seqs[0].nbytes() == b.seqs[0].nbytes() and a.seqs[0].seen_tokens == b.seqs[0].seen_tokens
        assert sorted(a.seqs[0].stores[1].meta("pos").tolist()) == sorted(
            b.seqs[0].stores[1].meta("pos").tolist()
        )


def test_packed_cache_rejects_bad_lengths(model):
    seq = ConfKVCache.for_model(model, "full").seqs[0]
    with pytest.raises(ValueError, match="one positive token count"):
        PackedCache([seq], [0])


def test_a_failing_packed_step_falls_back_and_fails_only_the_culprit(make_engine, monkeypatch):
    engine = make_engine()
    engine.open_session("ok", "full", [])
    ok = engine.submit(TurnRequest("ok", user(PROMPTS[0]), max_new_tokens=6))
    engine.step()
    engine.step()
    monkeypatch.setattr(
        "worker_svc.engine.packed_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    engine.open_session("late", "window:n=24", [])
    late = engine.submit(TurnRequest("late", user(PROMPTS[1]), max_new_tokens=6))
    engine.run_until_idle()
    assert events_of(ok)[1].reason in (FinishReason.MAX_TOKENS, FinishReason.EOS)
    assert events_of(late)[1].reason in (FinishReason.MAX_TOKENS, FinishReason.EOS)


@pytest.mark.parametrize("packed", [True, False])
def test_a_step_that_fails_part_way_leaves_no_token_behind(model, make_engine, packed):
    """A forward that fails in its second layer (the first layer had stored the step's tokens)
    is retried turn by turn: with the step rolled back, every turn ends with the tokens of a
    run where nothing failed (full caches: nothing evicted on the way). Without the rollback the
    first layer held the failed step's tokens twice."""

    def run(fail: bool):
        engine = make_engine(packed_prefill=packed)
        failed = [False]

        def hook(_, args):
            if fail and not failed[0] and args[0].shape[0] >= 2:  # the first batched decode step
                failed[0] = True
                raise RuntimeError("layer 1 failed part-way")

        handle = model.model.layers[1].register_forward_pre_hook(hook)
        try:
            handles = []
            for i, prompt in enumerate(PROMPTS[:3]):
                engine.open_session(f"s{i}", "full", [])
                handles.append(engine.submit(TurnRequest(f"s{i}", user(prompt), max_new_tokens=8)))
            engine.run_until_idle()
        finally:
            handle.remove()
        assert failed[0] == fail
        for i in range(3):  # each layer holds every position once, and all agree on the next one
            seq = engine.sessions[f"s{i}"].seq
            for store in seq.stores:
                pos = store.meta("pos").tolist()
                assert len(set(pos)) == len(pos) and store.next_pos == seq.seen_tokens == max(pos) + 1
        return [[e.token_id for e in events_of(h)[0]] for h in handles]

    assert run(fail=True) == run(fail=False)


def test_unpacked_reference_path_gives_the_same_tokens(model, make_engine):
    results = {}
    for packed in (True, False):
        engine = make_engine(packed_prefill=packed)
        engine.open_session("a", POLICIES[2], [])
        first = engine.submit(TurnRequest("a", user(PROMPTS[0]), max_new_tokens=12))
        engine.step()
        engine.open_session("b", POLICIES[3], [])
        second = engine.submit(TurnRequest("b", user(LONG), max_new_tokens=12))
        engine.run_until_idle()
        results[packed] = [[e.token_id for e in events_of(h)[0]] for h in (first, second)]
    assert results[True] == results[False]


def test_only_confidence_following_sequences_pay_for_the_confidence(make_engine):
    """The engine feeds the confidence only to sequences whose budget or recall reads it; a
    fixed-budget sequence without a recall tier skips the softmax over the vocabulary."""
    engine = make_engine()
    policies = ["full", "h2o:n=24,recent=8", "confkv:n_high=24,n_low=16,p=4,s=2", "window:n=20,recall=1"]
    for i, policy in enumerate(policies):
        engine.open_session(f"c{i}", policy, [])
        engine.submit(TurnRequest(f"c{i}", user("tell me more about it"), max_new_tokens=6))
    engine.run_until_idle()
    follows = [engine.sessions[f"c{i}"].seq.last_confidence is not None for i in range(len(policies))]
    assert follows == [False, False, True, True]
    assert [engine.sessions[f"c{i}"].seq.follows_confidence for i in range(len(policies))] == follows


@pytest.mark.parametrize("onednn", [True, False])
def test_linears_run_through_onednn_inside_engine_steps_only(model, make_engine, onednn):
    """``EngineConfig.onednn_linears``: the model's linears take oneDNN's path during the engine's
    forwards (where this PyTorch has it) and PyTorch's own path outside them."""
    from confkv.linear import active, supported

    seen: list[bool] = []
    hook = model.lm_head.register_forward_hook(lambda *_: seen.append(active()))
    try:
        engine = make_engine(onednn_linears=onednn)
        engine.open_session("o", "full", [])
        engine.submit(TurnRequest("o", user(PROMPTS[0]), max_new_tokens=4))
        engine.run_until_idle()
        assert seen and set(seen) == {onednn and supported()}
        seen.clear()
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        assert seen == [False]
    finally:
        hook.remove()


@pytest.mark.smollm2
def test_smollm2_batched_turns_equal_each_alone_with_onednn_linears(smollm2, monkeypatch):
    """The engine's default path on the real model (oneDNN linears, the batch's arena, packed
    prefill): four sessions decoding together produce the tokens each produces alone."""
    from worker_svc.codec import HFChatCodec

    model, tokenizer = smollm2
    engine = Engine(model, HFChatCodec(tokenizer), EngineConfig(kv_pool_bytes=1 << 30, prefill_chunk=64))
    assert engine.config.onednn_linears
    policies = [  # the two confkv members evict at every step once at their budget, together
        "full",
        "confkv:n_high=40,n_low=32,p=8",
        "confkv:n_high=40,n_low=32,p=8",
        "confkv:n_high=96,n_low=64,p=16,int8=1,w=32",
    ]
    prompts = [
        "What is the capital of France?",
        "Name three colours of the rainbow, then say why the sky is blue.",
        "Summarise in one line: it is a truth universally acknowledged, that a single man in possession "
        "of a good fortune, must be in want of a wife.",
        "Write a short poem about the sea.",
    ]

    def run(together: bool, tag: str) -> list[list[int]]:
        handles = []
        for i, (policy, prompt) in enumerate(zip(policies, prompts, strict=True)):
            engine.open_session(f"{tag}{i}", policy, [])
            request = TurnRequest(f"{tag}{i}", user(prompt), max_new_tokens=20, ignore_eos=True)
            handles.append(engine.submit(request))
            if not together:
                engine.run_until_idle()
        engine.run_until_idle()
        return [[e.token_id for e in events_of(h)[0]] for h in handles]

    import confkv.arena

    rows: list[int] = []
    real = confkv.arena.evict_rows
    monkeypatch.setattr(
        confkv.arena, "evict_rows", lambda t, s, r, *a: rows.append(len(r)) or real(t, s, r, *a)
    )
    alone_tokens = run(False, "a")
    batched = run(True, "b")
    assert all(len(t) == 20 for t in batched)
    assert batched == alone_tokens
    assert rows and max(rows) == 2 * 30  # both confkv members, all 30 layers, in one call


@pytest.mark.parametrize("policy", ["h2o:n=24,recent=6", "confkv:n_high=28,n_low=20,p=4,s=2,pyramid=1"])
def test_a_batch_evicting_together_equals_each_member_alone(model, make_engine, monkeypatch, policy):
    """``EngineConfig.evict_by_rows``: members at their budget evict at every layer of every step
    (slack 0), in one call per step (``confkv.evict_rows``), and produce the tokens each produces
    alone; with the option off they evict one by one, with the same tokens."""
    import confkv.arena

    calls: list[int] = []
    real = confkv.arena.evict_rows
    monkeypatch.setattr(
        confkv.arena, "evict_rows", lambda t, seqs, *a: calls.append(len(seqs)) or real(t, seqs, *a)
    )
    prompts = [PROMPTS[0], PROMPTS[2], LONG[:90], "What do you know about the sea and its tides?"]
    results = {}
    for together in (True, False):
        calls.clear()
        engine = make_engine(evict_by_rows=together)
        handles = []
        for i, prompt in enumerate(prompts):
            engine.open_session(f"r{i}", policy, [])
            handles.append(
                engine.submit(TurnRequest(f"r{i}", user(prompt), max_new_tokens=16, ignore_eos=True))
            )
        engine.run_until_idle()
        results[together] = [[e.token_id for e in events_of(h)[0]] for h in handles]
        assert (max(calls, default=0) >= 2) is together  # rows of several members in one call
    assert results[True] == results[False]
    for prompt, got in zip(prompts, results[True], strict=True):
        codec = ByteChatCodec()
        ids = torch.tensor([codec.encode_chat(user(prompt))])
        want = generate(model, ConfKVCache.for_model(model, policy), ids, 16, set(), chunk_size=16).tokens
        assert got == want
