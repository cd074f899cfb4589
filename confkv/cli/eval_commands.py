"""The ``run`` functions of ``confkv eval ...`` (argument wiring only; the evals live in confkv.eval).

Order in every command: validate, load, evaluate, write ``--json OUT`` and ``OUT.md``, *then* plot.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from confkv.cli.common import UsageError, check_input_file, check_output_path, command_line

# Every file an eval may write, by flag (checked before the model loads: a typo in a folder name must
# not cost a whole evaluation).
OUTPUT_FLAGS = ("json", "plot", "trace_plot", "save_items")


def check_outputs(args) -> None:
    for name in OUTPUT_FLAGS:
        check_output_path(getattr(args, name, None), "--" + name.replace("_", "-"))
    if args.json.suffix == ".md":
        raise UsageError("--json must not end in .md (the markdown table is written next to it)")
    if getattr(args, "plot", None) is None and "plot" in vars(args):
        check_output_path(args.json.with_suffix(".png"), "--json (its plot)")


def _setup(args):
    """Validate shared args, set threads, load the model. Returns (model, tokenizer)."""
    import torch

    from confkv.eval.common import match_reference
    from confkv.models import load_model

    check_outputs(args)
    if getattr(args, "match_bytes", None):
        match_reference(args.match_bytes)
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model)


def _check_file(path: Path, what: str) -> None:
    """Inputs first, then every output path: all before the model loads."""
    check_input_file(path, what)


def _payload(args, tokens, results: dict, **extra) -> dict:
    return {"model": args.model, "tokens": tokens, **extra, "results": results}


def _finish(
    args, payload: dict, title: str, table: str, notes: str = "", plots: Sequence[Callable[[], object]] = ()
) -> int:
    """Write the JSON and markdown results, then draw ``plots`` (which may fail without losing them)."""
    from confkv.eval.report import header, write_report

    md = header(title, command_line(), payload) + table + ("\n" + notes if notes else "")
    out, md_path = write_report(args.json, payload, md)
    print(table)
    print(f"wrote {out} and {md_path}")
    for plot in plots:
        plot()
    return 0


def run_ppl(args) -> int:
    from confkv.eval.common import load_text_tokens
    from confkv.eval.plots import frontier_plot
    from confkv.eval.ppl import PplConfig, run_ppl
    from confkv.eval.report import markdown_table, result_rows

    _check_file(args.text_file, "--text-file")
    config = PplConfig(tuple(args.policies), args.match_bytes)
    model, tok = _setup(args)
    ids = load_text_tokens(tok, args.text_file, args.tokens, args.offset_chars)
    meta = {
        "text_file": str(args.text_file),
        "offset_chars": args.offset_chars,
        "match_bytes": args.match_bytes,
    }

    def checkpoint(partial: dict) -> None:
        scored = next(iter(partial.values()))["scored_tokens"]
        body = _payload(args, scored + 1, partial, **meta, partial_of=int(ids.shape[0]))
        args.json.with_suffix(".partial.json").write_text(json.dumps(body, indent=1) + "\n")

    results = run_ppl(model, ids, config, not args.no_progress, None, checkpoint, args.checkpoint_every)
    payload = _payload(args, int(ids.shape[0]), results, **meta)
    ref = "full" if "full" in results else None
    table = markdown_table(
        result_rows(results, "ppl", ref),
        [
            "policy",
            "resolved",
            "ppl",
            "peak KV MiB",
            "mean KV MiB",
            f"x less than {ref}" if ref else "policy",
        ],
    )
    plot = lambda: frontier_plot(results, args.plot or args.json.with_suffix(".png"))
    return _finish(args, payload, "Perplexity with per-step eviction", table, plots=[plot])


def run_ablation(args) -> int:
    from confkv.eval.ablation import run_ablation
    from confkv.eval.common import load_text_tokens
    from confkv.eval.report import markdown_table, result_rows

    _check_file(args.text_file, "--text-file")
    from confkv.policies import parse_policy

    if parse_policy(args.policy).name != "confkv":
        raise UsageError(f"--policy must be a confkv spec, got {args.policy!r}")
    model, tok = _setup(args)
    ids = load_text_tokens(tok, args.text_file, args.tokens, args.offset_chars)
    results, order = run_ablation(model, ids, args.policy, args.match_bytes, progress=not args.no_progress)
    payload = _payload(args, int(ids.shape[0]), results, text_file=str(args.text_file), ordering=order)
    table = markdown_table(
        result_rows(results, "ppl"), ["policy", "resolved", "ppl", "peak KV MiB", "mean KV MiB"]
    )
    note = f"ordering (worst to best): {' > '.join(order['by_ppl'])}; expected: {order['expected']}, "
    note += f"met: {order['met']}\n"
    return _finish(args, payload, "Matched-rate ablation (identical eviction schedule)", table, note)


def run_klshift(args) -> int:
    from confkv.eval.common import load_text_tokens
    from confkv.eval.klshift import KLShiftConfig, run_klshift
    from confkv.eval.plots import scatter_plot
    from confkv.eval.report import markdown_table

    _check_file(args.text_file, "--text-file")
    config = KLShiftConfig(args.recent, args.every, args.bootstrap)
    model, tok = _setup(args)
    ids = load_text_tokens(tok, args.text_file, args.tokens, args.offset_chars)
    if ids.shape[0] <= args.recent + 2:
        raise UsageError(f"--tokens must exceed --recent + 2 ({args.recent + 2}) to sample any step")
    summary, samples = run_klshift(model, ids, config, progress=not args.no_progress)
    payload = _payload(args, int(ids.shape[0]), {f"window:n={args.recent}": summary}, samples=samples)
    rows = [{k: v for k, v in summary.items() if not isinstance(v, list)}]
    for name in ("pearson", "spearman"):
        lo, hi = summary[f"{name}_ci95"]
        rows[0][f"{name} CI95"] = f"[{lo:.3f}, {hi:.3f}]"
    table = markdown_table(rows, list(rows[0]))
    plot = lambda: scatter_plot(
        samples["confidence"],
        samples["kl"],
        args.plot or args.json.with_suffix(".png"),
        "confidence of the full-cache model",
        f"KL(p_full || p_recent{args.recent})",
        f"KL shift vs confidence (pearson r={summary['pearson_r']:.2f})",
    )
    return _finish(args, payload, "KL shift vs confidence", table, plots=[plot])


def run_memory(args) -> int:
    from confkv.eval.common import load_text_tokens
    from confkv.eval.memory import run_memory
    from confkv.eval.report import markdown_table, result_rows

    _check_file(args.text_file, "--text-file")
    model, tok = _setup(args)
    ids = load_text_tokens(tok, args.text_file, args.tokens, args.offset_chars)
    results = run_memory(model, ids, args.policies, args.new_tokens, args.match_bytes, not args.no_progress)
    payload = _payload(args, int(ids.shape[0]) + args.new_tokens, results, prompt_tokens=int(ids.shape[0]))
    ref = "full" if "full" in results else None
    cols = ["policy", "resolved", "peak KV MiB", "mean KV MiB"] + ([f"x less than {ref}"] if ref else [])
    return _finish(
        args,
        payload,
        "KV memory over a long generation",
        markdown_table(result_rows(results, "ppl", ref), cols),
    )


def _run_items(args, model, tok, items, title: str, extra: dict) -> int:
    from confkv.eval.recall import RecallConfig, run_recall
    from confkv.eval.report import markdown_table, result_rows

    if args.limit:
        items = items[: args.limit]
    config = RecallConfig(tuple(args.policies), args.match_bytes, args.max_new_tokens, args.chunk_size)
    results, per_item = run_recall(model, tok, items, config, progress=not args.no_progress)
    tokens = max((r["prompt_tokens"] for r in per_item), default=0)
    payload = _payload(args, tokens, results, items=per_item, **extra)
    ref = "full" if "full" in results else None
    cols = ["policy", "resolved", "accuracy", "peak KV MiB", "mean KV MiB"]
    table = markdown_table(result_rows(results, "accuracy", ref), cols)
    plots = []
    if args.trace_plot:
        from confkv.eval.recall import trace_item

        plots.append(lambda: trace_item(model, tok, items[0], config, args.trace_plot))
    return _finish(args, payload, title, table, plots=plots)


def run_recall(args) -> int:
    from confkv.eval.recall import load_items

    _check_file(args.data, "--data")
    items = load_items(args.data)
    model, tok = _setup(args)
    return _run_items(args, model, tok, items, "Recall accuracy", {"data": str(args.data)})


def run_niah(args) -> int:
    from confkv.eval.niah import NiahConfig, make_items, parse_floats, parse_ints, save_items

    _check_file(args.haystack, "--haystack")
    config = NiahConfig(parse_ints(args.lengths), parse_floats(args.depths), args.seed)
    model, tok = _setup(args)
    items = make_items(tok, args.haystack.read_text(encoding="utf-8", errors="replace"), config)
    if args.save_items:
        save_items(items, args.save_items)
    return _run_items(
        args, model, tok, items, "Needle in a haystack (passkey)", {"haystack": str(args.haystack)}
    )
