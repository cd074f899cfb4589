"""Which prompt-end vote ranks an agent conversation's fact first? (dev items only)

    python reports/scripts/probe_fact_rank.py --data reports/data/agentconv_dev.jsonl \
        --json reports/probe_fact_rank.json

For every item the prompt, less its last ``obs`` tokens, runs with the full cache; the last
``obs`` tokens then run with eager attention, which gives every layer's and head's attention
from those queries to every earlier position (what the recall probe sees exactly: it scores hot
and cold tokens alike). Each scheme turns them into one importance per position, max-pooled over
7 neighbours as the probe does, and the fact's rank is its best token's rank among the evictable
positions (the first ``s`` and the last ``p`` are kept anyway). Scheme A is ``vote=sum``, scheme
E is ``vote=last``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import DynamicCache

from confkv.eval.recall import load_items, prompt_text
from confkv.models import load_model


def schemes(att: torch.Tensor, evictable: torch.Tensor) -> dict[str, torch.Tensor]:
    """att (L, H, M, N): attention of the M last queries over N earlier positions."""
    mass = att.sum(2)  # (L, H, N)
    layer = mass.sum(1)  # (L, N)
    lev = layer * evictable
    hev = mass * evictable
    per_head = hev / hev.sum(2, keepdim=True).clamp_min(1e-12)
    last = att[:, :, -1, :] * evictable
    last = last / last.sum(2, keepdim=True).clamp_min(1e-12)
    top = att.amax(2) * evictable
    top = top / top.sum(2, keepdim=True).clamp_min(1e-12)
    return {
        "A_sum_over_layers_norm_all (vote=sum)": (layer / layer.sum(1, keepdim=True)).sum(0),
        "B_sum_over_layers_norm_evictable": (lev / lev.sum(1, keepdim=True)).sum(0),
        "C_all_queries_max_over_heads": per_head.amax((0, 1)),
        "D_all_queries_sum_over_heads": per_head.sum((0, 1)),
        "E_last_query_max_over_heads (vote=last)": last.amax((0, 1)),
        "F_last_query_sum_over_heads": last.sum((0, 1)),
        "G_all_queries_top8_heads": per_head.flatten(0, 1).topk(8, dim=0).values.sum(0),
        "H_max_over_queries_max_over_heads": top.amax((0, 1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--items", type=int, default=0, help="first N items (0: all)")
    ap.add_argument("--obs", type=int, default=32)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--s", type=int, default=4)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    items = load_items(args.data)
    items = items[: args.items] if args.items else items
    ranks: dict[str, list[int]] = {}
    rows = []
    for item in items:
        text = prompt_text(tok, item["messages"], item.get("answer_prefix", ""))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor([enc.input_ids])
        t = ids.shape[1]
        c0 = text.find(item["answer"])
        c1 = c0 + len(item["answer"])
        fact = [i for i, (a, b) in enumerate(enc.offset_mapping) if a < c1 and b > c0]
        n = t - args.obs
        cache = DynamicCache()
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True)
            model.set_attn_implementation("eager")
            out = model(input_ids=ids[:, n:], past_key_values=cache, use_cache=True, output_attentions=True)
        att = torch.stack([a[0, :, :, :n].float() for a in out.attentions])
        evictable = torch.ones(n, dtype=torch.bool)
        evictable[: args.s] = False
        evictable[n - args.p :] = False
        row = {"id": item["id"], "tokens": t, "fact_positions": fact}
        for name, score in schemes(att, evictable).items():
            pooled = torch.nn.functional.max_pool1d(score.view(1, 1, -1), 7, 1, 3).view(-1)
            pooled = pooled.masked_fill(~evictable, -1.0)
            rank = min(int((pooled > pooled[f]).sum()) for f in fact)
            ranks.setdefault(name, []).append(rank)
            row[name] = rank
        rows.append(row)
        print(item["id"], {k[:1]: row[k] for k in ranks}, flush=True)
    summary = {
        name: {
            "median_rank": statistics.median(r),
            "mean_rank": statistics.mean(r),
            **{f"top{k}": sum(x < k for x in r) for k in (64, 256, 512)},
        }
        for name, r in ranks.items()
    }
    report = {"data": args.data, "items": len(rows), "obs": args.obs, "summary": summary, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"| scheme | median rank | mean rank | top 64 | top 256 | top 512 | (of {len(rows)})")
    for name, s in summary.items():
        tops = " | ".join(str(s[f"top{k}"]) for k in (64, 256, 512))
        print(f"| {name} | {s['median_rank']} | {s['mean_rank']:.1f} | {tops} |")


if __name__ == "__main__":
    main()
