"""Incremental prompt encoding: the ids a session gets turn after turn equal a whole encode of the
conversation, only new text is tokenized, and a rendering that no longer starts with the cached
one falls back to a whole encode, counted."""

from __future__ import annotations

import random

import pytest

from worker_svc.codec import ByteChatCodec, HFChatCodec
from worker_svc.observability import WorkerMetrics
from worker_svc.prompt import EncodeMode, PromptEncoder
from worker_svc.types import ChatMessage, InvalidRequest, TurnRequest

# text that stresses tokenizers at piece boundaries: leading/trailing spaces and newlines, unicode,
# and special-token look-alikes
FRAGMENTS = ["Hello", " there", "\n\n", "  indented", "ünïcödé ✓", "12345", "<|im_end|>", "\t", "end. "]


def random_text(rng: random.Random, words: int) -> str:
    text = "".join(rng.choice(FRAGMENTS) for _ in range(words))
    return text if text.strip() else "x" + text


def converse(codec, encoder: PromptEncoder, turns: int, seed: int = 0) -> list[ChatMessage]:
    """Run ``turns`` user/assistant turns through ``encoder``, asserting every turn's ids equal a
    whole encode of the conversation; returns the transcript."""
    rng, transcript, prefix = random.Random(seed), [], None
    for _ in range(turns):
        conversation = [*transcript, ChatMessage("user", random_text(rng, rng.randint(1, 12)))]
        ids, prefix = encoder.encode(conversation, prefix)
        assert ids == codec.encode_chat(conversation)
        transcript = [*conversation, ChatMessage("assistant", random_text(rng, rng.randint(1, 12)))]
    return transcript


def test_byte_codec_incremental_equals_whole_over_many_turns():
    codec = ByteChatCodec()
    encoder = PromptEncoder(codec)
    transcript = converse(codec, encoder, turns=60)
    tokens, encodes = encoder.stats.snapshot()
    assert encodes == {EncodeMode.FULL: 1, EncodeMode.INCREMENTAL: 59}
    whole = sum(len(codec.encode_chat(transcript[: 2 * i + 1])) for i in range(60))
    # each turn tokenized only its new messages: the sum of new text, not of whole conversations
    assert tokens == len(codec.encode_chat(transcript[:-1])) < whole / 10


class NumberedTemplate(ByteChatCodec):
    """A template that rewrites earlier text: it opens with the message count."""

    def render_chat(self, messages):
        return f"[{len(messages)} messages]" + super().render_chat(messages)


def test_template_that_changes_earlier_text_falls_back_to_whole_encodes():
    codec = NumberedTemplate()
    encoder = PromptEncoder(codec)
    converse(codec, encoder, turns=8)
    assert encoder.stats.snapshot()[1] == {EncodeMode.FULL: 8, EncodeMode.INCREMENTAL: 0}


def test_a_conversation_that_moved_on_without_the_cached_turn_is_encoded_whole():
    """A cancelled turn's message is in the cached rendering but not in the next conversation."""
    codec = ByteChatCodec()
    encoder = PromptEncoder(codec)
    base = [ChatMessage("user", "first"), ChatMessage("assistant", "reply")]
    _, prefix = encoder.encode([*base, ChatMessage("user", "cancelled turn")], None)
    retry = [*base, ChatMessage("user", "another question")]
    ids, _ = encoder.encode(retry, prefix)
    assert ids == codec.encode_chat(retry)
    assert encoder.stats.snapshot()[1] == {EncodeMode.FULL: 2, EncodeMode.INCREMENTAL: 0}


def test_template_errors_are_the_callers():
    class Refusing(ByteChatCodec):
        def render_chat(self, messages):
            raise ValueError("roles must alternate")

    with pytest.raises(InvalidRequest, match="chat template rejects this conversation: roles must"):
        PromptEncoder(Refusing()).encode([ChatMessage("user", "hi")], None)


def test_engine_sessions_encode_incrementally_and_metrics_count_it(make_engine):
    engine = make_engine()
    metrics = WorkerMetrics("w", engine.used_bytes, engine.prompts.stats)
    engine.open_session("s", "full", [])
    for text in ("first question", "second question", "third question"):
        engine.submit(TurnRequest("s", (ChatMessage("user", text),), max_new_tokens=4))
        engine.run_until_idle()
    session = engine.sessions["s"]
    assert len(session.transcript) == 6
    tokens, encodes = engine.prompts.stats.snapshot()
    assert encodes == {EncodeMode.FULL: 1, EncodeMode.INCREMENTAL: 2}
    # the cached prefix is the whole conversation so far; the KV was fed the same ids
    assert session.prompt is not None
    assert session.prompt.ids.tolist() == session.fed_ids[: len(session.prompt.ids)]
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert f'confkv_worker_prompt_tokens_encoded_total{{worker="w"}} {float(tokens)}' in text
    assert 'confkv_worker_prompt_encodes_total{mode="incremental",worker="w"} 2.0' in text
    assert 'confkv_worker_prompt_encodes_total{mode="full",worker="w"} 1.0' in text


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from confkv.models import ModelNotFoundError, smollm2_dir

    try:
        return AutoTokenizer.from_pretrained(smollm2_dir())
    except ModelNotFoundError as err:
        pytest.skip(str(err))


@pytest.mark.smollm2
def test_smollm2_tokenizer_incremental_equals_whole_over_many_turns(smollm2_tokenizer):
    codec = HFChatCodec(smollm2_tokenizer)
    encoder = PromptEncoder(codec)
    converse(codec, encoder, turns=40, seed=3)
    assert encoder.stats.snapshot()[1] == {EncodeMode.FULL: 1, EncodeMode.INCREMENTAL: 39}
