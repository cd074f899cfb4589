"""Recall items (DESIGN.md JSONL) and generated passkey items."""

from __future__ import annotations

import json

import pytest

from confkv.eval.niah import NiahConfig, make_items
from confkv.eval.recall import RecallConfig, is_correct, load_items, prompt_ids, run_recall
from confkv.sequence import seed_of

ITEM = {
    "id": "a",
    "messages": [
        {"role": "user", "content": "My locker code is 4812. Please remember it."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What is my locker code?"},
    ],
    "answer": "4812",
    "answer_prefix": "Your locker code is",
    "extra": "ignored",
}


def test_is_correct_strips_and_matches_prefix():
    assert is_correct("  4812.\n", "4812")
    assert not is_correct("It is 4812", "4812")
    assert is_correct(' "WH-2409".', "WH-2409")  # an opening quote is not part of the answer
    assert not is_correct(' "WH-2408"', "WH-2409")


def test_load_items_validates_each_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(ITEM) + "\n\n")
    assert load_items(good)[0]["id"] == "a"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ITEM) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_items(bad)
    bad.write_text(json.dumps({**ITEM, "messages": []}) + "\n")
    with pytest.raises(ValueError, match="messages"):
        load_items(bad)
    bad.write_text(json.dumps({**ITEM, "answer": 4812}) + "\n")
    with pytest.raises(ValueError, match="answer"):
        load_items(bad)


def test_prompt_goes_through_the_chat_template_with_answer_prefix(chat_tokenizer):
    ids = prompt_ids(chat_tokenizer, ITEM)[0].tolist()
    text = chat_tokenizer.decode(ids)
    assert text.rstrip().endswith("assistant\nYour locker code is")
    assert "<|im_start|>user" in text


def test_run_recall_keep_all_matches_full(chat_llama, chat_tokenizer):
    items = [ITEM, {**ITEM, "id": "b", "answer": "12"}]
    n = prompt_ids(chat_tokenizer, ITEM).shape[1]
    specs = ("full", f"window:n={n + 8}", "window:n=16")
    results, per_item = run_recall(chat_llama, chat_tokenizer, items, RecallConfig(specs, max_new_tokens=4))
    for row in per_item:
        assert row["outputs"]["full"]["text"] == row["outputs"][f"window:n={n + 8}"]["text"]
        for out in row["outputs"].values():
            assert out["correct"] == is_correct(out["text"], row["answer"])
    for spec in specs:
        assert 0.0 <= results[spec]["accuracy"] <= 1.0
        assert results[spec]["items"] == 2
    assert results["window:n=16"]["peak_kv_bytes"] < results["full"]["peak_kv_bytes"]


def test_random_trigger_draws_its_steps_per_item(chat_llama, chat_tokenizer):
    """Each item's sequence gets a seed of its own (stable: from its id), so a ``trigger=random``
    control fires on different steps in different items and its realized rate follows ``rate``;
    a run is still reproducible."""
    items = [{**ITEM, "id": f"item-{i}"} for i in range(12)]
    n = prompt_ids(chat_tokenizer, ITEM).shape[1]
    spec = f"h2o:n={n // 2},recall=1,page=4,trigger=random,rate=0.5"
    config = RecallConfig((spec,), max_new_tokens=6)
    results, per_item = run_recall(chat_llama, chat_tokenizer, items, config)
    fired = [row["outputs"][spec]["recall_steps"] for row in per_item]
    assert len(set(fired)) > 1  # one shared seed made every item fire alike
    steps = results[spec]["decode_steps"]
    assert 0.2 * steps < results[spec]["recall_steps"] < 0.8 * steps
    again, _ = run_recall(chat_llama, chat_tokenizer, items[::-1], config)
    assert again[spec]["recall_steps"] == results[spec]["recall_steps"]  # order does not matter
    assert seed_of("item-1") != seed_of("item-2")


def test_niah_items_have_the_requested_length_and_depth(chat_tokenizer):
    haystack = "The weather was fine and the ladies walked to the village. " * 400
    items = make_items(chat_tokenizer, haystack, NiahConfig((256, 512), (0.1, 0.9), seed=1))
    assert len(items) == 4
    for item in items:
        n = prompt_ids(chat_tokenizer, item).shape[1]
        assert abs(n - item["length"]) <= 8, (n, item["length"])
        content = item["messages"][-1]["content"]
        where = content.index(f"The pass key is {item['answer']}") / len(content)
        assert abs(where - item["depth"]) < 0.15
        assert item["answer_prefix"] == "The pass key is"


def test_niah_config_validation():
    with pytest.raises(ValueError, match="depths"):
        NiahConfig(depths=(1.0,))
    with pytest.raises(ValueError, match="lengths"):
        NiahConfig(lengths=(100000,))
