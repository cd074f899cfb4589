"""Capacity experiment: how many agent sessions one worker's KV pool serves at once, per policy.

One process runs what ``confkv serve`` runs (the scheduler + one worker, in-memory sessions),
built in-process so the worker's context limit and batch cap can be set: the scheduler reserves
a ``full`` session's growth up to the worker's context limit and a Conf-KV session's up to its
N_high byte bound. At each level N, N conversations run at once over gRPC;
the conversations start together, so N sessions are served concurrently iff all their turns
complete and none waited for KV room (no QueuedNotice): all N were resident in the pool at once.
The largest decode batch seen is reported beside it. The pool is the same for every policy.

    python -m loadtest.capacity --json reports/capacity.json --plot reports/capacity.png
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from loadtest.client import SchedulerClient
from loadtest.conversations import ConversationConfig, conversation, load_corpus
from loadtest.metrics import summarize

SHOWN = ("policy", "sessions", "served_concurrently", "failed", "max_batch", "throughput_tok_s",
         "ttft_ms_p50", "ttft_ms_p95", "wall_s")  # fmt: skip


class StepRecorder:
    """Wraps the engine's per-step hook: the largest decode batch and KV bytes, exactly per step."""

    def __init__(self, engine):
        self.engine, self.inner = engine, engine.on_step
        self.reset()
        engine.on_step = self

    def reset(self) -> None:
        self.max_batch = self.max_used = self.steps = self.over_capacity = self.max_resident = 0
        self.max_host_used = self.over_host_capacity = 0

    def __call__(self, stats) -> None:
        self.steps += 1
        self.max_batch = max(self.max_batch, stats.batch_size)
        self.max_used = max(self.max_used, stats.used_bytes)
        self.over_capacity += stats.used_bytes > stats.capacity_bytes
        # sessions holding KV on the worker (an idle one may be open with its KV released)
        resident = sum(1 for s in self.engine.sessions.values() if s.seq is not None)
        self.max_resident = max(self.max_resident, resident)
        # host memory of recall=1 cold tiers (exact stored bytes), against the host pool
        host = sum(s.cold_nbytes() for s in self.engine.sessions.values())
        self.max_host_used = max(self.max_host_used, host)
        limit = self.engine.config.host_pool_bytes
        self.over_host_capacity += limit is not None and host > limit
        if self.inner is not None:
            self.inner(stats)


def _agent(client, policy, turns, max_new, barrier, metrics, failures, queued, lock) -> None:
    try:
        session = client.create_session(policy)
    except grpc.RpcError as err:
        with lock:
            failures[f"CreateSession:{err.code().name}"] += 1
        session = None
    barrier.wait()  # all conversations start together; later turns run as each agent's replies end
    for turn in turns:
        if session is None:
            break
        try:
            reply = client.chat(session, turn, max_new)
        except grpc.RpcError as err:
            with lock:
                failures[f"Chat:{err.code().name}"] += 1
            continue
        with lock:
            metrics.append(reply.metrics)
            queued.append(reply.metrics.queued)
    if session is not None:
        client.end_session(session)


