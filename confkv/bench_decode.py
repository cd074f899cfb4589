"""Decode speed on SmolLM2: ``full`` vs ``confkv`` at several contexts, side by side in one run.

    python -m confkv.bench_decode --contexts 512,2048,8192 --steps 24 --repeats 3

Writes reports/decode_speed.json and reports/decode_speed.md. Each repeat runs every policy's
``steps`` decode steps in turn (interleaved, so machine noise hits all alike); tokens/s is the
median over repeats (and ``tokens_per_s_total``: all timed steps over their summed time, so a
repeat slowed by many recall steps weighs in full). ``--block K`` interleaves finer: the
policies take turns K steps at a time within a repeat (``--block 1``: step by step, so a slow
phase of a shared machine lasting a few seconds hits every policy alike). ``hf-sdpa`` is the
unmodified model with HF's DynamicCache and SDPA.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from confkv.cache import ConfKVCache
from confkv.data import sample_text
from confkv.decode import decode_one_token, prefill, sample
from confkv.models import load_model

CORPUS = sample_text("emma")  # shipped excerpt (about 11K tokens); --text-file for longer contexts


class _HFRunner:
    """The model's own path: DynamicCache + SDPA (what users run without Conf-KV)."""

    def __init__(self, model, ids):
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache(config=model.config)
        impl = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            for start in range(0, ids.shape[1], 256):
                out = model(ids[:, start : start + 256], past_key_values=self.cache, use_cache=True)
        model.set_attn_implementation(impl)
        self.logits = out.logits[:, -1]

    def steps(self, n):
        impl = self.model.config._attn_implementation
        self.model.set_attn_implementation("sdpa")
        with torch.no_grad():
            for _ in range(n):
                out = self.model(sample(self.logits).view(1, 1), past_key_values=self.cache, use_cache=True)
                self.logits = out.logits[:, -1]
        self.model.set_attn_implementation(impl)


class _ConfKVRunner:
    def __init__(self, model, ids, spec):
        self.model, self.cache = model, ConfKVCache.for_model(model, spec)
        self.logits = prefill(model, self.cache, ids)

    def steps(self, n):
        for _ in range(n):
            self.logits = decode_one_token(self.model, self.cache, sample(self.logits))


def run(contexts, specs, steps, repeats, text_file, block: int = 0) -> dict:
    model, tok = load_model("smollm2")
    text = Path(text_file).read_text(encoding="utf-8")
    all_ids = tok(text[: 12 * max(contexts)], return_tensors="pt").input_ids
    results = {}
    for ctx in contexts:
        ids = all_ids[:, :ctx]
        runners = {"hf-sdpa": _HFRunner(model, ids)}
        runners.update({spec: _ConfKVRunner(model, ids, spec) for spec in specs})
        times: dict[str, list[float]] = {name: [] for name in runners}
        for r in runners.values():  # warm-up step, not timed
            r.steps(1)
        block = block if 0 < block < steps else steps
        for _ in range(repeats):
            spent = dict.fromkeys(runners, 0.0)
            for done in range(0, steps, block):  # the policies take turns, ``block`` steps each
                n = min(block, steps - done)
                for name, r in runners.items():
                    start = time.perf_counter()
                    r.steps(n)
                    spent[name] += time.perf_counter() - start
            for name in runners:
                times[name].append(steps / spent[name])
        row: dict[str, dict] = {
            name: {
                "tokens_per_s": statistics.median(v),
                # every timed step of every repeat over their summed time (a slow repeat counts)
                "tokens_per_s_total": statistics.harmonic_mean(v),
                "runs": v,
            }
            for name, v in times.items()
        }
        for name, r in runners.items():
            if isinstance(r, _ConfKVRunner):
                row[name]["kv_bytes"] = r.cache.nbytes()
                row[name]["peak_kv_bytes"] = r.cache.peak_bytes
                row[name]["cold_bytes"] = r.cache.seqs[0].cold_nbytes()
                row[name]["cold_reserved_bytes"] = r.cache.seqs[0].cold_reserved_bytes()
                row[name]["recalled_tokens"] = r.cache.seqs[0].stats.recalled_tokens
        results[str(ctx)] = row
        print(ctx, {k: round(v["tokens_per_s"], 2) for k, v in row.items()}, flush=True)
    return results


def write_reports(results, specs, out: Path, argv, name: str = "decode_speed") -> None:
    base = specs[0]  # the ratios are to the first policy named (full by default)
    lines = [
        f"| context | policy | tokens/s (median) | vs {base} | vs hf-sdpa | whole run tok/s | vs {base}"
        " | KV MiB | cold MiB | cold host MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ctx, row in results.items():
        for policy, v in row.items():
            kv = f"{v['kv_bytes'] / 2**20:.1f}" if "kv_bytes" in v else "-"
            cold = f"{v['cold_bytes'] / 2**20:.1f}" if "cold_bytes" in v else "-"
            host = f"{v['cold_reserved_bytes'] / 2**20:.1f}" if "cold_reserved_bytes" in v else "-"
            ratio = v["tokens_per_s"] / row[base]["tokens_per_s"] if base in row else float("nan")
            ratio_hf = v["tokens_per_s"] / row["hf-sdpa"]["tokens_per_s"]
            total = v["tokens_per_s_total"]
            ratio_total = total / row[base]["tokens_per_s_total"] if base in row else float("nan")
            lines.append(
                f"| {ctx} | {policy} | {v['tokens_per_s']:.2f} | {ratio:.2f}x | {ratio_hf:.2f}x"
                f" | {total:.2f} | {ratio_total:.2f}x | {kv} | {cold} | {host} |"
            )
    meta = {
        "command": "python -m confkv.bench_decode " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, CPU",
        "model": "smollm2 (SmolLM2-135M-Instruct, fp32)",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**meta, "policies": specs, "results": results}, indent=1))
    md = [f"# Decode speed ({meta['date']})", "", f"`{meta['command']}` on {meta['machine']}.", ""]
    (out / f"{name}.md").write_text("\n".join(md + lines) + "\n")


def main(argv=None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument(
        "--policies", default="full;confkv:n_high=1024,n_low=512;confkv:n_high=1024,n_low=512,int8=1"
    )
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block", type=int, default=0, help="steps per turn within a repeat (0: all of them)")
    p.add_argument("--text-file", default=str(CORPUS))
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.add_argument("--name", default="decode_speed", help="report file stem under --out")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    specs = [s for s in args.policies.split(";") if s]
    if args.block < 0:
        p.error("--block must be >= 0")
    results = run(contexts, specs, args.steps, args.repeats, args.text_file, args.block)
    write_reports(results, specs, args.out, argv, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
