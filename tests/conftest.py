"""Shared fixtures: tiny random models (fast unit tests) and the embedded SmolLM2 (integration)."""

from __future__ import annotations

import pytest
import torch

from confkv.attention import enable
from tests.helpers import VOCAB, tiny_gpt2, tiny_llama


@pytest.fixture(params=["llama", "gpt2"])
def tiny_model(request):
    model = tiny_llama() if request.param == "llama" else tiny_gpt2()
    enable(model)
    return model


@pytest.fixture(scope="session")
def smollm2():
    from confkv.models import load_model

    torch.set_num_threads(2)
    return load_model("smollm2")


@pytest.fixture
def token_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (1, 300), generator=g)