def settle(engine, poll_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Wait until the previous level's sessions are gone from the worker and the scheduler has
    polled it since (stale footprints would count as someone else's bytes and queue turns)."""
    deadline = time.monotonic() + timeout_s
    while engine.footprint(include_sessions=False).open_sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.5 * poll_s)


def run_level(
    address: str,
    recorder: StepRecorder,
    policy: str,
    n: int,
    conv: ConversationConfig,
    max_new: int,
    seed: int,
) -> dict:
    """N simultaneous conversations; returns the summary plus concurrency evidence."""
    corpus = load_corpus()
    client = SchedulerClient(address)
    settle(recorder.engine)
    recorder.reset()
    barrier = threading.Barrier(n)
    metrics, queued, failures, lock = [], [], Counter(), threading.Lock()
    threads = [
        threading.Thread(
            target=_agent,
            args=(
                client,
                policy,
                conversation(corpus, seed + i, conv),
                max_new,
                barrier,
                metrics,
                failures,
                queued,
                lock,
            ),
        )  # fmt: skip
        for i in range(n)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    client.close()
    result = summarize(metrics, dict(failures), wall)
    result |= {
        "policy": policy, "sessions": n, "max_batch": recorder.max_batch,
        "max_resident": recorder.max_resident, "decode_steps": recorder.steps,
        "max_used_bytes": recorder.max_used, "capacity_bytes": recorder.engine.config.kv_pool_bytes,
        "steps_over_capacity": recorder.over_capacity, "queued_notices": sum(queued),
        "max_host_used_bytes": recorder.max_host_used,
        "steps_over_host_capacity": recorder.over_host_capacity,
        "demoted_sessions": recorder.engine.demoted_sessions,
        "expected_turns": n * conv.turns,
    }  # fmt: skip
    result["served_concurrently"] = (
        result["failed"] == 0 and result["turns"] == n * conv.turns
        and result["queued_notices"] == 0
    )  # fmt: skip
    return result


def start_stack(
    model: str,
    pool_caches: int,
    max_context: int,
    max_batch: int,
    timeout_s: float,
    host_pool: int | None = None,
):
    """Load ``model`` and start what ``confkv serve`` starts, with this pool, limit and batch cap."""
    from worker_svc.app import create_engine

    probe = create_engine(model, 1, max_context_tokens=max_context)  # loads the model once
    pool = pool_caches * probe.geometry.full_bytes(max_context)
    services = start_services(
        probe.model, probe.codec, model, pool, max_context, max_batch, timeout_s, host_pool
    )
    return (*services, pool)


def start_services(
    model,
    codec,
    name: str,
    pool: int,
    max_context: int,
    max_batch: int,
    timeout_s: float,
    host_pool: int | None = None,
):
    """An engine around ``model``, its gRPC worker, and a scheduler (in-memory store) in front."""
    from scheduler_svc.app import make_store, serve_scheduler
    from scheduler_svc.config import SchedulerConfig
    from worker_svc.app import start_worker
    from worker_svc.engine import Engine
    from worker_svc.types import EngineConfig

    config = EngineConfig(kv_pool_bytes=pool, max_context_tokens=max_context, max_batch_size=max_batch,
                          worker_id="capacity", host_pool_bytes=host_pool)  # fmt: skip
    engine = Engine(model, codec, config)
    worker = start_worker(engine, name, "127.0.0.1", 0)
    sched = SchedulerConfig(admission_timeout_s=timeout_s, queue_limit=256, idle_ttl_s=None)
    server = serve_scheduler([worker.address], make_store(None), sched)
    return engine, worker, server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--policies", default="full;confkv:int8=1", help="';'-separated policy specs")
    p.add_argument("--levels", default="1,2,3,4,6,8,10,12,13,14,16", help="session counts to try, ascending")
    p.add_argument(
        "--pool-caches", type=int, default=3, help="KV pool = this many full caches of --max-context"
    )
    p.add_argument("--max-context", type=int, default=1024, help="worker context limit (tokens)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--page-chars", type=int, default=1200)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--admission-timeout", type=float, default=600.0)
    p.add_argument(
        "--host-pool-bytes",
        default=None,
        help="the worker's host pool for recall=1 cold tiers (default: no limit)",
    )
    p.add_argument("--json", type=Path, default=Path("reports/capacity.json"))
    p.add_argument("--plot", type=Path, default=Path("reports/capacity.png"))
    args = p.parse_args(argv)
    import torch

    from worker_svc.app import parse_bytes

    host_pool = parse_bytes(args.host_pool_bytes) if args.host_pool_bytes is not None else None
    torch.set_num_threads(1)
    engine, worker, server, pool = start_stack(
        args.model, args.pool_caches, args.max_context, args.max_batch, args.admission_timeout, host_pool
    )
    recorder = StepRecorder(engine)
    conv = ConversationConfig(page_chars=args.page_chars, turns=args.turns)
    levels = [int(x) for x in args.levels.split(",")]
    report = {"model": args.model, "kv_pool_bytes": pool, "host_pool_bytes": host_pool,
              "max_context": args.max_context,
              "max_batch": args.max_batch, "turns": args.turns, "page_chars": args.page_chars,
              "max_new_tokens": args.max_new_tokens, "results": {}}  # fmt: skip
    try:
        for policy in args.policies.split(";"):
            rows = report["results"].setdefault(policy, [])
            for n in levels:
                row = run_level(server.address, recorder, policy, n, conv, args.max_new_tokens, seed=1000 * n)
                rows.append(row)
                print(json.dumps({k: row[k] for k in SHOWN}), flush=True)
                args.json.write_text(json.dumps(report, indent=1) + "\n")
                if not row["served_concurrently"]:
                    break  # the first level past capacity shows what happens there; stop
    finally:
        server.stop(1.0)
        worker.stop(1.0)
    report["capacity"] = {
        pol: max([r["sessions"] for r in rows if r["served_concurrently"]], default=0)
        for pol, rows in report["results"].items()
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from loadtest.capacity_plot import plot

        plot(report, args.plot)
    print(json.dumps(report["capacity"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
