"""Load-test conversations and metrics: deterministic agent turns, exact latency arithmetic."""

from __future__ import annotations

import json

import pytest

from loadtest.conversations import ConversationConfig, conversation, load_corpus
from loadtest.metrics import TurnMetrics, percentile, summarize

CORPUS = {
    "emma": "Mr. Knightley said that Emma was right. " * 200,
    "persuasion": "Anne Elliot walked. " * 300,
}


def test_conversation_is_agent_like_and_deterministic():
    turns = conversation(CORPUS, seed=3, config=ConversationConfig(page_chars=300, turns=7))
    assert [t.kind for t in turns] == ["page", "tool", "followup", "page", "tool", "followup", "page"]
    assert turns == conversation(CORPUS, seed=3, config=ConversationConfig(page_chars=300, turns=7))
    assert turns != conversation(CORPUS, seed=4, config=ConversationConfig(page_chars=300, turns=7))
    page, tool, followup = turns[:3]
    assert page.role == "user" and "Here is a page from" in page.content and len(page.content) > 250
    payload = json.loads(tool.content)
    assert tool.role == "tool" and payload["tool"] == "text_stats" and payload["result"]["words"] > 0
    assert "page I pasted" in followup.content or "page" in followup.content


def test_real_corpus_pages():
    corpus = load_corpus()
    assert len(corpus) == 6
    turns = conversation(corpus, seed=0)
    assert len(turns) == 4 and all(t.content.strip() for t in turns)


@pytest.mark.parametrize("kw", [{"page_chars": 10}, {"turns": 0}])
def test_bad_config(kw):
    with pytest.raises(ValueError):
        ConversationConfig(**kw)


def test_missing_corpus(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path)


def test_turn_metrics_and_summary_exact():
    m = TurnMetrics.from_times(10.0, [10.5, 10.7, 11.0], 11.25)
    assert m.ttft_s == 0.5 and m.tokens == 3 and m.seconds == 1.25
    assert m.itl_s == pytest.approx((0.2, 0.3))
    assert m.tokens_per_second == pytest.approx(2 / 0.5)
    empty = TurnMetrics.from_times(0.0, [], 1.0)
    assert empty.ttft_s is None and empty.tokens_per_second == 0.0
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([], 50) is None
    s = summarize([m, empty], {"Chat:UNAVAILABLE": 1}, wall_s=2.0)
    assert s["tokens"] == 3 and s["throughput_tok_s"] == 1.5 and s["ttft_ms_p50"] == 500.0
    assert s["itl_ms_p95"] == pytest.approx(295.0) and s["failed"] == 1
