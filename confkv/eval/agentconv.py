"""Agent-style multi-turn recall items (issue 10, "Must measure" 2) in the recall JSONL format.

Each item is one conversation between a user and a tool-using agent:

- a system prompt describing the agent and its tools (``search_library``, ``fetch_page``,
  ``calculator``, ``lookup_record``) with JSON schemas in text;
- a fact stated early (turn 1-3) by the user, by the assistant, or inside a JSON tool result
  (``kind``: ``user`` | ``assistant`` | ``tool_json``); facts come from ``FACT_TEMPLATES``
  (codes, names, places, dates, amounts drawn from a seeded RNG) and never occur in the corpora;
- filler that looks like agent traffic: pasted pages (corpus paragraphs), assistant tool calls
  (JSON), tool results carrying corpus paragraphs, calculator calls and small talk;
- a final user question about the fact; ``answer_prefix`` starts the assistant's reply so that
  its greedy continuation begins with ``answer``.

Roles. SmolLM2's chat template is plain ChatML: it renders any role name verbatim, but the model
was tuned on ``system``/``user``/``assistant`` only, and stricter templates (Llama 2, Mistral)
reject other roles or non-alternating turns. Tool results are therefore user messages that start
with ``[tool result: NAME]`` (``tool_role`` changes that role), and after the system prompt the
turns strictly alternate user/assistant, ending with the user's question.

Lengths are tokens of the templated prompt (``recall.prompt_text``, answer prefix included):
``tokens`` is the total and ``fact_tokens_before_question`` the distance from the fact's first
token to the first token of the final user turn. The same seed, corpora and tokenizer give the
same items.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

KINDS = ("user", "assistant", "tool_json")
TOOL_MARK = "[tool result: {name}]"
MIN_DISTANCE = 1400

SYSTEM_PROMPT = """You are Quill, an assistant agent for research and errands. To call a tool, reply \
with one JSON object {"tool": NAME, "arguments": {...}}. Tool results arrive in user messages \
that start with [tool result: NAME]. Tools (arguments as JSON schema):
- search_library: {"query": {"type": "string"}, "max_results": {"type": "integer"}}
- fetch_page: {"url": {"type": "string"}}
- calculator: {"expression": {"type": "string"}}
- lookup_record: {"record_type": {"type": "string"}}
Answer briefly and remember what the user tells you."""


# ---------------------------------------------------------------- facts


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("BCDFGHJKLMNPQRSTVWXZ") for _ in range(n))


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


_SYL_A = ("Bal", "Cor", "Dra", "Fen", "Gar", "Hal", "Kel", "Lor", "Mar", "Nor", "Ost", "Pel", "Quen", "Ros")
_SYL_B = ("vik", "dren", "mont", "sel", "tov", "wyn", "brek", "lund", "zar", "hult", "nesk", "tarr")
_FIRST = ("Ilsa", "Tomas", "Petra", "Anouk", "Sven", "Mira", "Kasimir", "Odile", "Rafe", "Greta", "Nils")
_WORDS = ("amber", "falcon", "cobalt", "maple", "orbit", "pebble", "quartz", "tundra", "violet", "walrus")
_MONTHS = ("March", "April", "May", "June", "July", "September", "October", "November")


def _surname(rng: random.Random) -> str:
    return rng.choice(_SYL_A) + rng.choice(_SYL_B)


@dataclass(frozen=True)
class FactTemplate:
    """One kind of fact. ``phrase`` states it ("The flight number is" + value) and is also the
    answer prefix: the same words before the value in the fact and in the answer give the
    small model an exact pattern to copy from."""

    name: str
    draw: Callable[[random.Random], str]
    phrase: str
    request: str  # the user asks the assistant to produce the fact (kind "assistant")
    done: str  # the assistant's opening before it states the fact
    record_type: str  # lookup_record's record; the fact is one JSON field of it
    json_key: str
    question: str


FACT_TEMPLATES: tuple[FactTemplate, ...] = (
    FactTemplate(
        "tracking_code", lambda r: f"{_letters(r, 2)}-{_digits(r, 4)}", "The tracking code of the order is",
        "Can you place the order for the desk lamp?", "Done, the desk lamp is ordered.",
        "order", "tracking_code", "What is the tracking code of my order?",
    ),
    FactTemplate(
        "door_code", lambda r: _digits(r, 4), "The door code of the storage unit is",
        "Can you reset the door code of my storage unit?", "Done, I reset it.",
        "storage_unit", "door_code", "What is the door code of my storage unit?",
    ),
    FactTemplate(
        "contact_name", lambda r: f"{r.choice(_FIRST)} {_surname(r)}", "The contact at the depot is",
        "Who will be my contact at the depot?", "I asked the depot.",
        "depot_account", "contact_name", "Who is my contact at the depot?",
    ),
    FactTemplate(
        "flight_number", lambda r: f"{_letters(r, 2)}{_digits(r, 3)}", "The flight number is",
        "Can you book the morning flight for me?", "Booked.",
        "flight_booking", "flight_number", "What is my flight number?",
    ),
    FactTemplate(
        "invoice_total", lambda r: f"${r.randint(1, 9)},{_digits(r, 3)}.{r.randint(10, 99)}",
        "The invoice total is", "Can you total up my invoice?", "I added it up.",
        "invoice", "total", "What is the total of my invoice?",
    ),
    FactTemplate(
        "meeting_date", lambda r: f"{r.choice(_MONTHS)} {r.randint(2, 28)}", "The review meeting is on",
        "Can you schedule the review meeting?", "Scheduled.",
        "calendar_event", "date", "When is the review meeting?",
    ),
    FactTemplate(
        "hotel_room", lambda r: f"{r.randint(2, 9)}{r.randint(0, 4)}{r.randint(1, 9)}",
        "The hotel room number is", "Can you check me in at the hotel?", "You are checked in.",
        "hotel_booking", "room_number", "What is my hotel room number?",
    ),
    FactTemplate(
        "wifi_password", lambda r: f"{r.choice(_WORDS)}-{r.choice(_WORDS)}-{_digits(r, 2)}",
        "The Wi-Fi password of the cabin is", "Can you set a new Wi-Fi password for the cabin?", "Done.",
        "cabin", "wifi_password", "What is the Wi-Fi password of the cabin?",
    ),
    FactTemplate(
        "offsite_town", lambda r: _surname(r) + r.choice(("holt", "mere", "by", "stead")),
        "The team offsite will be held in", "Can you pick a town for the team offsite?", "I picked one.",
        "event", "town", "Where will the team offsite be held?",
    ),
    FactTemplate(
        "ticket_number", lambda r: f"TCK-{_digits(r, 5)}", "The support ticket number is",
        "Can you open a support ticket about my broken printer?", "Opened.",
        "support_ticket", "ticket_number", "What is my support ticket number?",
    ),
)  # fmt: skip


def draw_value(template: FactTemplate, rng: random.Random, forbidden: Sequence[str]) -> str:
    """A value of ``template`` that occurs in none of the ``forbidden`` texts (the corpora)."""
    for _ in range(1000):
        value = template.draw(rng)
        if not any(value in text for text in forbidden):
            return value
    raise ValueError(f"agentconv: cannot draw a {template.name} absent from the corpora")


# ---------------------------------------------------------------- messages


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _call(tool: str, **arguments) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


def _result(tool: str, payload: dict, tool_role: str) -> dict:
    body = json.dumps(payload, ensure_ascii=False)
    return _msg(tool_role, TOOL_MARK.format(name=tool) + "\n" + body)


def _record(template: FactTemplate, value: str, rng: random.Random) -> dict:
    """A JSON record with the fact as one field among distractor fields."""
    return {
        "record_type": template.record_type,
        "record_id": f"{template.record_type[:3]}_{_letters(rng, 3).lower()}{_digits(rng, 3)}",
        "status": rng.choice(("active", "confirmed", "pending")),
        template.json_key: value,
        "updated": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
    }


def fact_messages(template: FactTemplate, kind: str, value: str, rng: random.Random, tool_role: str) -> list:
    """The user/assistant exchange in which the fact is stated exactly once."""
    if kind == "user":
        note = rng.choice(("Before we start, a note for later.", "Please remember this.", "For later:"))
        return [
            _msg("user", f"{note} {template.phrase} {value}."),
            _msg("assistant", rng.choice(("Got it, I will remember that.", "Noted. How can I help?"))),
        ]
    if kind == "assistant":
        return [
            _msg("user", template.request),
            _msg("assistant", f"{template.done} {template.phrase} {value}."),
        ]
    if kind == "tool_json":
        return [
            _msg("user", f"Can you look up my {template.record_type.replace('_', ' ')} record?"),
            _msg("assistant", _call("lookup_record", record_type=template.record_type)),
            _result("lookup_record", _record(template, value, rng), tool_role),
            _msg("assistant", "I found the record; it is saved in our conversation above."),
        ]
    raise ValueError(f"agentconv: unknown kind {kind!r}; use one of {KINDS}")


# ---------------------------------------------------------------- filler


def corpus_paragraphs(text: str, min_chars: int = 200, max_chars: int = 1500) -> list[str]:
    """Prose paragraphs (line wraps joined), headings and very short or long ones dropped."""
    paras = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return [p for p in paras if min_chars <= len(p) <= max_chars and not p.isupper()]


def _passage(paragraphs: list[str], rng: random.Random, count: int) -> list[str]:
    start = rng.randrange(0, max(1, len(paragraphs) - count))
    return paragraphs[start : start + count]


def _pasted_page(paragraphs, rng, tool_role) -> list:
    text = "\n\n".join(_passage(paragraphs, rng, rng.randint(1, 3)))
    ask = rng.choice(
        ("Here is a page I am reading:", "I pasted a passage from my book:", "Read this please:")
    )
    reply = rng.choice(
        ("Thanks, I have read it.", "A lovely passage. What next?", "Read it; ask me anything.")
    )
    return [_msg("user", f"{ask}\n\n{text}"), _msg("assistant", reply)]


def _search(paragraphs, rng, tool_role) -> list:
    query = rng.choice(
        ("a walk in the garden", "a letter", "a ball", "a visit from a neighbour", "the weather")
    )
    hits = [{"rank": i + 1, "snippet": p} for i, p in enumerate(_passage(paragraphs, rng, rng.randint(1, 2)))]
    first = str(hits[0]["snippet"]).split(". ")[0]
    return [
        _msg("user", f"Search the library for scenes about {query}."),
        _msg("assistant", _call("search_library", query=query, max_results=len(hits))),
        _result("search_library", {"query": query, "results": hits}, tool_role),
        _msg("assistant", f'The best match begins: "{first}."'),
    ]


def _fetch(paragraphs, rng, tool_role) -> list:
    url = f"https://library.example.org/texts/{rng.choice(_WORDS)}/{_letters(rng, 3).lower()}"
    text = "\n\n".join(_passage(paragraphs, rng, rng.randint(1, 2)))
    return [
        _msg("user", f"Please fetch {url} and tell me what it is about."),
        _msg("assistant", _call("fetch_page", url=url)),
        _result("fetch_page", {"url": url, "status": 200, "text": text}, tool_role),
        _msg("assistant", "It is a passage from a classic novel about the manners of a country family."),
    ]


def _calculate(paragraphs, rng, tool_role) -> list:
    a, b, op = rng.randint(12, 99), rng.randint(3, 40), rng.choice("+*-")
    result = {"+": a + b, "*": a * b, "-": a - b}[op]
    expression = f"{a} {op} {b}"
    return [
        _msg("user", f"Quick sum: what is {expression}?"),
        _msg("assistant", _call("calculator", expression=expression)),
        _result("calculator", {"expression": expression, "result": result}, tool_role),
        _msg("assistant", f"{expression} = {result}."),
    ]


_SMALL_TALK = (
    ("Thanks! How is your day going?", "Quite well, thank you. Happy to keep helping."),
    ("Do you like these old novels?", "I do; the dialogue is sharp and the characters are memorable."),
    ("Sorry, I got distracted for a moment.", "No problem at all. Take your time."),
    ("That was helpful, thanks.", "You are welcome!"),
    ("It is raining here again.", "A good day for reading, then."),
)


def _small_talk(paragraphs, rng, tool_role) -> list:
    user, assistant = rng.choice(_SMALL_TALK)
    return [_msg("user", user), _msg("assistant", assistant)]


FILLERS = (_pasted_page, _search, _fetch, _calculate, _small_talk)
FILLER_WEIGHTS = (3, 2, 2, 1, 1)


def filler_block(paragraphs: list[str], rng: random.Random, tool_role: str) -> list:
    """One user-first exchange of agent traffic (2 or 4 messages, alternating roles)."""
    make = rng.choices(FILLERS, weights=FILLER_WEIGHTS)[0]
    return make(paragraphs, rng, tool_role)


# ---------------------------------------------------------------- assembly and lengths


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def measure(tokenizer, messages: list[dict], answer_prefix: str, value: str) -> tuple[int, int]:
    """-> (total prompt tokens, tokens from the fact's first token to the final user turn)."""
    from confkv.eval.recall import prompt_text

    total = count_tokens(tokenizer, prompt_text(tokenizer, messages, answer_prefix))
    before_question = prompt_text(tokenizer, messages[:-1], generation=False)
    upto_fact = before_question[: before_question.index(value)]
    return total, count_tokens(tokenizer, before_question) - count_tokens(tokenizer, upto_fact)


def final_question(template: FactTemplate, rng: random.Random) -> dict:
    lead = rng.choice(("Back to something from earlier: ", "One more thing. ", "Before I go: "))
    return _msg("user", lead + template.question + " Answer briefly.")


def _opening(rng: random.Random) -> list:
    """0 or 1 small-talk exchange before the fact, so the fact lands in turn 1-3."""
    if rng.random() < 0.5:
        return []
    return [_msg("user", "Hi Quill!"), _msg("assistant", "Hello! What can I do for you today?")]


@dataclass(frozen=True)
class ItemSpec:
    index: int
    template: FactTemplate
    kind: str
    paragraphs: list[str]


def occurrences(messages: list[dict], value: str) -> int:
    return sum(m["content"].count(value) for m in messages)


def opening_and_fact(spec: ItemSpec, rng: random.Random, forbidden, tool_role: str) -> tuple[list, str]:
    """-> (system prompt, optional greeting and the fact exchange; the fact's value), the value
    occurring exactly once (a distractor field of a JSON record could contain it by chance)."""
    for _ in range(100):
        value = draw_value(spec.template, rng, forbidden)
        head = [_msg("system", SYSTEM_PROMPT), *_opening(rng)]
        head += fact_messages(spec.template, spec.kind, value, rng, tool_role)
        if occurrences(head, value) == 1:
            return head, value
    raise ValueError(f"agentconv: item {spec.index}: cannot state the fact exactly once")


def build_item(spec: ItemSpec, rng, tokenizer, forbidden, min_tokens, max_tokens, tool_role) -> dict:
    """One conversation: filler is added until a drawn target length, keeping the distance
    from the fact to the question >= MIN_DISTANCE and the total within [min, max] tokens."""
    head, value = opening_and_fact(spec, rng, forbidden, tool_role)
    question, prefix = final_question(spec.template, rng), spec.template.phrase
    target = min_tokens + int((max_tokens - min_tokens) * rng.random() ** 2)  # more short items
    body: list[dict] = []
    total, distance = measure(tokenizer, [*head, question], prefix, value)
    for _ in range(500):
        if total >= target and distance >= MIN_DISTANCE and total >= min_tokens:
            break
        block = filler_block(spec.paragraphs, rng, tool_role)
        if occurrences(block, value):
            continue
        t, d = measure(tokenizer, [*head, *body, *block, question], prefix, value)
        if t > max_tokens:
            continue  # too long: try another (usually shorter) block
        body, total, distance = body + block, t, d
    if distance < MIN_DISTANCE or not min_tokens <= total <= max_tokens:
        raise ValueError(f"agentconv: item {spec.index} cannot fit {min_tokens}..{max_tokens} tokens")
    return {
        "id": f"agentconv-{spec.index:03d}-{spec.template.name}-{spec.kind}",
        "messages": [*head, *body, question],
        "answer": value,
        "answer_prefix": prefix,
        "kind": spec.kind,
        "fact": spec.template.name,
        "fact_tokens_before_question": distance,
        "tokens": total,
    }


def generate_items(
    corpus_texts: Sequence[str],
    n: int,
    seed: int,
    tokenizer,
    min_tokens: int = 1500,
    max_tokens: int = 4000,
    tool_role: str = "user",
) -> list[dict]:
    """``n`` items; kinds cycle user/assistant/tool_json, templates cycle in a seeded order,
    corpora are used in turn. Deterministic for a given seed, corpora and tokenizer."""
    if n < 1 or not corpus_texts:
        raise ValueError("agentconv: need n >= 1 and at least one corpus text")
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"agentconv: need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    corpora = [corpus_paragraphs(text) for text in corpus_texts]
    if not all(corpora):
        raise ValueError("agentconv: every corpus needs prose paragraphs (200-1500 characters)")
    order = list(FACT_TEMPLATES)
    random.Random(f"agentconv-order-{seed}").shuffle(order)
    items = []
    for i in range(n):
        spec = ItemSpec(i, order[i % len(order)], KINDS[i % len(KINDS)], corpora[i % len(corpora)])
        rng = random.Random(f"agentconv-{seed}-{i}")
        items.append(build_item(spec, rng, tokenizer, corpus_texts, min_tokens, max_tokens, tool_role))
    return items


# ---------------------------------------------------------------- command line


def load_tokenizer(model: str):
    """Only the tokenizer of ``model`` ('smollm2' uses the converted folder in the cache)."""
    from transformers import AutoTokenizer

    from confkv.models import resolve

    return AutoTokenizer.from_pretrained(resolve(model))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m confkv.eval.agentconv", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", action="append", required=True, help="plain-text corpus (repeatable)")
    p.add_argument("--n", type=int, default=40, help="number of items")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--model", default="smollm2", help="whose tokenizer and chat template measure lengths")
    p.add_argument("--tool-role", default="user", help="role of tool-result messages")
    p.add_argument("--out", required=True, help="JSONL output")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        texts = [Path(path).read_text(encoding="utf-8") for path in args.corpus]
        items = generate_items(
            texts,
            args.n,
            args.seed,
            load_tokenizer(args.model),
            args.min_tokens,
            args.max_tokens,
            args.tool_role,
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}")
        return 2
    Path(args.out).write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    print(f"wrote {len(items)} items to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
