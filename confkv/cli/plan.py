"""``confkv plan``: KV bytes per session and the most concurrent sessions an accelerator holds."""

from __future__ import annotations

import json
from pathlib import Path

from confkv.cli.common import check_input_file, check_output_path, finite_float, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planning: KV bytes per session and max concurrent sessions",
        description="Worst case from the policy's byte bound, or the expected footprint from the "
        "high-budget share observed in a 'confkv generate --trace' file.",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="preset (smollm2-135m, llama-3-8b, mistral-7b, qwen2.5-7b, qwen2.5-32b) or an HF config.json",
    )
    p.add_argument("--params", type=finite_float(0.0), help="override the parameter count (e.g. 7.2e9)")
    p.add_argument(
        "--memory", default="h100-80gb", help="accelerator: h200, h100-80gb, a100-80gb, a100-40gb, l4, "
        "cpu (this machine's RAM), or a size like 80GB / 24GiB (a bare number is GB)"
    )  # fmt: skip
    p.add_argument(
        "--utilization", type=finite_float(0.0), default=0.9, help="share of memory for weights + KV"
    )
    p.add_argument("--weight-dtype", default="bf16", help="fp32, bf16/fp16, fp8/int8, int4")
    p.add_argument(
        "--kv-dtype", default="bf16", help="dtype of the FP part of the cache: fp32, bf16/fp16, fp8"
    )
    p.add_argument("--policy", help="policy spec (default: the trace's policy, else confkv:int8=1)")
    p.add_argument("--context", type=positive_int, default=4096, help="prompt/context tokens per session")
    p.add_argument("--generate", type=positive_int, default=512, help="generated tokens per session")
    p.add_argument("--trace", type=Path, help="a 'confkv generate --trace' JSON: use its high-budget share")
    p.add_argument("--json", type=Path, help="also write the plan as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    import dataclasses

    from confkv.plan import PlanRequest, TraceSummary, format_plan, make_plan, parse_memory, resolve_model
    from confkv.policies import parse_policy

    check_input_file(args.trace, "--trace")
    check_output_path(args.json, "--json")
    model = resolve_model(args.model)
    if args.params is not None:
        if args.params <= 0:
            raise ValueError(f"--params must be positive, got {args.params}")
        model = dataclasses.replace(model, n_params=int(args.params))
    trace = TraceSummary.load(args.trace) if args.trace else None
    spec = args.policy or (trace.policy if trace else "confkv:int8=1")
    request = PlanRequest(
        model=model,
        memory_bytes=parse_memory(args.memory),
        policy=parse_policy(spec),
        context_tokens=args.context,
        generated_tokens=args.generate,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        utilization=args.utilization,
        trace=trace,
    )
    plan = make_plan(request)
    print(format_plan(plan))
    if args.json:
        args.json.write_text(json.dumps(plan, indent=1) + "\n")
    return 0
