"""Fixtures for the eval harness tests: a tiny random Llama, and one with SmolLM2's tokenizer."""

from __future__ import annotations

import pytest

from confkv.attention import enable
from tests.helpers import tiny_llama


def eval_llama(vocab: int = 128, layers: int = 2, seed: int = 0):
    model = tiny_llama(layers, seed, vocab, max_position_embeddings=2048, tie_word_embeddings=True)
    enable(model)
    return model


@pytest.fixture
def llama():
    return eval_llama()


@pytest.fixture(scope="session")
def chat_tokenizer():
    """SmolLM2's tokenizer (chat template included), loaded from the converted model folder."""
    from transformers import AutoTokenizer

    from confkv.models import cache_root

    folder = cache_root() / "smollm2-135m-instruct"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 tokenizer not converted on this machine (run any confkv command once)")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, chat_tokenizer):
    """A local model folder: tiny random Llama with SmolLM2's tokenizer (for CLI tests)."""
    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    model = eval_llama(vocab=len(chat_tokenizer), layers=2)
    model.config.eos_token_id = chat_tokenizer.eos_token_id
    model.save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def chat_llama(chat_tokenizer):
    return eval_llama(vocab=len(chat_tokenizer), layers=2)
