"""Shared fixtures: tiny random models (fast unit tests) and the embedded SmolLM2 (integration)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from confkv.attention import enable

VOCAB = 101


def tiny_llama(layers: int = 3, seed: int = 0, vocab: int = VOCAB, **overrides):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **{
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            **overrides,
        }
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


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
