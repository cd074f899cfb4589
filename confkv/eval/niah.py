"""``confkv eval niah``: passkey retrieval items (needle in a haystack) in the recall JSONL format.

The haystack is prose from a text file; a passkey sentence is inserted at a relative depth;
the final user message asks for it and the assistant turn starts with "The pass key is".
Prompt lengths are in tokens of the whole templated prompt (about 1K-8K).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = "There is a pass key hidden inside the following text. Find it and memorize it.\n\n"
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
ANSWER_PREFIX = "The pass key is"
MAX_LENGTH = 8192


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def parse_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class NiahConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lengths or not self.depths:
            raise ValueError("niah: need at least one length and one depth")
        for n in self.lengths:
            if not 64 <= n <= MAX_LENGTH:
                raise ValueError(f"niah: lengths must be within 64..{MAX_LENGTH} tokens, got {n}")
        for d in self.depths:
            if not 0.0 < d < 1.0:
                raise ValueError(f"niah: depths must be in (0, 1), got {d}")


def make_item(tokenizer, haystack_ids: list[int], length: int, depth: float, key: int, offset: int) -> dict:
    """One passkey item whose templated prompt is about ``length`` tokens."""
    from confkv.eval.recall import prompt_text

    frame = [{"role": "user", "content": INSTRUCTION + NEEDLE.format(key=key) + QUESTION}]
    overhead = len(
        tokenizer(prompt_text(tokenizer, frame, ANSWER_PREFIX), add_special_tokens=False).input_ids
    )
    filler_tokens = max(16, length - overhead)
    if offset + filler_tokens > len(haystack_ids):
        offset = 0
    if filler_tokens > len(haystack_ids):
        raise ValueError(f"niah: the haystack has {len(haystack_ids)} tokens, need {filler_tokens}")
    chunk = haystack_ids[offset : offset + filler_tokens]
    cut = int(len(chunk) * depth)
    before = tokenizer.decode(chunk[:cut])
    after = tokenizer.decode(chunk[cut:])
    content = INSTRUCTION + before + NEEDLE.format(key=key) + after + QUESTION
    return {
        "id": f"niah-{length}-{depth:g}-{key}",
        "messages": [{"role": "user", "content": content}],
        "answer": str(key),
        "answer_prefix": ANSWER_PREFIX,
        "length": length,
        "depth": depth,
    }


def make_items(tokenizer, haystack: str, config: NiahConfig) -> list[dict]:
    """One item per (length, depth); passkeys and filler offsets from ``config.seed``."""
    rng = random.Random(config.seed)
    budget_chars = max(config.lengths) * 8 * 2
    ids = tokenizer(haystack[:budget_chars], add_special_tokens=False).input_ids
    items = []
    for length in config.lengths:
        for depth in config.depths:
            key = rng.randint(10000, 99999)
            offset = rng.randint(0, max(0, len(ids) - length))
            items.append(make_item(tokenizer, ids, length, depth, key, offset))
    return items


def save_items(items: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path
