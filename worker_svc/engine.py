"""Transport-free worker engine: many sessions, one model, continuous batching, a fixed KV pool.

Each ``step()``: admit queued turns whose worst-case KV fits the pool (FIFO; idle sessions'
caches are released or demoted, least recently used first, to make room; when no turn is
running, so are the caches of sessions whose turns wait), sample one token for every
decoding turn, then advance everything in ONE forward: every decoding turn's token and one
prompt chunk of every prefilling turn packed along one row (chunked prefill interleaved with
decode, eviction between chunks; ``confkv.batched.PackedCache``), or the plain decode batch over
the ragged caches when nobody is prefilling. A turn with a recall tier packs its chunks too but
for its prompt end, the probe window, which runs alone (through the recall probe).

The pool arithmetic lives in ``KVPool`` (``kvpool.py``: invariant ``sum(reserved) <= pool``;
every session's exact bytes stay within its reservation, a turn reserving ``min(policy peak
bound, full cache of its context)``); text output in ``output.py``. A failure while stepping one
turn (its prefill, its sampling, its share of a batched forward) fails that turn only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from confkv.arena import evict_by_rows, release_arena
from confkv.batched import packed_forward
from confkv.cache import ConfKVCache
from confkv.decode import forward, next_prefill_chunk, observation_window, prompt_end_forward, sample
from confkv.linear import install, onednn_linears
from confkv.memory import KVGeometry
from confkv.sequence import SequenceCache, seed_of
from worker_svc import admission
from worker_svc.codec import ChatCodec
from worker_svc.kvpool import KVPool
from worker_svc.output import Detokenizer
from worker_svc.prompt import PromptEncoder
from worker_svc.session import Session, Turn, TurnHandle
from worker_svc.stats import StepStats, ThroughputMeter
from worker_svc.types import (
    ChatMessage,
    EngineConfig,
    Estimate,
    FinishReason,
    Footprint,
    InternalError,
    InvalidRequest,
    PoolExhausted,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SessionReport,
    SessionState,
    ShuttingDown,
    TokenEvent,
    TurnDone,
    TurnFailed,
    TurnRequest,
)

log = logging.getLogger("confkv.worker")


def _seq(turn: Turn) -> SequenceCache:
    """The cache of a turn's session: created when the session was admitted, before any turn runs."""
    seq = turn.session.seq
    assert seq is not None, "a running turn's session holds a cache"
    return seq


