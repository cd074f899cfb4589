"""oneDNN linears (``confkv.linear``): the same function as ``F.linear`` up to rounding inside the
switch, bit for bit ``F.linear`` outside it, and parameters untouched."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from confkv.linear import OneDNNLinear, active, install, onednn_linears, supported
from tests.helpers import tiny_llama

needs_onednn = pytest.mark.skipif(not supported(), reason="this PyTorch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [(1, 1), (8, 1), (3, 17), (0, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_f_linear(rows, bias):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*rows, 48)
    install(layer)
    assert type(layer) is OneDNNLinear
    with torch.no_grad():
        want = F.linear(x, layer.weight, layer.bias)
        with onednn_linears():
            got = layer(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_outside_the_switch_and_under_autograd_it_is_f_linear_bit_for_bit():
    torch.manual_seed(1)
    layer = nn.Linear(32, 24)
    install(layer)
    x = torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with onednn_linears():
        y = layer(x)  # grad enabled: PyTorch's path, differentiable
        assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
        y.sum().backward()
    assert layer.weight.grad is not None
    with torch.no_grad(), onednn_linears():  # float64: PyTorch's path too
        assert torch.equal(layer.double()(x.double()), F.linear(x.double(), layer.weight, layer.bias))


def test_install_keeps_parameters_tied_and_the_state_dict():
    model = tiny_llama(tie_word_embeddings=True)
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert install(model) == linears > 0
    assert install(model) == linears  # idempotent
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        plain = model(ids).logits
        with onednn_linears():
            fast = model(ids).logits
        assert torch.equal(model(ids).logits, plain)  # the switch is off again
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)


def test_the_switch_is_per_thread_and_nests():
    seen = []
    with onednn_linears():
        assert active() == supported()
        with onednn_linears(False):
            assert not active()
        assert active() == supported()
        worker = threading.Thread(target=lambda: seen.append(active()))
        worker.start()
        worker.join()
    assert seen == [False]
    assert not active()
