"""Models whose attention Conf-KV cannot apply fail when they load; a sliding window bounds the
worker's context instead of failing turns."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from confkv.models import ModelNotFoundError, load_model
from tests.helpers import save_tiny_model
from worker_svc.app import create_engine


def test_a_model_with_soft_capped_attention_fails_when_it_loads(tmp_path):
    folder = save_tiny_model(tmp_path / "gemma2", Gemma2Config, Gemma2ForCausalLM, head_dim=16)
    with pytest.raises(ModelNotFoundError, match="cannot serve model .* soft-capping"):
        load_model(str(folder))


def test_a_sliding_window_bounds_the_workers_context(tmp_path):
    folder = save_tiny_model(tmp_path / "mistral", MistralConfig, MistralForCausalLM, sliding_window=48)
    assert create_engine(str(folder), 1 << 26).config.max_context_tokens == 48
    assert create_engine(str(folder), 1 << 26, max_context_tokens=32).config.max_context_tokens == 32
    with pytest.raises(ValueError, match="--max-context 64 is past .* sliding window of 48"):
        create_engine(str(folder), 1 << 26, max_context_tokens=64)
    plain = save_tiny_model(tmp_path / "llama")
    assert create_engine(str(plain), 1 << 26).config.max_context_tokens == 512


def test_a_turn_on_a_sliding_window_model_stops_at_the_window_instead_of_failing(tmp_path):
    from worker_svc.types import ChatMessage, FinishReason, TurnDone, TurnRequest

    folder = save_tiny_model(tmp_path / "mistral", MistralConfig, MistralForCausalLM, sliding_window=48)
    engine = create_engine(str(folder), 1 << 26)
    engine.open_session("s", "full", [])
    handle = engine.submit(
        TurnRequest("s", (ChatMessage("user", "hi"),), max_new_tokens=200, ignore_eos=True)
    )
    engine.run_until_idle()
    done = list(handle)[-1]
    assert isinstance(done, TurnDone) and done.reason is FinishReason.CONTEXT
    assert engine.sessions["s"].seq.seen_tokens <= 48
