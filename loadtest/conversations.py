"""Agent-like multi-turn conversations for load tests (pure: no network, no locust).

A conversation pastes a page of an Austen novel, then feeds a tool result as JSON, then asks
follow-up questions that refer back to earlier turns, so every turn grows the session's
context the way a long-running agent's does. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from confkv.data import sample_corpus

DEFAULT_CORPUS = sample_corpus()  # the shipped excerpts; --corpus FOLDER for whole novels
SYSTEM_PROMPT = "You are a careful research assistant. Answer briefly, using only the material given."
_NAME = re.compile(r"\b(?:Mr|Mrs|Miss|Lady|Sir|Colonel|Captain)\.? [A-Z][a-z]+")


@dataclass(frozen=True)
class Turn:
    kind: str  # "page" | "tool" | "followup"
    role: str  # "user" | "tool"
    content: str


@dataclass(frozen=True)
class ConversationConfig:
    """page_chars: characters per pasted page; turns: turns per conversation (>= 1)."""

    page_chars: int = 1200
    turns: int = 4

    def __post_init__(self) -> None:
        if self.page_chars < 100:
            raise ValueError(f"page_chars must be >= 100, got {self.page_chars}")
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")


def load_corpus(folder: Path | str = DEFAULT_CORPUS) -> dict[str, str]:
    """{novel name: text} of every ``austen_*.txt`` in ``folder``."""
    files = sorted(Path(folder).glob("austen_*.txt"))
    if not files:
        raise FileNotFoundError(f"no austen_*.txt files in {folder}")
    return {f.stem.removeprefix("austen_"): f.read_text(encoding="utf-8", errors="replace") for f in files}


def _page(text: str, rng: random.Random, chars: int) -> str:
    start = rng.randrange(0, max(1, len(text) - chars))
    start = text.find(" ", start) + 1  # whole words
    page = " ".join(text[start : start + chars].split())
    return page.rsplit(" ", 1)[0]


def _tool_result(page: str, novel: str, rng: random.Random) -> str:
    names = Counter(_NAME.findall(page))
    words = re.findall(r"[a-z]+", page.lower())
    payload = {
        "tool": "text_stats",
        "call_id": f"call_{rng.randrange(16**6):06x}",
        "source": f"{novel}.txt",
        "result": {
            "words": len(words),
            "sentences": page.count(".") + page.count("!") + page.count("?"),
            "people": [n for n, _ in names.most_common(5)],
            "top_words": [w for w, _ in Counter(w for w in words if len(w) > 4).most_common(5)],
        },
    }
    return json.dumps(payload)


def conversation(corpus: dict[str, str], seed: int, config: ConversationConfig | None = None) -> list[Turn]:
    """The turns of one conversation (user pages, tool JSON, follow-ups), deterministic per seed."""
    config = config or ConversationConfig()
    rng = random.Random(seed)
    novels = sorted(corpus)
    turns: list[Turn] = []
    pages: list[str] = []
    while len(turns) < config.turns:
        kind = ("page", "tool", "followup")[len(turns) % 3]
        if kind == "page":
            novel = rng.choice(novels)
            pages.append(_page(corpus[novel], rng, config.page_chars))
            content = (
                f"Here is a page from {novel.replace('_', ' ')}:\n\n{pages[-1]}\n\nWho is speaking here?"
            )
            turns.append(Turn("page", "user", content))
        elif kind == "tool":
            turns.append(Turn("tool", "tool", _tool_result(pages[-1], novel, rng)))
        else:
            which = rng.randrange(len(pages))
            ordinal = ("first", "second", "third", "fourth")[min(which, 3)]
            questions = (
                f"Going back to the {ordinal} page I pasted: what happened just before the part you quoted?",
                f"Using the tool result and the {ordinal} page, which person is mentioned most, and why?",
                f"Summarise the {ordinal} page in one sentence, then name one word the tool counted.",
            )
            turns.append(Turn("followup", "user", rng.choice(questions)))
    return turns
