"""``confkv eval recall``: chat-format items (DESIGN.md JSONL), greedy answers per policy.

Each item goes through the chat template (generation prompt added, ``answer_prefix`` appended),
is prefilled in chunks with eviction between chunks (peak KV bounded for any prompt length),
then answered greedily. Correct when the stripped continuation starts with the answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from confkv.cache import ConfKVCache
from confkv.decode import decode_one_token, generate, prefill
from confkv.eval.common import geometry_of, matched_policies, recall_fields
from confkv.sequence import seed_of


@dataclass(frozen=True)
class RecallConfig:
    specs: tuple[str, ...]
    match_bytes: str | None = None
    max_new_tokens: int = 16
    chunk_size: int = 256

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError("recall: at least one policy is needed")
        if self.max_new_tokens < 1 or self.chunk_size < 1:
            raise ValueError("recall: max_new_tokens and chunk_size must be >= 1")


def validate_item(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if not isinstance(item.get("id"), str) or not isinstance(item.get("answer"), str):
        raise ValueError(f"{where}: 'id' and 'answer' must be strings")
    msgs = item.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for m in msgs:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: every message needs string 'role' and 'content'")
    if msgs[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must be the user's question")
    if not isinstance(item.get("answer_prefix", ""), str):
        raise ValueError(f"{where}: 'answer_prefix' must be a string")
    return item


def load_items(path: str | Path) -> list[dict]:
    """Read and validate JSONL items; ValueError names the bad line."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: invalid JSON ({err.msg})") from None
        items.append(validate_item(item, f"{path}:{n}"))
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def prompt_text(tokenizer, messages: list[dict], answer_prefix: str = "", generation: bool = True) -> str:
    if tokenizer.chat_template is None:  # plain LMs: messages one per line
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + (
            "\nassistant:" if generation else ""
        )
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    return text + answer_prefix


def prompt_ids(tokenizer, item: dict) -> torch.Tensor:
    """(1, T) ids of the item's prompt, answer prefix included."""
    text = prompt_text(tokenizer, item["messages"], item.get("answer_prefix", ""))
    return torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])


def is_correct(continuation: str, answer: str) -> bool:
    """The continuation starts with the answer, after whitespace and opening quotes or markup
    (``"WH-2409".`` answers WH-2409)."""
    return continuation.strip().lstrip("\"'`*(").strip().startswith(answer.strip())


def _answer(model, tok, policy, ids, config: RecallConfig, seed: int) -> dict:
    cache = ConfKVCache.for_model(model, policy, seed=seed)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    start = time.perf_counter()
    out = generate(model, cache, ids, config.max_new_tokens, eos, chunk_size=config.chunk_size, trace=True)
    text = tok.decode(out.tokens, skip_special_tokens=True)
    kv = [row["kv_bytes"] for row in out.trace] or [cache.nbytes()]
    cold = [row["cold_bytes"] for row in out.trace] or [cache.seqs[0].cold_nbytes()]
    return {
        "text": text,
        "decode_steps": len(out.tokens),
        "peak_kv_bytes": int(cache.seqs[0].stats.peak_bytes),
        "mean_kv_bytes": sum(kv) / len(kv),
        "seconds": time.perf_counter() - start,
        "resolved_policy": cache.seqs[0].policy.spec(),
        **recall_fields(cache.seqs[0], sum(cold) / len(cold)),
    }


def run_recall(model, tok, items: list[dict], config: RecallConfig, progress: bool = False):
    """-> ({spec: accuracy + bytes}, per-item rows)."""
    policies = matched_policies(list(config.specs), geometry_of(model), config.match_bytes)
    per_item: list[dict] = []
    agg: dict[str, list[dict]] = {spec: [] for spec in config.specs}
    bar = tqdm(total=len(items) * len(policies), desc="recall", disable=not progress, leave=False)
    for item in items:
        ids = prompt_ids(tok, item)
        row = {"id": item["id"], "answer": item["answer"], "prompt_tokens": int(ids.shape[1]), "outputs": {}}
        for spec, policy in zip(config.specs, policies, strict=True):
            ans = _answer(model, tok, policy, ids, config, seed_of(item["id"]))
            ans["correct"] = is_correct(ans["text"], item["answer"])
            row["outputs"][spec] = ans
            agg[spec].append(ans)
            bar.update(1)
        per_item.append(row)
    bar.close()
    results = {}
    for spec, answers in agg.items():
        results[spec] = {
            "accuracy": sum(a["correct"] for a in answers) / len(answers),
            "peak_kv_bytes": max(a["peak_kv_bytes"] for a in answers),
            "mean_kv_bytes": sum(a["mean_kv_bytes"] for a in answers) / len(answers),
            "seconds": sum(a["seconds"] for a in answers),
            "resolved_policy": answers[0]["resolved_policy"],
            "items": len(answers),
            "peak_cold_bytes": max(a["peak_cold_bytes"] for a in answers),
            "mean_cold_bytes": sum(a["mean_cold_bytes"] for a in answers) / len(answers),
            "recalled_tokens": sum(a["recalled_tokens"] for a in answers),
            "recall_steps": sum(a["recall_steps"] for a in answers),
            "decode_steps": sum(a["decode_steps"] for a in answers),
        }
    return results, per_item


@torch.no_grad()
def trace_item(model, tok, item: dict, config: RecallConfig, out: str | Path) -> Path:
    """Feed one item's prompt token by token through the first evicting policy, then answer;
    plot confidence, budget and KV bytes with a marker where the final user message starts."""
    from confkv.eval.plots import trace_plot

    policies = matched_policies(list(config.specs), geometry_of(model), config.match_bytes)
    spec, policy = next(
        ((s, p) for s, p in zip(config.specs, policies, strict=True) if p.evicts), (None, None)
    )
    if policy is None:
        raise ValueError("--trace-plot needs an evicting policy among --policies")
    ids = prompt_ids(tok, item)[0]
    before = prompt_text(tok, item["messages"][:-1], generation=False) if len(item["messages"]) > 1 else ""
    marker = len(tok(before, add_special_tokens=False).input_ids) if before else 0
    marker = max(marker, _question_start(tok, item, ids))
    cache = ConfKVCache.for_model(model, policy, seed=seed_of(item["id"]))  # as the item's eval row
    logits = prefill(model, cache, ids[:1].view(1, 1))
    trace = []
    for t in range(1, ids.shape[0] + config.max_new_tokens):
        token = ids[t] if t < ids.shape[0] else logits[0].argmax()
        logits = decode_one_token(model, cache, token.view(1))
        seq = cache.seqs[0]
        trace.append(
            {"step": t, "confidence": seq.last_confidence, "budget": seq.budget, "kv_bytes": seq.nbytes()}
        )
    return trace_plot(trace, out, marker, f"{spec}: item {item['id']}")


def _question_start(tok, item: dict, ids: torch.Tensor) -> int:
    """Token index where the question (last paragraph of the final user message) begins."""
    question_text = item["messages"][-1]["content"].strip().split("\n\n")[-1]
    question = tok(question_text, add_special_tokens=False).input_ids[:8]
    seq = ids.tolist()
    for probe in (question, question[1:]):  # the first token may merge with what precedes it
        for start in range(len(seq) - len(probe), -1, -1):
            if probe and seq[start : start + len(probe)] == probe:
                return start - (len(question) - len(probe))
    return 0
