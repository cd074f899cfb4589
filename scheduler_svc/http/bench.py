"""Benchmark: what the OpenAI-compatible HTTP front door adds to a token, against gRPC, through
the same scheduler in one run. Writes ``reports/openai_http.json`` and ``reports/openai_http.md``.

One ``confkv serve --port P --http-port Q`` process (scheduler + worker, both fronts); in this
process three clients take turns round by round with the same prompt (greedy, a new session
each, so every path does the same work): the gRPC ``SchedulerClient``, the official ``openai``
client (streamed), and a bare SSE reader (``http.client``, no client library). Measured per
path: time per token (the turn's tokens after the first, over their count; median of runs) and
time to first token (median). Target: HTTP adds < 5% to the per-token time.

    python -m scheduler_svc.http.bench --model smollm2 --runs 8 --tokens 32
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROMPTS = (
    "Write one sentence about the sea.",
    "Name three colours and one fruit.",
    "What is the capital of Italy? Explain briefly.",
    "Give a short tip for writing clear code.",
    "Describe a cat in one sentence.",
    "What does a compiler do?",
)
PATHS = ("grpc", "openai_http", "bare_sse")
Run = Callable[[str], list[float]]  # prompt -> token arrival times (perf_counter), start first


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(model: str, policy: str, tokens: int, log: Path) -> tuple[subprocess.Popen, int, int]:
    grpc_port, http_port = free_port(), free_port()
    args = [sys.executable, "-m", "confkv_serve", "serve", "--model", model, "--port", str(grpc_port)]
    args += ["--http-port", str(http_port), "--default-policy", policy, "--max-new-tokens", str(tokens)]
    env = {k: v for k, v in os.environ.items() if k not in ("CONFKV_AUTH_TOKEN",)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"confkv serve exited: {log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, grpc_port, http_port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("confkv serve did not become healthy")


def grpc_path(port: int, tokens: int) -> Run:
    from scheduler_svc.client import SchedulerClient

    client = SchedulerClient(f"127.0.0.1:{port}")

    def run(prompt: str) -> list[float]:
        sid = client.create_session("").session_id
        times = [time.perf_counter()]
        for event in client.chat(sid, prompt, tokens):
            if event.HasField("token") and event.token.text:
                times.append(time.perf_counter())
        client.end_session(sid)
        return times

    return run


def openai_path(port: int, tokens: int, model: str) -> Run:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    def run(prompt: str) -> list[float]:
        times = [time.perf_counter()]
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
            stream=True,
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
        return times

    return run


def sse_path(port: int, tokens: int, model: str) -> Run:
    def run(prompt: str) -> list[float]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        times = [time.perf_counter()]
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        for line in response:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                times.append(time.perf_counter())
        conn.close()
        return times

    return run


def measure(runs: dict[str, Run], rounds: int) -> dict:
    per_token: dict[str, list[float]] = {p: [] for p in runs}
    ttft: dict[str, list[float]] = {p: [] for p in runs}
    tokens: dict[str, list[int]] = {p: [] for p in runs}
    for r in range(rounds + 1):  # round 0 warms every path up and is not counted
        prompt = PROMPTS[r % len(PROMPTS)]
        order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]  # rotate who goes first
        for name in order:
            times = runs[name](prompt)
            if r == 0 or len(times) < 3:
                continue
            ttft[name].append(times[1] - times[0])
            per_token[name].append((times[-1] - times[1]) / (len(times) - 2))
            tokens[name].append(len(times) - 1)
    return {
        name: {
            "runs": len(per_token[name]),
            "ms_per_token_median": 1000 * statistics.median(per_token[name]),
            "ttft_ms_median": 1000 * statistics.median(ttft[name]),
            "tokens_per_s_median": 1 / statistics.median(per_token[name]),
            "tokens_mean": statistics.mean(tokens[name]),
        }
        for name in runs
    }


def markdown(report: dict) -> str:
    res = report["results"]
    base = res["grpc"]["ms_per_token_median"]
    load = report["machine"].get("load_average_1m", ["?", "?"])
    lines = [
        "# OpenAI-compatible HTTP vs gRPC, same scheduler, one run",
        "",
        f"Model `{report['model']}`, policy `{report['policy']}`, {report['runs']} runs per path of up to "
        f"{report['tokens']} tokens, greedy, a new session per run, loopback; scheduler + worker in one "
        f"`confkv serve` process, clients in another. Machine: {report['machine']['platform']}, "
        f"{report['machine']['cpus']} CPUs, 1-minute load average {load[0]} before and {load[1]} after "
        "(other work on the machine inflates every path's time; compare paths within one run). "
        f"Command: `{report['command']}`",
        "",
        "| path | runs | ms per token (median) | vs gRPC | tokens/s | TTFT ms (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name in PATHS:
        r = res[name]
        delta = 100 * (r["ms_per_token_median"] / base - 1)
        lines.append(
            f"| {name} | {r['runs']} | {r['ms_per_token_median']:.2f} | {delta:+.1f}% | "
            f"{r['tokens_per_s_median']:.1f} | {r['ttft_ms_median']:.1f} |"
        )
    added = 100 * (res["openai_http"]["ms_per_token_median"] / base - 1)
    verdict = "met" if added < 5 else "NOT met"
    lines += ["", f"Target: the openai client over HTTP adds < 5% per token: **{verdict}** ({added:+.1f}%)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--policy", default="confkv:int8=1")
    parser.add_argument("--out", type=Path, default=Path("reports/openai_http"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".serve.log")
    load_before = os.getloadavg()[0]
    proc, grpc_port, http_port = start_serve(args.model, args.policy, args.tokens, log)
    try:
        runs = {
            "grpc": grpc_path(grpc_port, args.tokens),
            "openai_http": openai_path(http_port, args.tokens, args.model),
            "bare_sse": sse_path(http_port, args.tokens, args.model),
        }
        results = measure(runs, args.runs)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report = {
        "model": args.model,
        "policy": args.policy,
        "runs": args.runs,
        "tokens": args.tokens,
        "command": "python -m scheduler_svc.http.bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
        },
        "results": results,
    }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    log.unlink(missing_ok=True)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
