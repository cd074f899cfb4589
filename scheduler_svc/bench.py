"""Benchmark: latency a token gains by going through the scheduler instead of straight to the
worker. Writes ``reports/scheduler.json`` and ``reports/scheduler.md``.

One worker process (``confkv worker``); in this process, a scheduler (in-memory store) and two
clients. Same run, alternating turn by turn with the same prompts (greedy):
- direct: client -> worker (the scheduler's own gRPC worker client, used stand-alone);
- via scheduler: client -> scheduler -> worker.
Measured: (1) the scheduler hop per token, exactly: the time from the scheduler receiving a
token from the worker to the client receiving it (same clock); (2) per-token inter-arrival gaps
and time to first token on both paths.

    python -m scheduler_svc.bench --model smollm2 --turns 6 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = (
    "Write one sentence about the sea.",
    "Name three colours and one fruit.",
    "What is the capital of Italy? Explain briefly.",
    "Give a short tip for writing clear code.",
    "Describe a cat in one sentence.",
    "What does a compiler do?",
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary_ms(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.mean(ms),
    }


class Recorder:
    """Wraps a WorkerClient: stamps each token as the scheduler receives it from the worker."""

    def __init__(self, inner) -> None:
        self.inner, self.address = inner, inner.address
        self.stamps: dict[tuple[str, int], float] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def turn(self, session_id, message, *rest):
        for event in self.inner.turn(session_id, message, *rest):
            if hasattr(event, "index") and hasattr(event, "token_id"):
                self.stamps[(session_id, event.index)] = time.perf_counter()
            yield event


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(model: str, port: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "confkv_serve", "worker", "--model", model, "--port", str(port)]
    args += ["--kv-pool-bytes", "1GiB", "--log-format", "text"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited: {log.read_text()[-2000:]}")
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                return proc
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError("worker did not start")


def run(model: str, turns: int, tokens: int, policy: str, log: Path) -> dict:
    from scheduler_svc.client import SchedulerClient
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core import Scheduler
    from scheduler_svc.domain import Message, Sampling, TokenEvent
    from scheduler_svc.grpc_worker import GrpcWorkerClient
    from scheduler_svc.server import start_scheduler
    from scheduler_svc.store import MemoryStore

    port = free_port()
    worker = start_worker(model, port, log)
    address = f"127.0.0.1:{port}"
    recorder = Recorder(GrpcWorkerClient(address))
    server = start_scheduler(
        Scheduler(MemoryStore(), [recorder], SchedulerConfig(default_max_new_tokens=tokens))
    )
    client, direct = SchedulerClient(server.address), GrpcWorkerClient(address)
    hop: list[float] = []
    gaps: dict[str, list[float]] = {"direct": [], "scheduler": []}
    ttft: dict[str, list[float]] = {"direct": [], "scheduler": []}
    try:
        for r in range(turns + 1):  # round 0 warms both paths up and is not counted
            prompt = PROMPTS[r % len(PROMPTS)]
            sid = f"bench-direct-{r}"
            direct.open(sid, policy, [])
            t0, times = time.perf_counter(), []
            for event in direct.turn(sid, Message("user", prompt), Sampling(tokens)):
                if isinstance(event, TokenEvent):
                    times.append(time.perf_counter())
            direct.drop(sid)
            sched_sid = client.create_session(policy).session_id
            s0, stimes = time.perf_counter(), []
            for event in client.chat(sched_sid, prompt, tokens):
                if event.HasField("token"):
                    now = time.perf_counter()
                    stimes.append(now)
                    if r:
                        hop.append(now - recorder.stamps[(sched_sid, event.token.index)])
            client.end_session(sched_sid)
            if r:
                for name, start, ts in (("direct", t0, times), ("scheduler", s0, stimes)):
                    ttft[name].append(ts[0] - start)
                    gaps[name] += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    finally:
        client.close()
        direct.close()
        server.stop(1.0)
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    return {
        "scheduler_hop_per_token": summary_ms(hop),
        "inter_token_gap": {k: summary_ms(v) for k, v in gaps.items()},
        "time_to_first_token": {k: summary_ms(v) for k, v in ttft.items()},
    }


def markdown(report: dict) -> str:
    res = report["results"]
    hop, gap, ttft = res["scheduler_hop_per_token"], res["inter_token_gap"], res["time_to_first_token"]
    lines = [
        "# Scheduler overhead per token",
        "",
        f"Model `{report['model']}`, policy `{report['policy']}`, {report['turns']} turns x up to "
        f"{report['tokens']} tokens per path, greedy, loopback; worker in its own process. Command: "
        f"`{report['command']}`",
        "",
        "| measure | n | p50 ms | p99 ms | mean ms |",
        "|---|---|---|---|---|",
        f"| added by the scheduler hop (worker->scheduler->client, per token) | {hop['n']} | "
        f"{hop['p50_ms']:.3f} | {hop['p99_ms']:.3f} | {hop['mean_ms']:.3f} |",
    ]
    for name in ("direct", "scheduler"):
        g, t = gap[name], ttft[name]
        lines.append(f"| inter-token gap, {name} | {g['n']} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} | ")
        lines[-1] += f"{g['mean_ms']:.2f} |"
        lines.append(f"| time to first token, {name} | {t['n']} | {t['p50_ms']:.1f} | {t['p99_ms']:.1f} | ")
        lines[-1] += f"{t['mean_ms']:.1f} |"
    verdict = "met" if hop["p50_ms"] < 2.0 else "NOT met"
    lines += ["", f"Target p50 added latency per token < 2 ms: **{verdict}** ({hop['p50_ms']:.3f} ms)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--policy", default="confkv:int8=1")
    parser.add_argument("--out", type=Path, default=Path("reports/scheduler"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = run(args.model, args.turns, args.tokens, args.policy, args.out.with_suffix(".worker.log"))
    report = {
        "model": args.model,
        "policy": args.policy,
        "turns": args.turns,
        "tokens": args.tokens,
        "command": "python -m scheduler_svc.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "results": results,
    }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    args.out.with_suffix(".worker.log").unlink(missing_ok=True)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
