"""A tiny random Llama over the byte codec: engine tests without a tokenizer or network."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import byte_llama
from worker_svc.codec import ByteChatCodec
from worker_svc.engine import Engine
from worker_svc.types import EngineConfig


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
