"""Agent-conversation recall items: deterministic, DESIGN.md format, the fact stated once, lengths."""

from __future__ import annotations

import json
import random

import pytest

from confkv.eval import agentconv
from confkv.eval.agentconv import FACT_TEMPLATES, KINDS, MIN_DISTANCE, TOOL_MARK, generate_items
from confkv.eval.recall import prompt_text, validate_item

MIN_TOKENS, MAX_TOKENS = 1500, 4000


class WordTokenizer:
    """Stand-in tokenizer: one token per whitespace-separated word, no chat template (so
    ``prompt_text`` renders 'role: content' lines)."""

    chat_template = None

    class _Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        return self._Encoding([len(word) for word in text.split()])


def synthetic_corpus(seed: int, paragraphs: int = 80) -> str:
    """Lowercase prose-like paragraphs (no digits, no capitals) so no fact value can occur in it."""
    rng = random.Random(seed)
    words = "the lady walked to the garden and spoke of letters visits weather and a ball at noon".split()
    paras = []
    for _ in range(paragraphs):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 16))) + "." for _ in range(6)]
        paras.append("\n".join(sentences))  # line wraps, joined by the paragraph splitter
    return "title page\n\n\n" + "\n\n".join(paras)


@pytest.fixture(scope="module")
def corpora() -> list[str]:
    return [synthetic_corpus(1), synthetic_corpus(2)]


@pytest.fixture(scope="module")
def items(corpora) -> list[dict]:
    return generate_items(corpora, 12, 7, WordTokenizer(), MIN_TOKENS, MAX_TOKENS)


def test_deterministic_for_a_seed(corpora, items):
    assert generate_items(corpora, 12, 7, WordTokenizer(), MIN_TOKENS, MAX_TOKENS) == items
    other = generate_items(corpora, 12, 8, WordTokenizer(), MIN_TOKENS, MAX_TOKENS)
    assert [i["answer"] for i in other] != [i["answer"] for i in items]


def test_format_roles_and_kinds(items):
    for item in items:
        validate_item(json.loads(json.dumps(item)), item["id"])
        roles = [m["role"] for m in item["messages"]]
        assert roles[0] == "system" and "calculator" in item["messages"][0]["content"]
        assert roles[1::2] == ["user"] * len(roles[1::2])  # strict alternation, question last
        assert roles[2::2] == ["assistant"] * len(roles[2::2])
        assert item["answer_prefix"] and not item["answer_prefix"].endswith(" ")
        assert item["kind"] in KINDS
    assert {item["kind"] for item in items} == set(KINDS)
    assert len({item["id"] for item in items}) == len(items)


def test_filler_looks_like_agent_traffic(items):
    contents = [m["content"] for item in items for m in item["messages"]]
    assert any(c.startswith('{"tool": "fetch_page"') for c in contents)
    assert any(c.startswith(TOOL_MARK.format(name="search_library")) for c in contents)


def test_at_least_eight_fact_templates():
    assert len({t.name for t in FACT_TEMPLATES}) >= 8
    for template in FACT_TEMPLATES:
        assert template.question.endswith("?") and template.phrase.endswith((" is", " on", " in"))


def test_fact_once_early_and_never_in_filler(corpora, items):
    for item in items:
        history, answer = item["messages"][:-1], item["answer"]
        where = [i for i, m in enumerate(history) if answer in m["content"]]
        assert len(where) == 1 and history[where[0]]["content"].count(answer) == 1
        turn = sum(1 for m in history[: where[0] + 1] if m["role"] == "user")
        assert 1 <= turn <= 4, f"{item['id']}: fact in user turn {turn}"
        assert answer not in item["messages"][-1]["content"]
        assert not any(answer in text for text in corpora)


def test_tool_json_fact_is_a_json_field(items):
    for item in (i for i in items if i["kind"] == "tool_json"):
        message = next(m for m in item["messages"] if item["answer"] in m["content"])
        mark, body = message["content"].split("\n", 1)
        assert mark == TOOL_MARK.format(name="lookup_record")
        assert item["answer"] in json.loads(body).values()


def test_token_lengths(items):
    tok = WordTokenizer()
    for item in items:
        text = prompt_text(tok, item["messages"], item["answer_prefix"])
        assert item["tokens"] == len(tok(text).input_ids)
        assert MIN_TOKENS <= item["tokens"] <= MAX_TOKENS
        assert MIN_DISTANCE <= item["fact_tokens_before_question"] < item["tokens"]


def test_bad_arguments(corpora):
    with pytest.raises(ValueError, match="min_tokens"):
        generate_items(corpora, 2, 0, WordTokenizer(), 3000, 2000)
    with pytest.raises(ValueError, match="cannot fit"):
        generate_items(corpora, 1, 0, WordTokenizer(), 100, 200)
    with pytest.raises(ValueError, match="paragraphs"):
        generate_items(["too short"], 1, 0, WordTokenizer())


def test_command_line_writes_jsonl(tmp_path, monkeypatch, corpora):
    monkeypatch.setattr(agentconv, "load_tokenizer", lambda model: WordTokenizer())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpora[0])
    out = tmp_path / "items.jsonl"
    assert agentconv.main(["--corpus", str(corpus), "--n", "3", "--seed", "1", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["kind"] == "user"
    assert agentconv.main(["--corpus", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2
