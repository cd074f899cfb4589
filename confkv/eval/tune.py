"""Default-setting check on *tuning* novels only (never on the evaluation texts).

``python -m confkv.eval.tune --text-file emma.txt --tokens 2048 --json reports/tune_emma.json``
computes the full-context model's per-token confidence over the text (one plain forward pass,
no cache) and reports its quantiles and the fraction of steps below each candidate tau: with
tau at the q-quantile, Conf-KV keeps N_high tokens on a fraction q of the steps and N_low on
the rest, so tau sets the mean budget (and the mean bytes) between N_low and N_high.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from confkv.confidence import confidence
from confkv.eval.common import load_text_tokens

TAUS = (0.3, 0.4, 0.5, 0.6, 0.7)


@torch.no_grad()
def confidence_profile(model, ids: torch.Tensor, chunk: int = 1024) -> dict:
    """ids (T,) -> quantiles of confidence, fraction of steps under each tau, and plain ppl."""
    logits = model(input_ids=ids[:chunk].view(1, -1), use_cache=False).logits[0]  # (T, V)
    conf = confidence(logits[:-1])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:chunk])
    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    quant = torch.quantile(conf, torch.tensor(qs)).tolist()
    return {
        "tokens": int(conf.shape[0] + 1),
        "ppl_full": math.exp(float(nll)),
        "confidence_quantiles": {str(q): v for q, v in zip(qs, quant, strict=True)},
        "fraction_below_tau": {str(t): float((conf < t).float().mean()) for t in TAUS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text-file", type=Path, required=True, action="append")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    from confkv.models import load_model

    model, tok = load_model(args.model)
    out = {"model": args.model, "texts": {}}
    for path in args.text_file:
        ids = load_text_tokens(tok, path, args.tokens)
        out["texts"][path.name] = confidence_profile(model, ids, args.tokens)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
