"""``confkv eval ppl|recall|niah|ablation|klshift|memory``: every eval writes --json OUT plus OUT.md.

Inputs are validated before the model loads (bad specs, missing files -> exit 2), and so is the
``eval`` extra for the subcommands that draw plots (matplotlib) or compute statistics (scipy):
results are written before any plot, so nothing measured is lost to a missing plotting library.
This module only wires arguments; the ``run`` functions live in ``confkv.cli.eval_commands``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from confkv.cli import eval_commands
from confkv.cli.common import add_model_arg, policy_list, positive_int

DEFAULT_PPL_POLICIES = (
    "full,window:n=512,sinks:s=4,n=512,sinks:s=4,n=512,int8=1,h2o:n=512,h2o:n=512,int8=1,"
    "confkv,confkv:int8=1,confkv:pyramid=1"
)


def policies_arg(text: str) -> list[str]:
    """argparse type: comma-separated policy specs, with the parser's own message on error."""
    try:
        return policy_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _common(p, json_required: bool = True) -> None:
    add_model_arg(p)
    p.add_argument("--json", type=Path, required=json_required, help="write results here (+ .md next to it)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--threads", type=positive_int, default=0, help="torch CPU threads (0: torch default)")


def _text_args(p, tokens: int) -> None:
    p.add_argument("--text-file", type=Path, required=True, help="UTF-8 text to score")
    p.add_argument("--tokens", type=positive_int, default=tokens, help="tokens of the text to use")
    p.add_argument("--offset-chars", type=positive_int, default=0, help="skip this many characters first")


def plot_extras(args) -> tuple[str, ...]:
    """Recall/NIAH need matplotlib only for ``--trace-plot``."""
    return ("eval",) if args.trace_plot else ()


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluations: perplexity, recall, NIAH, ablation, KL shift, memory")
    evsub = p.add_subparsers(dest="eval_command", metavar="EVAL")
    evsub.required = True

    q = evsub.add_parser("ppl", help="teacher-forced perplexity with per-step eviction, policies batched")
    _common(q)
    _text_args(q, 4096)
    q.add_argument(
        "--policies", type=policies_arg, default=DEFAULT_PPL_POLICIES, help="policy specs, comma-separated"
    )
    q.add_argument(
        "--match-bytes", metavar="SPEC", help="scale every evicting policy to this spec's peak bytes"
    )
    q.add_argument("--plot", type=Path, help="perplexity vs peak KV bytes PNG (default: OUT.png)")
    q.add_argument(
        "--checkpoint-every", type=positive_int, default=0, help="write OUT.partial.json every N tokens"
    )
    q.set_defaults(run=eval_commands.run_ppl, extras=("eval",))

    q = evsub.add_parser(
        "ablation", help="matched-rate ablation: random/recency/attention on confkv's schedule"
    )
    _common(q)
    _text_args(q, 2048)
    q.add_argument("--policy", default="confkv", help="the confkv spec whose schedule is replayed")
    q.add_argument("--match-bytes", metavar="SPEC", help="scale to this spec's peak bytes first")
    q.set_defaults(run=eval_commands.run_ablation)

    q = evsub.add_parser("klshift", help="KL(p_full || p_recent_K) vs confidence: Pearson/Spearman r")
    _common(q)
    _text_args(q, 2048)
    q.add_argument("--recent", type=positive_int, default=256, help="K: tokens the recent-only model sees")
    q.add_argument("--every", type=positive_int, default=8, help="sample every N-th step (after K)")
    q.add_argument("--bootstrap", type=positive_int, default=2000, help="bootstrap resamples for the CI")
    q.add_argument("--plot", type=Path, help="scatter PNG (default: OUT.png)")
    q.set_defaults(run=eval_commands.run_klshift, extras=("eval",))

    q = evsub.add_parser("memory", help="peak and mean KV bytes per policy over a long generation")
    _common(q)
    _text_args(q, 256)
    q.add_argument("--new-tokens", type=positive_int, default=3840, help="tokens generated after the prompt")
    q.add_argument(
        "--policies",
        type=policies_arg,
        default="full,window:n=512,confkv,confkv:int8=1",
        help="policy specs, comma-separated",
    )
    q.add_argument("--match-bytes", metavar="SPEC")
    q.set_defaults(run=eval_commands.run_memory)

    for name, helptext in (
        ("recall", "chat-format recall items (JSONL)"),
        ("niah", "generated passkey items"),
    ):
        q = evsub.add_parser(name, help=helptext)
        _common(q)
        q.add_argument(
            "--policies",
            type=policies_arg,
            default="full,window:n=512,confkv",
            help="policy specs, comma-separated",
        )
        q.add_argument("--match-bytes", metavar="SPEC")
        q.add_argument("--max-new-tokens", type=positive_int, default=16)
        q.add_argument("--chunk-size", type=positive_int, default=256, help="prefill chunk (tokens)")
        q.add_argument("--limit", type=positive_int, default=0, help="use only the first N items (0: all)")
        q.add_argument("--trace-plot", type=Path, help="confidence/budget/bytes trace PNG of the first item")
        if name == "recall":
            q.add_argument("--data", type=Path, required=True, help="JSONL items (DESIGN.md format)")
        else:
            q.add_argument("--haystack", type=Path, required=True, help="text file the filler comes from")
            q.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens (1K-8K)")
            q.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in (0, 1)")
            q.add_argument("--seed", type=positive_int, default=0)
            q.add_argument("--save-items", type=Path, help="also write the generated items as JSONL")
        q.set_defaults(run=getattr(eval_commands, f"run_{name}"), extras=plot_extras)
