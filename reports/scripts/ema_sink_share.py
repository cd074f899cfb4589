"""Where the largest EMA of received attention sits when ``confkv`` ranks tokens for eviction.

    python reports/scripts/ema_sink_share.py --tokens 1536 --json reports/ema_sink_share.json

Runs ``confkv eval ppl``'s teacher-forced loop on the Emma sample (dev text) at the bytes of
``window:n=512`` and records, at every eviction scoring: whether the layer's largest EMA belongs
to an attention sink (position < s), and the largest, median and 90th-percentile EMA of the other
tokens relative to that maximum. With ``norm=max`` these ratios are the EMA term a token gets.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from confkv.data import sample_text
from confkv.eval.common import load_text_tokens
from confkv.eval.ppl import PplConfig, run_ppl
from confkv.models import load_model
from confkv.policies.confkv import ConfKVPolicy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--policy", default="confkv:int8=1")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[tuple[bool, float, float, float]] = []
    original = ConfKVPolicy.score

    def recording(self, stats):
        ema, pos = stats.ema, stats.positions
        top = float(ema.max().clamp_min(1e-12))
        rest = ema[pos >= self.s]
        rows.append((bool(pos[ema.argmax()] < self.s), float(rest.max()) / top,
                     float(rest.median()) / top, float(rest.quantile(0.9)) / top))  # fmt: skip
        return original(self, stats)

    ConfKVPolicy.score = recording  # type: ignore[method-assign]
    model, tokenizer = load_model()
    ids = load_text_tokens(tokenizer, sample_text("emma"), args.tokens)
    result = run_ppl(model, ids, PplConfig((args.policy,), "window:n=512"))
    report = {
        "policy": args.policy,
        "tokens": args.tokens,
        "ppl": result[args.policy]["ppl"],
        "scorings": len(rows),
        "max_at_sink_share": sum(r[0] for r in rows) / len(rows),
        "median_nonsink_max_over_max": statistics.median(r[1] for r in rows),
        "median_nonsink_median_over_max": statistics.median(r[2] for r in rows),
        "median_nonsink_p90_over_max": statistics.median(r[3] for r in rows),
    }
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
