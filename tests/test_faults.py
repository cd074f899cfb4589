"""Fault injection with real processes (issue 11): a ``confkv scheduler``, two ``confkv worker``s
(tiny random Llama) and a Redis of the test's own (free port, AOF in a temp dir) that the test
stops, pauses and kills. Every turn goes through a ledger: at the end, no acknowledged turn is
lost, none is duplicated, none reported as failed is recorded (a failure with an unknown outcome
is retried with the same request id until it is acknowledged), and the workers' KV is back to 0.

``CONFKV_RELIABILITY_REPORT=reports/reliability.md`` writes the table of this run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from confkv_proto import scheduler_pb2 as pb
from confkv_proto import worker_pb2 as wpb
from confkv_proto import worker_pb2_grpc as wpb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.client import SchedulerClient
from tests.helpers import WORKER_TOKEN, PrivateRedis, Proc, free_port, save_tiny_model

pytestmark = pytest.mark.redis
ALICE, BOB = "alice-token", "bob-token"
POLICY = "window:n=64"  # 64 tokens x 2 layers x 256 B = 32 KiB per running turn
POOL = 40_000  # one running turn per worker
ROWS: list[dict] = []


class Redis(PrivateRedis):
    """A redis-server of this test only: AOF (fsync always) in a temp dir; stop/pause/kill."""

    def __init__(self, folder: Path) -> None:
        super().__init__(aof_folder=folder)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


class Ledger:
    """Every turn sent: request id -> (session, text, outcome). Verified against the store."""

    def __init__(self) -> None:
        self.turns: dict[str, tuple[str, str]] = {}
        self.acked: set[str] = set()
        self.failed: set[str] = set()

    def send(
        self, client: SchedulerClient, sid: str, text: str, rid: str | None = None, **kw
    ) -> pb.ChatEvent:
        rid = rid or secrets.token_hex(8)
        self.turns[rid] = (sid, text)
        try:
            done = None
            for event in client.chat(sid, text, request_id=rid, **kw):
                if event.HasField("done"):
                    done = event
            assert done is not None
        except grpc.RpcError:
            self.failed.add(rid)
            raise
        self.acked.add(rid)
        self.failed.discard(rid)
        return done

    def retry(self, client: SchedulerClient, rid: str, attempts: int = 20) -> pb.ChatEvent:
        """Resend a failed turn with the same request id until it is acknowledged."""
        sid, text = self.turns[rid]
        for _ in range(attempts):
            try:
                return self.send(client, sid, text, rid, max_new_tokens=4)
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                time.sleep(0.5)
        raise AssertionError(f"turn {rid} never acknowledged")

    def check(self, client: SchedulerClient, sids: list[str]) -> dict:
        """Counts (acknowledged, lost, duplicated, failed-but-recorded) over ``sids``."""
        counts = Counter()
        for sid in sids:
            transcript = [m.content for m in client.get_session(sid).transcript if m.role == "user"]
            mine = {rid: text for rid, (s, text) in self.turns.items() if s == sid}
            seen = Counter(transcript)
            for rid, text in mine.items():
                if rid in self.acked:
                    counts["acknowledged"] += 1
                    counts["lost"] += seen[text] == 0
                elif seen[text]:
                    counts["failed_but_recorded"] += 1
                counts["duplicated"] += max(0, seen[text] - 1)
        return {k: counts[k] for k in ("acknowledged", "lost", "duplicated", "failed_but_recorded")}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    model = save_tiny_model(folder / "tiny")
    redis = Redis(folder)
    redis.start()
    workers: dict[str, Proc] = {}
    metrics_port = free_port()
    for name in ("a", "b"):
        port = free_port()
        args = ["worker", "--model", str(model), "--port", str(port), "--kv-pool-bytes", str(POOL)]
        args += ["--max-new-tokens", "6", "--log-format", "text", "--prefill-chunk", "32"]
        if name == "a":
            args += ["--metrics-port", str(metrics_port)]
        workers[f"127.0.0.1:{port}"] = Proc(args, folder / f"worker-{name}.log").start()
    for address, proc in workers.items():
        proc.wait_serving(int(address.rsplit(":", 1)[1]))
    state = {
        "folder": folder,
        "model": model,
        "redis": redis,
        "workers": workers,
        "metrics_port": metrics_port,
    }
    state["scheduler"], state["port"] = start_scheduler(state)
    yield state
    state["scheduler"].kill(signal.SIGTERM)
    for proc in workers.values():
        proc.kill(signal.SIGTERM)
    redis.kill()
    write_report()


def start_scheduler(state, port: int | None = None) -> tuple[Proc, int]:
    port = port or free_port()
    args = ["scheduler", "--port", str(port), "--redis", state["redis"].url, "--redis-prefix", "faults:"]
    args += ["--workers", ",".join(state["workers"]), "--queue-limit", "4", "--admission-timeout", "20"]
    args += ["--max-new-tokens", "6"]
    env = {"CONFKV_AUTH_TOKEN": f"alice={ALICE},bob={BOB}"}
    proc = Proc(args, state["folder"] / f"scheduler-{port}.log", env).start()
    proc.wait_serving(port, timeout_s=60)
    return proc, port


def client(state, token: str = ALICE) -> SchedulerClient:
    return SchedulerClient(f"127.0.0.1:{state['port']}", token)


def worker_stub(address: str):
    return wpb_grpc.WorkerStub(grpc.insecure_channel(address))


def worker_footprints(state) -> dict[str, wpb.WorkerFootprint]:
    md = (("authorization", f"Bearer {WORKER_TOKEN}"),)
    return {
        a: worker_stub(a).GetFootprint(wpb.FootprintRequest(include_sessions=True), metadata=md, timeout=5)
        for a in state["workers"]
    }


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def kv_back_to_zero(state) -> bool:
    return all(f.used_bytes == 0 and not f.sessions for f in worker_footprints(state).values())


def record(fault: str, ledger: Ledger, c: SchedulerClient, sids: list[str], note: str = "") -> None:
    ROWS.append({"fault": fault, **ledger.check(c, sids), "note": note})


def end_all(c: SchedulerClient, sids: list[str]) -> None:
    for sid in sids:
        c.end_session(sid)


def background_turns(
    c: SchedulerClient, sid: str, ledger: Ledger, stop: threading.Event, out: list
) -> threading.Thread:
    """Another session streaming turns the whole time: it must keep going."""

    def run():
        while not stop.is_set():
            try:
                ledger.send(c, sid, f"background {secrets.token_hex(3)}", max_new_tokens=4)
                out.append("ok")
            except grpc.RpcError as err:
                out.append(err.code().name)
            stop.wait(0.25)  # paced: unpaced on a fast machine, the session filled its 512 tokens

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --- 1: a bad request fails only itself ------------------------------------------------------------


def test_bad_sampling_fails_only_itself_and_no_worker_goes_down(env):
    c, ledger = client(env), Ledger()
    victim, other = (c.create_session(POLICY).session_id for _ in range(2))
    stop, results = threading.Event(), []
    thread = background_turns(c, other, ledger, stop, results)
    for temperature in (1e-38, float("nan"), float("inf"), -1.0, 1e-45):
        with pytest.raises(grpc.RpcError) as info:
            ledger.send(c, victim, "sample badly", temperature=temperature)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    md = (("authorization", f"Bearer {WORKER_TOKEN}"),)
    stub = worker_stub(next(iter(env["workers"])))
    stub.OpenSession(wpb.OpenSessionRequest(session_id="direct-nan", policy=POLICY), metadata=md, timeout=5)
    request = wpb.GenerateRequest(
        session_id="direct-nan",
        messages=[wpb.ChatMessage(role="user", content="x")],
        temperature=float("nan"),
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, metadata=md, timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.DropSession(wpb.DropSessionRequest(session_id="direct-nan"), metadata=md, timeout=5)
    time.sleep(1.0)
    stop.set()
    thread.join(30)
    assert results and set(results) == {"ok"}, results
    assert all(w.healthy for w in c.stats().workers)
    ledger.turns = {r: t for r, t in ledger.turns.items() if t[0] == other or r in ledger.acked}
    record(
        "bad sampling (1e-38, NaN, inf, -1, subnormal) + direct Worker.Generate(NaN)",
        ledger,
        c,
        [victim, other],
        "each INVALID_ARGUMENT; a concurrent session kept streaming; no worker marked down",
    )
    end_all(c, [victim, other])


# --- 2: Redis stalled during the write: retry with the same request id is exactly-once -----------


def test_redis_stall_during_the_write_then_retry_is_exactly_once(env):
    c, ledger, redis = client(env), Ledger(), env["redis"]
    sid = c.create_session(POLICY).session_id
    ledger.send(c, sid, "before the stall", max_new_tokens=4)
    rid = secrets.token_hex(8)
    ledger.turns[rid] = (sid, "during the stall")
    stream = c.chat(sid, "during the stall", max_new_tokens=48, request_id=rid)
    next(stream)  # the turn is running: its store read is done
    redis.signal(signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "may or may not" in info.value.details() or "retry" in info.value.details()
        ledger.failed.add(rid)
        time.sleep(1.0)
    finally:
        redis.signal(signal.SIGCONT)
    ledger.retry(c, rid)
    ledger.send(c, sid, "after the stall", max_new_tokens=4)
    record("Redis SIGSTOP during a turn's write, SIGCONT, retry same request id", ledger, c, [sid],
           'UNAVAILABLE "may or may not have been applied"; retry answered from the store')  # fmt: skip
    assert ROWS[-1]["lost"] == ROWS[-1]["duplicated"] == 0
    end_all(c, [sid])


# --- 3: isolation between clients; workers accept only the scheduler --------------------------------


def test_clients_are_isolated_and_workers_accept_only_the_scheduler(env):
    alice, bob = client(env, ALICE), client(env, BOB)
    sid = alice.create_session(POLICY).session_id
    alice.turn(sid, "my secret is 42", max_new_tokens=3)
    for call in (
        lambda: bob.get_session(sid),
        lambda: list(bob.chat(sid, "inject this")),
        lambda: bob.end_session(sid),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert sid not in [s.session_id for s in bob.list_sessions().sessions]
    assert sid in [s.session_id for s in alice.list_sessions().sessions]
    for token in (ALICE, None):  # a client token (or none) cannot reach a worker
        md = (("authorization", f"Bearer {token}"),) if token else ()
        with pytest.raises(grpc.RpcError) as info:
            worker_stub(next(iter(env["workers"]))).GetFootprint(
                wpb.FootprintRequest(), metadata=md, timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:  # and the worker token is no client credential
        client(env, WORKER_TOKEN).list_sessions()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [m.content for m in alice.get_session(sid).transcript][0] == "my secret is 42"
    alice.end_session(sid)


# --- 4 + 8: idle sessions hold no reservation; a turn cancelled while queued leaves the queue ------


def test_idle_sessions_do_not_block_admission_and_cancel_frees_the_queue(env):
    c, ledger = client(env), Ledger()
    sids = [c.create_session(POLICY).session_id for _ in range(5)]  # room for 2 running turns
    start = time.time()
    for round_ in range(2):
        for sid in sids:
            ledger.send(c, sid, f"round {round_} {sid[:4]}", max_new_tokens=3)
    assert time.time() - start < 60
    # both workers busy with long turns: a third turn queues; cancelling it frees its slot at once
    streams = [c.chat(sid, "a long answer please", max_new_tokens=200) for sid in sids[:2]]
    for s in streams:
        next(s)
    queued = c.chat(sids[2], "wait for room", max_new_tokens=3, timeout=60)
    first = next(queued)
    assert first.HasField("queued"), first
    queued.cancel()
    wait_until(lambda: c.stats().queued == 0, 5, "the cancelled turn left the queue")
    for s in streams:
        s.cancel()
    ledger.send(c, sids[2], "not locked", max_new_tokens=3)
    record("5 sessions / room for 2 running turns; a queued turn cancelled", ledger, c, sids,
           "idle sessions hold no reservation; the cancelled turn left the queue at once")  # fmt: skip
    end_all(c, sids)
    wait_until(lambda: kv_back_to_zero(env), 20, "KV back to zero")


# --- 6 + 7 + 8: limits, oversize transcripts, sessions that can never fit ----------------------------


def test_limits_are_one_contract_and_oversize_is_refused_early(env):
    c = client(env)
    with pytest.raises(grpc.RpcError) as info:
        c.create_session("full")  # worst case: 512 tokens of FP KV, more than any pool
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "never run" in info.value.details()
    sid = c.create_session(POLICY).session_id
    with pytest.raises(grpc.RpcError) as info:
        list(c.chat(sid, "x" * 32_001))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(
        grpc.RpcError
    ) as info:  # 32,000 characters: a legal message, too long for this context
        list(c.chat(sid, "y" * 32_000))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in info.value.details()
    request = pb.CreateSessionRequest(
        policy=POLICY, messages=[wpb.ChatMessage(role="system", content="z" * 3000) for _ in range(2)]
    )
    with pytest.raises(grpc.RpcError) as info:
        c.stub.CreateSession(request, metadata=c.metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    c.turn(sid, "still serving", max_new_tokens=3)
    c.end_session(sid)
    row = {"acknowledged": 1, "lost": 0, "duplicated": 0, "failed_but_recorded": 0}
    fault = "oversize message / transcript, `full` policy on a small pool"
    ROWS.append({"fault": fault, **row, "note": "INVALID_ARGUMENT / RESOURCE_EXHAUSTED before any work"})


# --- worker SIGSTOP (hang) and SIGKILL; 5: reconcile after the blip -----------------------------------


def test_worker_sigstop_ends_streams_and_its_kv_is_reconciled(env):
    c, ledger = client(env), Ledger()
    sids = [c.create_session(POLICY).session_id for _ in range(2)]
    for sid in sids:
        ledger.send(c, sid, f"warm {sid[:4]}", max_new_tokens=3)
    placed = {s.session_id: s.worker for s in (c.get_session(sid, False) for sid in sids)}
    victim_sid = sids[0]
    address = placed[victim_sid]
    proc = env["workers"][address]
    rid = secrets.token_hex(8)
    ledger.turns[rid] = (victim_sid, "while the worker is stopped")
    stream = c.chat(victim_sid, "while the worker is stopped", max_new_tokens=200, request_id=rid)
    next(stream)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGSTOP)
    started = time.time()
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        hung = time.time() - started
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and hung < 20, hung
        ledger.failed.add(rid)
        c.end_session(sids[1])  # ended while its worker may be unreachable
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    ledger.retry(c, rid)
    record(f"worker SIGSTOP mid-stream (stream ended in {hung:.1f} s), SIGCONT", ledger, c, [victim_sid],
           "stream cut when the worker missed a poll; KV reconciled to 0 after the blip")  # fmt: skip
    c.end_session(victim_sid)
    wait_until(lambda: kv_back_to_zero(env), 20, "KV back to zero after the blip")


def test_worker_sigkill_mid_turn_other_sessions_keep_streaming(env):
    c, ledger = client(env), Ledger()
    sids = [c.create_session(POLICY).session_id for _ in range(2)]
    for sid in sids:
        ledger.send(c, sid, f"warm {sid[:4]}", max_new_tokens=3)
    address = c.get_session(sids[0], False).worker
    other = sids[1]
    rid = secrets.token_hex(8)
    ledger.turns[rid] = (sids[0], "worker dies now")
    stream = c.chat(sids[0], "worker dies now", max_new_tokens=200, request_id=rid)
    next(stream)
    env["workers"][address].kill(signal.SIGKILL)
    with pytest.raises(grpc.RpcError):
        list(stream)
    ledger.failed.add(rid)
    ledger.retry(c, rid)  # re-placed on the surviving worker from the stored transcript
    ledger.send(c, other, "still here", max_new_tokens=3)
    env["workers"][address].start()
    env["workers"][address].wait_serving(int(address.rsplit(":", 1)[1]))
    record("worker SIGKILL mid-turn, restarted", ledger, c, sids,
           "retry re-placed on the other worker; other session kept streaming")  # fmt: skip
    end_all(c, sids)
    wait_until(lambda: kv_back_to_zero(env), 30, "KV back to zero")


# --- scheduler SIGKILL between the worker's and Redis's write ----------------------------------------


def worker_turns(env, sid: str) -> int:
    """Messages in the worker copy of ``sid`` (0 when no worker holds it)."""
    reports = [s for f in worker_footprints(env).values() for s in f.sessions if s.session_id == sid]
    return max((s.turns for s in reports), default=0)


def test_scheduler_killed_between_worker_and_redis_write(env):
    """The window of issue 11.3, held open on purpose: Redis pauses writes (``CLIENT PAUSE WRITE``:
    reads go on, the scheduler's append waits), the worker's footprint shows the turn in its copy
    while Redis's transcript lacks it, and then the scheduler is SIGKILLed; Redis resumes (the dead
    client's pending append goes with its connection). The client was never told the turn
    succeeded, the restarted scheduler does not adopt the worker's copy, and a retry with the same
    request id records the turn once."""
    import redis as redis_py

    c, ledger = client(env), Ledger()
    sid = c.create_session(POLICY).session_id
    ledger.send(c, sid, "acknowledged before the crash", max_new_tokens=3)
    admin = redis_py.Redis.from_url(env["redis"].url, decode_responses=True)
    stored = lambda: [json.loads(m)["content"] for m in admin.lrange(f"faults:t:{sid}", 0, -1)]
    assert len(stored()) == 2 and worker_turns(env, sid) == 2
    text, rid = "the worker has it, Redis does not", secrets.token_hex(8)
    ledger.turns[rid] = (sid, text)
    events, errors = [], []

    def consume() -> None:
        try:
            events.extend(c.chat(sid, text, max_new_tokens=6, request_id=rid))
        except grpc.RpcError as err:
            errors.append(err.code())

    admin.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    try:
        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        wait_until(lambda: worker_turns(env, sid) == 4, 20, "the worker's copy holding the turn")
        time.sleep(0.5)  # the scheduler is now waiting on its append
        assert text not in stored() and len(stored()) == 2  # ... which Redis has not applied
        env["scheduler"].kill(signal.SIGKILL)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    reader.join(30)
    assert errors and not any(e.HasField("done") for e in events)  # never told it succeeded
    ledger.failed.add(rid)
    time.sleep(0.5)
    assert text not in stored()  # the killed scheduler's pending write was not applied later
    env["scheduler"], env["port"] = start_scheduler(env, env["port"])
    wait_until(lambda: kv_back_to_zero(env), 10, "worker copies dropped at start")
    c = client(env)
    users = [m.content for m in c.get_session(sid).transcript if m.role == "user"]
    assert users == ["acknowledged before the crash"]  # the worker's copy was not adopted
    replayed = sum(1 for m in stored() if m.strip())  # the worker is not sent empty replies
    ledger.retry(c, rid)
    assert worker_turns(env, sid) == replayed + 2  # Redis's transcript + the retry, not the old copy
    ledger.send(c, sid, "after the restart", max_new_tokens=3)
    record(
        "scheduler SIGKILL while the worker held a turn Redis did not (Redis CLIENT PAUSE WRITE)",
        ledger,
        c,
        [sid],
        "worker footprint showed the turn, Redis lacked it; client got no done; restarted scheduler "
        "dropped the worker copy, the retry recorded it once",
    )
    assert ROWS[-1]["lost"] == ROWS[-1]["duplicated"] == ROWS[-1]["failed_but_recorded"] == 0
    admin.close()
    c.end_session(sid)


# --- Redis down (health) and restarted from its AOF ---------------------------------------------------


def health(env) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{env['port']}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_redis_killed_and_restarted_from_aof(env):
    c, ledger, redis = client(env), Ledger(), env["redis"]
    sids = [c.create_session(POLICY).session_id for _ in range(2)]
    for i in range(3):
        for sid in sids:
            ledger.send(c, sid, f"turn {i} {sid[:4]}", max_new_tokens=3)
    redis.kill()
    wait_until(lambda: health(env) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        ledger.send(c, sids[0], "while Redis is down", max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # never UNKNOWN
    redis.start()
    wait_until(lambda: health(env) == health_pb2.HealthCheckResponse.SERVING, 10, "SERVING again")
    for rid in list(ledger.failed):
        ledger.retry(c, rid)
    record("Redis SIGKILL (health NOT_SERVING), restart from AOF", ledger, c, sids,
           "UNAVAILABLE (never UNKNOWN) while down; SERVING again after restart")  # fmt: skip
    assert ROWS[-1]["lost"] == ROWS[-1]["duplicated"] == 0
    end_all(c, sids)


# --- the metrics gauge is live ------------------------------------------------------------------------


def test_used_bytes_gauge_follows_drops(env):
    import urllib.request

    def gauge() -> float:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{env['metrics_port']}/metrics", timeout=5)
            .read()
            .decode()
        )
        line = next(x for x in text.splitlines() if x.startswith("confkv_worker_kv_bytes_used{"))
        return float(line.rsplit(" ", 1)[1])

    wait_until(lambda: kv_back_to_zero(env), 20, "idle cluster")
    assert gauge() == 0.0


# --- 14.1: every server refuses a port in use and invalid ports ---------------------------------------


def confkv(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "confkv_serve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_servers_refuse_a_port_in_use_and_invalid_ports(env):
    used = next(iter(env["workers"])).rsplit(":", 1)[1]
    started = time.time()
    for args in (
        ["worker", "--model", str(env["model"]), "--port", used],
        ["scheduler", "--workers", "127.0.0.1:1", "--port", str(env["port"])],
        ["serve", "--port", str(env["port"])],
        ["worker", "--port", "99999"],
        ["scheduler", "--workers", "127.0.0.1:1", "--port", "-1"],
        ["worker", "--host", "0.0.0.0", "--port", "0"],  # no token off loopback: refused
    ):
        result = confkv(*args)
        assert result.returncode == 2, (args, result.stderr[-500:])
        assert "Traceback" not in result.stderr and result.stderr.strip(), args
    assert time.time() - started < 60


def write_report() -> None:
    target = os.environ.get("CONFKV_RELIABILITY_REPORT")
    if not target or not ROWS:
        return
    lines = [
        "| fault or bad input | turns acknowledged | lost | duplicated | failed but recorded | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in ROWS:
        lines.append(
            f"| {r['fault']} | {r['acknowledged']} | {r['lost']} | {r['duplicated']} "
            f"| {r['failed_but_recorded']} | {r.get('note', '')} |"
        )
    table = "\n".join(lines) + "\n"
    Path(target).with_suffix(".table.md").write_text(table)
    report = Path(target)
    if report.is_file():  # the report's own table becomes this run's
        old = report.read_text()
        report.write_text(
            re.sub(r"^\| fault or bad input .*?\n(?!\|)", lambda _: table, old, count=1, flags=re.M | re.S)
        )