class Engine:
    def __init__(self, model, codec: ChatCodec, config: EngineConfig, on_step: Callable | None = None):
        self.model, self.codec, self.config = model, codec, config
        self.prompts = PromptEncoder(codec)  # per-session incremental tokenization
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.geometry = KVGeometry.from_config(model.config, self.dtype)
        if config.onednn_linears:
            install(model)  # oneDNN linears inside this engine's steps only (``confkv.linear``)
        self.sessions: dict[str, Session] = {}
        self.pool = KVPool("hot", config.kv_pool_bytes)
        self.host_pool = KVPool("host", config.host_pool_bytes or 1 << 62)  # cold tiers (recall=1)
        self.queue: collections.deque[Turn] = collections.deque()
        self.active: list[Turn] = []
        self.lock = threading.RLock()
        self.wakeup = threading.Condition(self.lock)
        self.meter = ThroughputMeter()
        self.on_step = on_step
        self.last_batch_size = 0
        self.demoted_sessions = 0  # idle sessions demoted to their cold tier for hot room
        self.draining = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- session lifecycle (any thread) -------------------------------------------------------
    def open_session(self, session_id: str, policy: str, transcript: Sequence[ChatMessage]) -> SessionReport:
        admission.check_session_id(session_id)
        resolved = admission.parse(policy or self.config.default_policy, self.geometry)
        messages = admission.check_messages(transcript, self.config, allow_empty=True)
        with self.lock:
            self._check_open()
            if session_id in self.sessions:
                raise SessionExists(f"session {session_id!r} is already open on this worker")
            session = Session(session_id, resolved, list(messages))
            self.sessions[session_id] = session
            log.info("session opened", extra={"session_id": session_id, "policy": resolved.spec()})
            return self._report(session)

    def submit(self, request: TurnRequest) -> TurnHandle:
        """Queue a turn; raises InvalidRequest / SessionNotFound / SessionBusy / PoolExhausted.

        Validation and tokenization run outside the engine lock (a long transcript must not stall
        other sessions' steps); the lock is held only to check the session did not move on."""
        messages = admission.check_messages(request.messages, self.config, allow_empty=True)
        max_new = admission.check_max_new_tokens(request.max_new_tokens, self.config)
        admission.check_sampling(request)
        with self.lock:
            self._check_open()
            session = self._get(request.session_id)
            if session.turn is not None:
                raise SessionBusy(f"session {request.session_id!r} already has a turn in progress")
            conversation = [*session.transcript, *messages]
        admission.check_transcript(conversation, self.config)
        ids = session.encode_prompt(self.prompts, conversation)
        limit = self.config.max_context_tokens
        if len(ids) >= limit:
            raise PoolExhausted(f"the conversation has {len(ids)} tokens; the context limit is {limit}")
        capped = min(max_new, limit - len(ids))
        reserve = session.policy.worst_case_bytes(self.geometry, len(ids) + capped)
        if not self.pool.fits_alone(reserve):
            raise PoolExhausted(
                f"the turn needs up to {reserve} KV bytes ({session.policy.spec()}, {len(ids)} + "
                f"{capped} tokens); the pool holds {self.config.kv_pool_bytes}"
            )
        cold_reserve = session.policy.worst_case_cold_bytes(self.geometry, len(ids) + capped)
        if not self.host_pool.fits_alone(cold_reserve):
            raise PoolExhausted(
                f"the turn's cold tier needs up to {cold_reserve} host bytes ({session.policy.spec()}, "
                f"{len(ids) + capped} tokens); the host pool holds {self.config.host_pool_bytes} "
                "(raise --host-pool-bytes or bound the policy's cold tier with cold_bytes=N)"
            )
        with self.lock:
            self._check_open()
            if self.sessions.get(request.session_id) is not session or session.turn is not None:
                raise SessionBusy(f"session {request.session_id!r} changed while the turn was prepared")
            if len(session.transcript) + len(messages) != len(conversation):
                raise SessionBusy(f"session {request.session_id!r} changed while the turn was prepared")
            if len(self.queue) >= self.config.max_queue:
                raise PoolExhausted(f"the wait queue is full ({self.config.max_queue} turns)")
            handle = TurnHandle(TurnRequest(request.session_id, messages, max_new, *_rest(request)))
            turn = Turn(session, handle, ids, capped, capped < max_new, reserve, Detokenizer(self.codec))
            turn.cold_reserve_bytes = cold_reserve
            session.turn, session.state = turn, SessionState.QUEUED
            self.queue.append(turn)
            self.wakeup.notify_all()
            return handle

    def drop(self, session_id: str, release_kv_only: bool = False) -> int:
        """Drop a session (or only its KV); a running turn is cancelled. Returns freed bytes."""
        with self.lock:
            session = self._get(session_id)
            freed = session.nbytes()
            if session.turn is not None:
                session.turn.handle.cancel()
                session.dropping = not release_kv_only
                if session.turn in self.queue:
                    self._finish(session.turn, FinishReason.CANCELLED)
                self.wakeup.notify_all()
                return freed
            self._release_kv(session)
            if not release_kv_only:
                del self.sessions[session_id]
            log.info("session dropped", extra={"session_id": session_id, "freed_bytes": freed})
            return freed

    def estimate(self, policy: str, transcript: Sequence[ChatMessage], context_tokens: int, max_new: int):
        resolved = admission.parse(policy or self.config.default_policy, self.geometry)
        messages = admission.check_messages(transcript, self.config, allow_empty=True)
        if not 0 <= context_tokens <= self.config.max_context_tokens:
            raise InvalidRequest(
                f"context_tokens must be in [0, {self.config.max_context_tokens}], got {context_tokens}"
            )
        max_new = admission.check_max_new_tokens(max_new, self.config)
        admission.check_transcript(messages, self.config)
        tokens = context_tokens + (len(admission.encode(self.codec, messages)) if messages else 0)
        worst = resolved.worst_case_bytes(self.geometry, tokens + max_new)
        bound = admission.policy_bound(resolved, self.geometry)
        # a turn whose cold tier (recall=1) could never fit the host pool is refused too
        cold = resolved.worst_case_cold_bytes(self.geometry, tokens + max_new)
        fits = self.pool.fits_alone(worst) and self.host_pool.fits_alone(cold)
        return Estimate(worst, bound or 0, resolved.spec(), tokens, fits)

    def footprint(self, include_sessions: bool = True) -> Footprint:
        with self.lock:
            sessions = tuple(self._report(s) for s in self.sessions.values())
            host = self.host_pool
            return Footprint(
                worker_id=self.config.worker_id,
                capacity_bytes=self.config.kv_pool_bytes,
                used_bytes=sum(s.kv_bytes for s in sessions),
                reserved_bytes=self.pool.reserved_bytes,
                active_sessions=len(self.active),
                queued_requests=len(self.queue),
                open_sessions=len(sessions),
                batch_size=self.last_batch_size,
                tokens_per_second=self.meter.rate(),
                draining=self.draining,
                sessions=sessions if include_sessions else (),
                host_capacity_bytes=self.config.host_pool_bytes or 0,
                host_used_bytes=sum(s.cold_nbytes() for s in self.sessions.values()),
                host_reserved_bytes=host.reserved_bytes,
            )

    def session_report(self, session_id: str) -> SessionReport:
        with self.lock:
            return self._report(self._get(session_id))

    def used_bytes(self) -> int:
        """Exact KV bytes stored now (the metrics gauge reads this on every scrape)."""
        with self.lock:
            return sum(s.nbytes() for s in self.sessions.values())

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step; returns False when there was nothing to do."""
        with self.lock:
            self._reap_cancelled()
            self._admit()
            work = list(self.active)
        if not work:
            release_arena()  # idle: no session keeps the last decode batch's rows
            return False
        started = time.perf_counter()
        with self.lock:
            decoding = [t for t in work if t.logits is not None and not t.pending and t in self.active]
            continuing = [t for t in decoding if self._isolated(t, self._emit_next)]
        prefilling = [t for t in work if t.pending and t in self.active]
        packs = self.config.packed_prefill
        # a recall turn's prompt end (its probe window) runs alone, through the probe; every
        # chunk before it, the rest of its final chunk included, packs with the others
        sizes = [self._chunk_size(t) if packs else 0 for t in prefilling]
        packed = [(t, n) for t, n in zip(prefilling, sizes, strict=True) if n > 0]
        alone = [t for t, n in zip(prefilling, sizes, strict=True) if n == 0]
        with onednn_linears(self.config.onednn_linears), evict_by_rows(self.config.evict_by_rows):
            for turn in alone:
                self._isolated(turn, self._prefill_chunk)
            if packed:
                self._mixed(continuing, packed)
            elif continuing:
                self._decode(continuing)
        with self.lock:
            self.last_batch_size = len(continuing)
            self.meter.add(len(decoding))
            used = sum(s.nbytes() for s in self.sessions.values())
        if self.on_step is not None:
            self.on_step(StepStats(len(continuing), len(decoding), time.perf_counter() - started, used,
                                   self.config.kv_pool_bytes))  # fmt: skip
        return True

    def _decode(self, turns: list[Turn]) -> None:
        """One batched forward for ``turns``; if it fails, each turn alone, so that only the
        turns that fail by themselves are failed."""
        try:
            self._forward(turns)
        except Exception:
            if len(turns) == 1:
                with self.lock:
                    self._fail(turns[0], "the decode step failed for this turn")
                return
            log.warning("batched decode step failed; retrying its %d turns one by one", len(turns))
            for turn in turns:
                self._isolated(turn, lambda t: self._forward([t]))

    def _mixed(self, decoding: list[Turn], prefilling: list[tuple[Turn, int]]) -> None:
        """One packed forward: a token of every decoding turn and a prompt chunk of every
        prefilling one (chunked prefill interleaved with decode). If it fails, the old way:
        each chunk alone, then the decode batch, so only turns that fail by themselves fail."""
        chunks = [[t.generated[-1]] for t in decoding]
        chunks += [turn.pending[:size] for turn, size in prefilling]
        turns = [*decoding, *(turn for turn, _ in prefilling)]
        try:
            logits = packed_forward(self.model, [_seq(t) for t in turns], chunks)  # (B, V)
        except Exception:
            log.warning("packed step failed; retrying its %d turns the unpacked way", len(turns))
            for turn, _ in prefilling:
                self._isolated(turn, self._prefill_chunk)
            if decoding:
                self._decode(decoding)
            return
        observed = []
        for row, (turn, chunk) in enumerate(zip(turns, chunks, strict=True)):
            turn.fed.extend(chunk)
            if row >= len(decoding):  # a prompt chunk
                turn.pending = turn.pending[len(chunk) :]
                if turn.pending:
                    continue
                turn.session.state = SessionState.DECODE
            turn.logits = logits[row]
            observed.append(row)
        if observed:  # the budgets of the next step follow these logits' confidence
            _observe([_seq(turns[r]) for r in observed], logits[observed])

    def _chunk_size(self, turn: Turn) -> int:
        """Tokens of ``turn``'s prompt the next packed forward feeds: its next prefill chunk,
        except that a recall turn's final chunk stops before the probe window, which then runs
        alone (0: only that window is left). ``prompt_end_forward`` would feed the part before
        the window first anyway, so the tokens and the caches are those of feeding alone."""
        cache = ConfKVCache([_seq(turn)])
        size = next_prefill_chunk(cache, len(turn.pending), self.config.prefill_chunk)
        if cache.seqs[0].tier is not None and size == len(turn.pending):
            size -= min(observation_window(cache), size)
        return size

    def _forward(self, turns: list[Turn]) -> None:
        tokens = torch.tensor([t.generated[-1] for t in turns], device=self.device)
        cache = ConfKVCache([_seq(t) for t in turns])
        logits = forward(self.model, cache, tokens.view(-1, 1))[:, -1]  # (B, V), one forward for all
        _observe(cache.seqs, logits)
        best = logits.argmax(-1).tolist()  # one pass for the batch; sampling turns do not read it
        for turn, row, greedy in zip(turns, logits, best, strict=True):
            turn.fed.append(turn.generated[-1])
            turn.logits, turn.greedy = row, greedy

    def _isolated(self, turn: Turn, work: Callable[[Turn], object]) -> bool:
        """Run one turn's share of the step; an exception fails that turn only."""
        try:
            return bool(work(turn))
        except Exception:
            log.exception("turn failed in the engine", extra={"session_id": turn.session.session_id})
            with self.lock:
                self._fail(turn, "this turn failed in the engine; the worker keeps serving")
            return False

    def _fail(self, turn: Turn, reason: str) -> None:
        if turn in self.active or turn in self.queue:
            self._finish(turn, FinishReason.CANCELLED, error=reason)

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until no work is left (synchronous use: tests, benchmarks). Returns steps taken."""
        for n in range(max_steps):
            if not self.step():
                return n
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="confkv-engine", daemon=True)
            self._thread.start()

    def stop(self, grace: float = 5.0) -> None:
        """Take no new work, let in-flight turns finish for ``grace`` s, cancel the rest."""
        with self.lock:
            self.draining = True
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.active or self.queue):
            time.sleep(0.02)
        with self.lock:
            for turn in [*self.queue, *self.active]:
                self._finish(turn, FinishReason.SHUTDOWN)
            self._stop.set()
            self.wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception:  # outside any one turn (a bug): keep the worker alive, fail the batch
                log.exception("engine step failed")
                with self.lock:
                    for turn in list(self.active):
                        self._finish(turn, FinishReason.CANCELLED, error="internal error in the decode step")
                busy = True
            if not busy:
                with self.lock:
                    if not (self.queue or self.active or self._stop.is_set()):
                        self.wakeup.wait(timeout=0.1)

    # -- internals (engine thread, lock held unless noted) --------------------------------------
    def _check_open(self) -> None:
        if self.draining:
            raise ShuttingDown("the worker is shutting down")

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} on this worker")
        return session

    def _reap_cancelled(self) -> None:
        for turn in [t for t in self.active if t.handle.cancelled]:
            self._finish(turn, FinishReason.CANCELLED)
        for turn in [t for t in self.queue if t.handle.cancelled]:
            self._finish(turn, FinishReason.CANCELLED)

    def _admit(self) -> None:
        while self.queue and len(self.active) < self.config.max_batch_size:
            turn = self.queue[0]
            session = turn.session
            victims = self._victims(session)
            sid = session.session_id
            if not self.host_pool.reserve(
                sid, max(turn.cold_reserve_bytes, session.cold_reserved_bytes()), victims, self._evict_idle
            ):
                return  # FIFO: wait until running turns finish and shrink their reservations
            hot = max(turn.reserve_bytes, session.nbytes())
            if not self.pool.reserve(sid, hot, victims, self._make_room):
                self.host_pool.shrink(sid, session.cold_reserved_bytes())
                return
            self.queue.popleft()
            self._start(turn)

    def _victims(self, session: Session) -> list[str]:
        """Sessions whose caches may make room for ``session``'s turn, least recently used first:
        the idle ones; and, when no turn is running (nothing will ever shrink a reservation),
        those whose turns wait behind this one too (their turns rebuild or resume from cold
        when they start). Without the second group, waiting sessions holding the pool would
        block the queue's head, and every turn behind it, for good."""
        others = sorted(
            (s for s in self.sessions.values() if s is not session and s.seq is not None),
            key=lambda s: s.last_used,
        )
        idle = [s.session_id for s in others if s.turn is None]
        if self.active:
            return idle
        return idle + [s.session_id for s in others if s.turn is not None]

    def _start(self, turn: Turn) -> None:
        session = turn.session
        ids = turn.prompt_ids
        if session.seq is not None and ids[: len(session.fed_ids)] == session.fed_ids:
            turn.pending = ids[len(session.fed_ids) :]
        else:
            if session.seq is not None:
                log.info("rebuilding cache", extra={"session_id": session.session_id})
            session.seq = SequenceCache(
                session.policy, self.geometry, self.dtype, self.device, seed_of(session.session_id)
            )
            session.fed_ids = []
            turn.pending = list(ids)
        turn.prompt_tokens = len(turn.pending)
        session.state = SessionState.PREFILL
        turn.started_at = time.perf_counter()
        if turn.request.temperature > 0:
            turn.generator = torch.Generator().manual_seed(turn.request.seed)
        self.active.append(turn)
        log.info(
            "turn started",
            extra={"session_id": session.session_id, "request_id": turn.request.request_id,
                   "prompt_tokens": len(turn.pending), "reserve_bytes": turn.reserve_bytes},
        )  # fmt: skip

    def _prefill_chunk(self, turn: Turn) -> None:
        """Feed one chunk of the turn's prompt (lock not held: the turn is the engine's)."""
        cache = ConfKVCache([_seq(turn)])
        size = next_prefill_chunk(cache, len(turn.pending), self.config.prefill_chunk)
        chunk, turn.pending = turn.pending[:size], turn.pending[size:]
        ids = torch.tensor([chunk], device=self.device)
        feed = forward if turn.pending else prompt_end_forward  # the turn's end recalls (recall=1)
        logits = feed(self.model, cache, ids)[:, -1]  # (1, V)
        turn.fed.extend(chunk)
        if not turn.pending:
            _observe(cache.seqs, logits)
            turn.logits = logits[0]
            turn.session.state = SessionState.DECODE

    def _emit_next(self, turn: Turn) -> bool:
        """Sample the turn's next token and stream it; returns True when it must be fed."""
        assert turn.logits is not None  # set by the last prefill chunk or decode step
        request = turn.request
        if request.temperature <= 0 and turn.greedy is not None:
            token = turn.greedy  # what ``sample`` returns at temperature 0, computed batched
        else:
            token = int(sample(turn.logits[None], request.temperature, turn.generator, request.top_p)[0])
        turn.greedy = None
        turn.generated.append(token)
        if token in self.codec.eos_ids and not turn.request.ignore_eos:
            self._finish(turn, FinishReason.EOS)
            return False
        delta = turn.output.push(token)
        seq = _seq(turn)
        budget = seq.budget if seq.policy.evicts else 0  # full: no budget (unbounded)
        event = TokenEvent(token, delta, len(turn.generated) - 1, seq.nbytes(), budget)
        turn.handle.events.put(event)
        if len(turn.generated) >= turn.max_new_tokens:
            self._finish(turn, FinishReason.CONTEXT if turn.context_capped else FinishReason.MAX_TOKENS)
            return False
        if turn.handle.cancelled:
            self._finish(turn, FinishReason.CANCELLED)
            return False
        return True

    def _finish(self, turn: Turn, reason: FinishReason, error: str | None = None) -> None:
        session = turn.session
        if turn in self.active:
            self.active.remove(turn)
        if turn in self.queue:
            self.queue.remove(turn)
        ends = (FinishReason.EOS, FinishReason.MAX_TOKENS, FinishReason.CONTEXT)
        completed = error is None and reason in ends
        text = turn.output.final(turn.generated)
        if completed:
            session.transcript += [*turn.request.messages, ChatMessage("assistant", text)]
            session.fed_ids += turn.fed
            self.pool.shrink(session.session_id, session.nbytes())
            self.host_pool.shrink(session.session_id, session.cold_reserved_bytes())
        else:  # the cancelled turn is not committed: its KV goes, the transcript stays
            self._release_kv(session)
        session.turn, session.state, session.last_used = None, SessionState.IDLE, time.monotonic()
        if session.dropping:
            self._release_kv(session)
            self.sessions.pop(session.session_id, None)
        now = time.perf_counter()
        started = turn.started_at or now
        if error is not None:
            turn.handle.events.put(TurnFailed(InternalError(error)))
        else:
            seen = session.seq.seen_tokens if session.seq else 0
            report = self._report(session)
            done = TurnDone(reason, text, turn.prompt_tokens, len(turn.generated), seen, report,
                            now - started, started - turn.enqueued_at)  # fmt: skip
            turn.handle.events.put(done)
        log.info(
            "turn finished",
            extra={"session_id": session.session_id, "request_id": turn.request.request_id,
                   "reason": reason.value, "generated_tokens": len(turn.generated)},
        )  # fmt: skip

    def _evict_idle(self, session_id: str) -> int:
        log.info("idle KV released for room", extra={"session_id": session_id})
        self._release_kv(self.sessions[session_id])
        return 0

    def _make_room(self, session_id: str) -> int:
        """Hot-pool pressure on an idle session: demote its hot cache to its cold tier (recall=1
        and host room for the worst case: the next turn resumes without re-reading the
        conversation, and its prompt-end probe recalls what it asks about), else release it.
        Returns the hot bytes it still holds (the pool keeps that reservation)."""
        session = self.sessions[session_id]
        seq = session.seq
        if seq is None or seq.tier is None or not self.config.demote_idle:
            return self._evict_idle(session_id)
        worst = session.policy.worst_case_cold_bytes(self.geometry, seq.seen_tokens)
        if not self.host_pool.reserve(session_id, max(worst, seq.cold_reserved_bytes())):
            return self._evict_idle(session_id)  # no host room for it: released, as before
        before = seq.nbytes()
        moved = seq.demote_to_cold()
        self.host_pool.shrink(session_id, seq.cold_reserved_bytes())
        if moved == 0:  # already demoted: nothing more to gain but releasing it
            return self._evict_idle(session_id)
        self.demoted_sessions += 1
        log.info(
            "idle KV demoted to the cold tier for room",
            extra={"session_id": session_id, "moved_tokens": moved, "freed_bytes": before - seq.nbytes(),
                   "cold_bytes": seq.cold_nbytes()},
        )  # fmt: skip
        return seq.nbytes()

    def _release_kv(self, session: Session) -> int:
        self.pool.release(session.session_id)
        self.host_pool.release(session.session_id)
        return session.release_kv()

    def _report(self, session: Session) -> SessionReport:
        return session.report(self.pool.reserved(session.session_id))


def _observe(seqs: list[SequenceCache], logits: torch.Tensor) -> None:
    """Feed each sequence the confidence of its newest logits (B, V), which sets its next budget;
    sequences whose budget does not follow confidence (``full``, ``h2o``, ... without a recall
    tier) skip the softmax over the vocabulary."""
    rows = [i for i, seq in enumerate(seqs) if seq.follows_confidence]
    if len(rows) == len(seqs):
        ConfKVCache(seqs).observe_logits(logits)  # no copy of the (B, V) logits
    elif rows:
        ConfKVCache([seqs[i] for i in rows]).observe_logits(logits[rows])


def _rest(request: TurnRequest) -> tuple:
    return request.temperature, request.seed, request.top_p, request.request_id, request.ignore_eos
