"""A tiny random Llama over the byte codec: engine tests without a tokenizer or network."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from confkv.attention import enable
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.types import EngineConfig


def byte_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=ByteChatCodec.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    enable(model)
    return model


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return byte_llama()


@pytest.fixture
def make_engine(model):
    def build(**overrides) -> Engine:
        config = EngineConfig(**{"kv_pool_bytes": 1 << 30, "prefill_chunk": 16, **overrides})
        return Engine(model, ByteChatCodec(), config)

    return build
