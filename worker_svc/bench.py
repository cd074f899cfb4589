"""Worker throughput: aggregate tokens/s of N sessions decoded together (continuous batching)
versus the same N sessions run one after another, same process, same run.

    python -m worker_svc.bench --model smollm2 --batches 1,4,8 --json reports/worker.json

Writes ``reports/worker.json`` and ``reports/worker.md``. Greedy decoding, so batched and
sequential runs must produce identical tokens (checked and reported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from confkv.data import sample_text
from worker_svc.engine import Engine
from worker_svc.types import ChatMessage, EngineConfig, TokenEvent, TurnDone, TurnRequest

CORPUS = sample_text("prideprejudice")  # shipped excerpt; --corpus FILE for another text
DEFAULT_POLICIES = "confkv:n_high=96,n_low=48,p=16;full"


def prompts(n: int, chars: int, corpus: Path) -> list[str]:
    """``n`` distinct passages (about ``chars`` characters each) to summarise."""
    text = (
        corpus.read_text(encoding="utf-8", errors="ignore") if corpus.is_file() else "It is a truth. " * 4000
    )
    step = max(chars, len(text) // (n + 1))
    return [f"Summarise in one line: {' '.join(text[i * step : i * step + chars].split())}" for i in range(n)]


def run_sessions(engine: Engine, policy: str, texts: list[str], max_new: int, together: bool, tag: str):
    """-> (tokens per session, seconds, peak bytes in use, largest batch)."""
    peak, batch = [0], [0]

    def on_step(stats) -> None:
        peak[0], batch[0] = max(peak[0], stats.used_bytes), max(batch[0], stats.batch_size)

    engine.on_step = on_step
    ids = [f"{tag}-{i}" for i in range(len(texts))]
    for sid in ids:
        engine.open_session(sid, policy, [])
    start = time.perf_counter()
    handles = []
    for sid, text in zip(ids, texts, strict=True):
        request = TurnRequest(sid, (ChatMessage("user", text),), max_new_tokens=max_new, ignore_eos=True)
        handles.append(engine.submit(request))
        if not together:
            engine.run_until_idle()
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    tokens = []
    for handle in handles:
        events = list(handle)
        assert isinstance(events[-1], TurnDone), events[-1]
        tokens.append([e.token_id for e in events if isinstance(e, TokenEvent)])
    for sid in ids:
        engine.drop(sid)
    return tokens, seconds, peak[0], batch[0]


def measure(engine: Engine, policy: str, batch: int, texts: list[str], max_new: int) -> dict:
    seq_tokens, seq_s, seq_peak, _ = run_sessions(engine, policy, texts[:batch], max_new, False, "seq")
    bat_tokens, bat_s, bat_peak, bat_max = run_sessions(engine, policy, texts[:batch], max_new, True, "bat")
    n = sum(len(t) for t in bat_tokens)
    row = {
        "policy": policy,
        "batch": batch,
        "generated_tokens": n,
        "sequential": {"seconds": seq_s, "tokens_per_s": n / seq_s, "peak_kv_bytes": seq_peak},
        "batched": {
            "seconds": bat_s,
            "tokens_per_s": n / bat_s,
            "peak_kv_bytes": bat_peak,
            "max_batch": bat_max,
        },
        "speedup": seq_s / bat_s,
        "identical_tokens": seq_tokens == bat_tokens,
    }
    batched, sequential = row["batched"]["tokens_per_s"], row["sequential"]["tokens_per_s"]
    line = f"{batched:.1f} tok/s batched vs {sequential:.1f} sequential (x{row['speedup']:.2f})"
    print(f"{policy:36s} batch {batch}: {line}", file=sys.stderr)
    return row


def markdown(report: dict) -> str:
    lines = [
        "# Worker throughput: continuous batching vs sequential",
        "",
        f"Model `{report['model']}`, {report['threads']} torch threads, "
        f"{report['max_new_tokens']} new tokens per session (greedy, EOS ignored as in "
        "throughput benchmarks), "
        "prompts of about "
        f"{report['prompt_tokens_mean']:.0f} tokens, prefill chunk "
        f"{report['prefill_chunk']}. Load average at start {report['loadavg_start']}. Command: "
        f"`{report['command']}`",
        "",
        "| policy | batch | tokens | sequential tok/s | batched tok/s | speedup | peak KV batched (MiB) "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| `{r['policy']}` | {r['batch']} | {r['generated_tokens']} | "
            f"{r['sequential']['tokens_per_s']:.1f} | "
            f"{r['batched']['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['batched']['peak_kv_bytes'] / 2**20:.2f} | {r['identical_tokens']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="';'-separated policy specs")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=300)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--json", type=Path, default=Path("reports/worker.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from confkv.models import load_model
    from worker_svc.codec import HFChatCodec

    model, tokenizer = load_model(args.model)
    codec = HFChatCodec(tokenizer)
    batches = [int(b) for b in args.batches.split(",")]
    texts = prompts(max(batches), args.prompt_chars, args.corpus)
    config = EngineConfig(
        kv_pool_bytes=1 << 34, max_batch_size=max(batches), prefill_chunk=args.prefill_chunk
    )
    engine = Engine(model, codec, config)
    run_sessions(engine, args.policies.split(";")[0], texts[:2], 4, True, "warmup")  # first forwards are slow
    loadavg = [round(x, 2) for x in os.getloadavg()]
    results = [
        measure(engine, p, b, texts, args.max_new_tokens) for p in args.policies.split(";") for b in batches
    ]
    report = {
        "model": args.model,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prefill_chunk": args.prefill_chunk,
        "prompt_tokens_mean": sum(len(codec.encode_chat([ChatMessage("user", t)])) for t in texts)
        / len(texts),
        "loadavg_start": loadavg,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "command": "python -m worker_svc.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    args.json.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
