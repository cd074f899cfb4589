"""``confkv generate``: one prompt through a policy's cache, optional per-step JSON trace."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from confkv.cli.common import UsageError, add_model_arg, check_output_path, temperature, token_count

# Budgets at or above this are "no limit" sentinels (``full``): written as null, not 4611686018427387904.
UNBOUNDED = 2**40


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a Conf-KV policy")
    add_model_arg(p)
    p.add_argument("--policy", default="confkv", help="policy spec, e.g. confkv:n_high=512,n_low=256")
    p.add_argument("--prompt", required=True, help="user message (sent through the chat template)")
    p.add_argument("--max-new-tokens", type=token_count, default=64, help="tokens to generate at most")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--temperature", type=temperature, default=0.0, help="sampling temperature, 0 = greedy")
    p.add_argument(
        "--trace",
        type=Path,
        help="write per-step confidence, budget (null = unbounded), tokens and bytes per layer",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from confkv.cache import ConfKVCache
    from confkv.decode import generate
    from confkv.models import load_model
    from confkv.policies import parse_policy

    if not args.prompt.strip():
        raise UsageError("empty prompt")
    policy = parse_policy(args.policy)
    check_output_path(args.trace, "--trace")
    model, tok = load_model(args.model)
    if args.raw or tok.chat_template is None:
        ids = tok(args.prompt, return_tensors="pt").input_ids
    else:
        msgs = [{"role": "user", "content": args.prompt}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
    cache = ConfKVCache.for_model(model, policy)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    start = time.perf_counter()

    def stream(token: int) -> None:
        sys.stdout.write(tok.decode([token], skip_special_tokens=True))
        sys.stdout.flush()

    with torch.inference_mode():
        result = generate(
            model,
            cache,
            ids,
            args.max_new_tokens,
            eos,
            args.temperature,
            on_token=stream,
            trace=bool(args.trace),
        )
    seconds = time.perf_counter() - start
    sys.stdout.write("\n")
    seq = cache.seqs[0]
    print(
        f"[{policy.spec()}] {len(result.tokens)} tokens in {seconds:.1f}s, prompt {ids.shape[1]} tokens, "
        f"peak KV {seq.stats.peak_bytes / 2**20:.2f} MiB{cold_line(seq)}, stop: {result.stop_reason}",
        file=sys.stderr,
    )
    if args.trace:
        args.trace.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "policy": policy.spec(),
                    "prompt_tokens": int(ids.shape[1]),
                    "peak_kv_bytes": seq.stats.peak_bytes,
                    **cold_fields(seq),
                    "seconds": seconds,
                    "text": tok.decode(result.tokens, skip_special_tokens=True),
                    "steps": [readable_step(step) for step in result.trace],
                },
                indent=1,
            )
        )
    return 0


def cold_fields(seq) -> dict:
    """The cold tier's figures for the trace header, as the evals name them ({} without
    ``recall=1``); no mean (every trace row has its step's cold bytes), the final cold bytes."""
    if seq.tier is None:
        return {}
    from confkv.eval.common import recall_fields  # torch-heavy: imported when a trace is written

    fields = recall_fields(seq, mean_cold_bytes=0.0)
    del fields["mean_cold_bytes"]
    return {**fields, "cold_bytes": int(seq.cold_nbytes())}


def cold_line(seq) -> str:
    """``, peak cold X MiB, recalled N tokens`` for the summary line ('' without ``recall=1``)."""
    if seq.tier is None:
        return ""
    stats = seq.stats
    return f", peak cold {stats.peak_cold_bytes / 2**20:.2f} MiB, recalled {stats.recalled_tokens} tokens"


def readable_step(step: dict) -> dict:
    """A trace step with sentinel budgets (``full`` keeps everything) written as null."""
    budget = step.get("budget")
    if isinstance(budget, int) and budget >= UNBOUNDED:
        return {**step, "budget": None}
    return step
