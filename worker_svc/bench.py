"""Worker throughput, measured in one process on the same prompts.

    python -m worker_svc.bench --peer hf [--long] [--repeats 3]
        our engine (``full`` and ``confkv``) against transformers' ``generate`` (padded batch,
        sdpa) and ``generate_batch`` (continuous batching): decode-heavy batch 8, the batch 16/32
        curve, optionally long context (``--long``), and time to first token of a session that
        arrives while 8 others decode. Writes ``reports/worker.json`` and ``reports/worker.md``.
        The engine runs the model's linears through oneDNN (``confkv.linear``); ``--plain-linears``
        adds each engine policy again with PyTorch's ``F.linear``, the path transformers takes;
        ``--evict-per-sequence`` adds each evicting policy again with the members of a decode batch
        evicting one by one instead of together (``confkv.evict_rows``); ``--lockstep`` also runs
        the engine systems taking turns step by step (``bench_lockstep``), whose per-step ratios
        against engine ``full`` a noisy machine cannot skew.
    python -m worker_svc.bench --batches 1,4,8
        continuous batching vs the same sessions one after another (``reports/worker_batching.*``).

Greedy decoding with EOS ignored: batched and sequential runs must produce identical tokens
(checked and reported); against transformers the share of identical sequences is reported.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from confkv.data import sample_corpus, sample_text
from worker_svc import bench_lockstep, bench_peer
from worker_svc.engine import Engine
from worker_svc.types import ChatMessage, EngineConfig, TokenEvent, TurnDone, TurnRequest

CORPUS = sample_text("prideprejudice")  # shipped excerpt; --corpus FILE for another text
DEFAULT_POLICIES = "confkv:n_high=96,n_low=48,p=16;full"
DECODE_POLICIES = ("full", "confkv:n_high=96,n_low=84,p=16,slack=16")
# slack=0 (the default): once at its budget every member evicts at every layer of every step
EVERY_STEP = "confkv:n_high=96,n_low=84,p=16"
LONG_POLICIES = ("confkv:int8=1",)


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    prompt_chars: int
    max_new: int
    policies: tuple[str, ...]


WORKLOADS = {
    "decode": Workload("decode", 8, 200, 64, (*DECODE_POLICIES, EVERY_STEP)),
    "b16": Workload("b16", 16, 200, 64, DECODE_POLICIES),
    "b32": Workload("b32", 32, 200, 64, DECODE_POLICIES),
    "long": Workload("long", 4, 17_000, 128, LONG_POLICIES),
}


def prompts(n: int, chars: int, corpus: Path) -> list[str]:
    """``n`` distinct passages (about ``chars`` characters each) to summarise; the other shipped
    excerpts are appended when ``corpus`` is too short for ``n`` of them."""
    text = (
        corpus.read_text(encoding="utf-8", errors="ignore") if corpus.is_file() else "It is a truth. " * 4000
    )
    for extra in sorted(sample_corpus().glob("austen_*.txt")):
        if len(text) >= chars * (n + 1):
            break
        text += "\n" + extra.read_text(encoding="utf-8", errors="ignore")
    step = max(chars, len(text) // (n + 1))
    return [f"Summarise in one line: {' '.join(text[i * step : i * step + chars].split())}" for i in range(n)]


# -- continuous batching vs sequential (the engine against itself) -------------------------------------
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


def batching_markdown(report: dict) -> str:
    lines = [
        "# Worker throughput: continuous batching vs sequential",
        "",
        f"Model `{report['model']}`, {report['threads']} torch threads, {report['max_new_tokens']} new "
        "tokens per session (greedy, EOS ignored as in throughput benchmarks), prompts of about "
        f"{report['prompt_tokens_mean']:.0f} tokens, prefill chunk {report['prefill_chunk']}. Load average "
        f"at start {report['loadavg_start']}. Command: `{report['command']}`",
        "",
        "| policy | batch | tokens | sequential tok/s | batched tok/s | speedup | peak KV batched (MiB) "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| `{r['policy']}` | {r['batch']} | {r['generated_tokens']} | "
            f"{r['sequential']['tokens_per_s']:.1f} | {r['batched']['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | "
            f"{r['batched']['peak_kv_bytes'] / 2**20:.2f} | {r['identical_tokens']} |"
        )
    return "\n".join(lines) + "\n"


# -- against transformers ------------------------------------------------------------------------------
def _same(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def peer_workload(model, codec, wl: Workload, args, pad_id: int) -> dict:
    """Every system ``args.repeats`` times, interleaved (so slow phases of a shared machine hit all
    of them alike); medians of tokens/s, and ratios of medians."""
    texts = prompts(wl.batch, wl.prompt_chars, args.corpus)
    ids = [codec.encode_chat([ChatMessage("user", t)]) for t in texts]
    chunk = args.prefill_chunk
    config = EngineConfig(
        kv_pool_bytes=1 << 36, max_batch_size=wl.batch, prefill_chunk=chunk, max_context_tokens=8192
    )
    engine = Engine(model, codec, config)
    variants = []  # the same engine with one speed-up off, to measure what it adds
    if args.plain_linears:  # PyTorch's linears (what oneDNN adds)
        variants.append((" (F.linear)", Engine(model, codec, replace(config, onednn_linears=False)), False))
    if args.evict_per_sequence:  # each member evicts on its own (what batched eviction adds)
        per_seq = Engine(model, codec, replace(config, evict_by_rows=False))
        variants.append((" (per-sequence eviction)", per_seq, True))
    engines = []  # every engine policy, then its variants (evicting ones only where they ask)
    for policy in wl.policies:
        engines.append(bench_lockstep.System(f"engine {policy}", engine, policy))
        for suffix, other, evicting_only in variants:
            if not (evicting_only and policy == "full"):
                engines.append(bench_lockstep.System(f"engine {policy}{suffix}", other, policy))
    runs: dict[str, list[bench_peer.Run]] = {}
    for rep in range(args.repeats):
        systems = [("hf_generate", lambda: bench_peer.hf_padded_generate(model, ids, wl.max_new, pad_id))]
        if bench_peer.has_continuous_batching(model) and not args.no_cb:
            systems.append(
                (
                    "hf_generate_batch",
                    lambda: bench_peer.hf_continuous_batching(model, ids, wl.max_new, chunk),
                )
            )
        for i, system in enumerate(engines):
            systems.append((system.name, functools.partial(
                bench_peer.engine_run, system.engine, system.policy, texts, wl.max_new, f"e{i}r{rep}"
            )))  # fmt: skip
        for name, go in systems:
            run = go()
            runs.setdefault(name, []).append(run)
            print(
                f"{wl.name} rep {rep}: {name:48s} {run.tokens_per_s:7.2f} tok/s ({run.seconds:.1f} s)",
                file=sys.stderr,
            )
    reference = runs["hf_generate"][0].tokens
    systems_out: dict[str, dict[str, Any]] = {
        name: {
            "tokens_per_s_median": statistics.median(r.tokens_per_s for r in rs),
            "tokens_per_s_runs": [round(r.tokens_per_s, 3) for r in rs],
            "seconds_runs": [round(r.seconds, 3) for r in rs],
            "generated_tokens": rs[0].generated,
            "peak_kv_bytes": max(r.peak_kv_bytes for r in rs),
            "same_tokens_as_hf_generate": _same(rs[0].tokens, reference),
            # median of each run's median full-batch decode step (engine systems; prefill excluded)
            "step_ms_median": (
                statistics.median(1000 * statistics.median(r.full_batch_steps) for r in rs)
                if all(r.full_batch_steps for r in rs)
                else None
            ),
        }
        for name, rs in runs.items()
    }
    base = systems_out["hf_generate"]["tokens_per_s_median"]
    for out in systems_out.values():
        out["vs_hf_generate"] = out["tokens_per_s_median"] / base
    full = systems_out.get("engine full", {})
    for name, out in systems_out.items():  # engine policies against engine full, run for run
        if name.startswith("engine ") and full:
            out["vs_engine_full"] = out["tokens_per_s_median"] / full["tokens_per_s_median"]
            if out["step_ms_median"] and full["step_ms_median"]:
                out["step_vs_engine_full"] = full["step_ms_median"] / out["step_ms_median"]
    prompt_tokens = [len(i) for i in ids]
    out = {**asdict(wl), "prompt_tokens_mean": sum(prompt_tokens) / len(ids), "systems": systems_out}
    if args.lockstep:  # engine full is the reference; its variants are not measured against it
        engines = [e for e in engines if e.policy != "full" or e.engine is engine]
        out["lockstep"] = lockstep_systems(engines, texts, wl.max_new, args.repeats)
    return out


def lockstep_systems(systems, texts: list[str], max_new: int, repeats: int) -> dict[str, dict[str, Any]]:
    """``bench_lockstep``: the engine systems taking turns step by step, ``repeats`` times; per
    system the medians over repeats of its median step and of its per-step speed against
    engine ``full``. Systems that share an engine object get an engine each (its own sessions)."""
    seen: set[int] = set()
    own = []
    for system in systems:  # one Engine per thread: sessions and arenas never shared
        engine = system.engine
        if id(engine) in seen:
            engine = Engine(engine.model, engine.codec, engine.config)
        seen.add(id(engine))
        own.append(bench_lockstep.System(system.name, engine, system.policy))
    per_rep = []
    for rep in range(repeats):
        steps = bench_lockstep.lockstep(own, texts, max_new, f"ls{rep}")
        per_rep.append(bench_lockstep.ratios(steps, "engine full"))
        print(
            f"lockstep rep {rep}: "
            + ", ".join(f"{n} {r['speed_vs_reference']:.3f}x" for n, r in per_rep[-1].items()),
            file=sys.stderr,
        )
    return {
        name: {
            "step_ms_median": statistics.median(r[name]["step_ms_median"] for r in per_rep),
            "speed_vs_engine_full_median": statistics.median(r[name]["speed_vs_reference"] for r in per_rep),
            "speed_vs_engine_full_runs": [round(r[name]["speed_vs_reference"], 4) for r in per_rep],
            "steps_per_run": per_rep[0][name]["steps"],
        }
        for name in per_rep[0]
    }


def ttft_workload(model, codec, args) -> dict:
    """Sessions arriving one by one (about 400-token prompts) while 8 others decode."""
    background = prompts(8, 200, args.corpus)
    arriving = prompts(args.arrivals, 1600, sample_text("emma"))
    out = {}
    for policy, packed in itertools.product(DECODE_POLICIES, (False, True)):
        config = EngineConfig(
            kv_pool_bytes=1 << 36, max_batch_size=16, prefill_chunk=args.prefill_chunk, packed_prefill=packed
        )
        engine = Engine(model, codec, config)
        got = bench_peer.ttft_under_load(engine, policy, background, arriving, "ttft")
        key = f"{policy} ({'packed' if packed else 'chunk alone'})"
        q = statistics.quantiles(got.ttft_s, n=20, method="inclusive")
        steps = got.decode_step_s
        out[key] = {
            "packed_prefill": packed,
            "arrivals": len(got.ttft_s),
            "ttft_p50_s": statistics.median(got.ttft_s),
            "ttft_p95_s": q[18],
            "ttft_s": [round(x, 4) for x in got.ttft_s],
            "step_p50_s": statistics.median(steps),
            "step_max_s": max(steps),
            "arriving_prompt_tokens_mean": sum(
                len(codec.encode_chat([ChatMessage("user", t)])) for t in arriving
            )
            / len(arriving),
        }
        print(f"ttft {key}: p50 {out[key]['ttft_p50_s']:.3f} s p95 {out[key]['ttft_p95_s']:.3f} s",
              file=sys.stderr)  # fmt: skip
    return out


def peer_markdown(report: dict) -> str:
    lines = [
        "# Worker throughput against transformers (same prompts, same process)",
        "",
        f"Model `{report['model']}`, {report['threads']} torch threads, greedy, EOS ignored, prefill chunk "
        f"{report['prefill_chunk']}, transformers {report['transformers']}, torch {report['torch']}. "
        f"Medians of {report['repeats']} interleaved runs. Load average at start {report['loadavg_start']}, "
        f"at end {report['loadavg_end']}. Command: `{report['command']}`",
        "",
        "| workload | system | tok/s (median) | vs HF `generate` | vs engine `full` | decode step ms "
        "(median; vs `full`) | runs | same tokens as HF `generate` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for wl in report["workloads"]:
        label = (
            f"{wl['name']}: batch {wl['batch']}, ~{wl['prompt_tokens_mean']:.0f}-token prompts, "
            f"{wl['max_new']} new"
        )
        for name, s in wl["systems"].items():
            vs_full = f"{s['vs_engine_full']:.3f}x" if "vs_engine_full" in s else ""
            step = (
                f"{s['step_ms_median']:.1f}"
                + (f"; {s['step_vs_engine_full']:.3f}x" if "step_vs_engine_full" in s else "")
                if s.get("step_ms_median")
                else ""
            )
            lines.append(
                f"| {label} | `{name}` | {s['tokens_per_s_median']:.2f} | {s['vs_hf_generate']:.2f}x | "
                f"{vs_full} | {step} | {', '.join(f'{x:.1f}' for x in s['tokens_per_s_runs'])} | "
                f"{s['same_tokens_as_hf_generate']:.0%} |"
            )
    for wl in report["workloads"]:
        if wl.get("lockstep"):
            lines += [
                "",
                f"Engines in lockstep ({wl['name']}: each system in a thread of its own, one engine step per "
                "turn, round robin, so step k of every system ran within a few hundred ms of the others'; "
                "speed = median over k of engine `full`'s step k / the system's step k, median of the runs):",
                "",
                "| system | decode step ms (median) | speed vs engine `full` | runs |",
                "|---|---|---|---|",
            ]
            for name, r in wl["lockstep"].items():
                lines.append(
                    f"| `{name}` | {r['step_ms_median']:.1f} | {r['speed_vs_engine_full_median']:.3f}x | "
                    f"{', '.join(f'{x:.3f}' for x in r['speed_vs_engine_full_runs'])} |"
                )
    if report.get("ttft"):
        lines += [
            "",
            "Time to first token of a session arriving while 8 others decode (one arrival at a time):",
            "",
            "| policy (prefill) | arrivals | prompt tokens | TTFT p50 (s) | TTFT p95 (s) "
            "| step p50 / max during arrivals (s) |",
            "|---|---|---|---|---|---|",
        ]
        for policy, t in report["ttft"].items():
            lines.append(
                f"| `{policy}` | {t['arrivals']} | {t['arriving_prompt_tokens_mean']:.0f} | "
                f"{t['ttft_p50_s']:.3f} | {t['ttft_p95_s']:.3f} | "
                f"{t['step_p50_s']:.3f} / {t['step_max_s']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--peer", choices=["hf"], help="compare with transformers instead of sequential runs")
    parser.add_argument(
        "--workloads", default="decode,b16,b32,ttft", help="with --peer: decode,b16,b32,long,ttft"
    )
    parser.add_argument(
        "--long", action="store_true", help="with --peer: add the long-context workload (slow)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=10)
    parser.add_argument("--no-cb", action="store_true", help="skip transformers' generate_batch")
    parser.add_argument(
        "--plain-linears",
        action="store_true",
        help="with --peer: each engine policy again with PyTorch's F.linear (onednn_linears off)",
    )
    parser.add_argument(
        "--evict-per-sequence",
        action="store_true",
        help="with --peer: each evicting engine policy again with per-sequence eviction (evict_by_rows off)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="with --peer: also run the engine systems in lockstep (bench_lockstep: step-time ratios)",
    )
    parser.add_argument(
        "--policies", default=DEFAULT_POLICIES, help="';'-separated policy specs (sequential mode)"
    )
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=300)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument(
        "--json", type=Path, help="default reports/worker.json (--peer) or reports/worker_batching.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from confkv.models import load_model
    from worker_svc.codec import HFChatCodec

    model, tokenizer = load_model(args.model)
    codec = HFChatCodec(tokenizer)
    common = {
        "model": args.model,
        "threads": args.threads,
        "prefill_chunk": args.prefill_chunk,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "command": "python -m worker_svc.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    warm = Engine(model, codec, EngineConfig(kv_pool_bytes=1 << 34, prefill_chunk=args.prefill_chunk))
    run_sessions(warm, "full", prompts(2, 200, args.corpus), 4, True, "warmup")  # first forwards are slow
    if args.peer:
        import transformers

        names = [w for w in args.workloads.split(",") if w] + (["long"] if args.long else [])
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        bench_peer.hf_padded_generate(model, [[1, 2, 3]], 2, pad_id)  # warm transformers' path too
        report = {
            **common,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "repeats": args.repeats,
            "workloads": [
                peer_workload(model, codec, WORKLOADS[n], args, pad_id) for n in names if n in WORKLOADS
            ],
            "ttft": ttft_workload(model, codec, args) if "ttft" in names else {},
        }
        path, text = args.json or Path("reports/worker.json"), peer_markdown
    else:
        batches = [int(b) for b in args.batches.split(",")]
        texts = prompts(max(batches), args.prompt_chars, args.corpus)
        config = EngineConfig(
            kv_pool_bytes=1 << 34, max_batch_size=max(batches), prefill_chunk=args.prefill_chunk
        )
        engine = Engine(model, codec, config)
        results = [
            measure(engine, p, b, texts, args.max_new_tokens)
            for p in args.policies.split(";")
            for b in batches
        ]
        tokens = [len(codec.encode_chat([ChatMessage("user", t)])) for t in texts]
        mean = sum(tokens) / len(tokens)
        report = {
            **common,
            "max_new_tokens": args.max_new_tokens,
            "prompt_tokens_mean": mean,
            "results": results,
        }
        path, text = args.json or Path("reports/worker_batching.json"), batching_markdown
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(text(report))
    print(text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
