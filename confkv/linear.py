"""The model's linear layers through oneDNN on the CPU, inside the engine's forwards.

PyTorch's CPU ``F.linear`` (an MKL sgemm) is slow at the few rows of a decode batch: on the
2-core EPYC we run on, SmolLM2's 49152 x 576 LM head takes 18.9 ms for 8 rows through
``F.linear`` and 13.3 ms through oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op
Inductor's CPU backend lowers linears to); the 210 linears of the 30 decoder layers take 67 ms
against 64 ms (one thread; 44 against 35 ms on two). oneDNN reads the same dense weights: no
packed copy, tied embeddings stay tied.

``install(model)`` gives every plain ``nn.Linear`` of the model a forward that takes oneDNN's
path while ``onednn_linears()`` is active on the calling thread, and ``F.linear`` otherwise: off
the CPU, for dtypes other than float32, under autograd, or when this PyTorch build has no
oneDNN. The switch is thread-local, so a transformers ``generate`` in the same process (the
benchmark's peer) keeps PyTorch's own path. The reference is ``F.linear``; the two differ by
rounding only (``tests/confkv/test_linear.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class _Switch(threading.local):
    on = False  # every thread starts with PyTorch's path


_LOCAL = _Switch()


@functools.cache
def supported() -> bool:
    """This PyTorch build has oneDNN and its linear op (checked once per process)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (resolving the op is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


def active() -> bool:
    return _LOCAL.on


@contextmanager
def onednn_linears(enabled: bool = True) -> Iterator[None]:
    """Installed linears run through oneDNN inside the block on this thread (``enabled`` and
    ``supported()``); the previous setting comes back after."""
    before = active()
    _LOCAL.on = enabled and supported()
    try:
        yield
    finally:
        _LOCAL.on = before


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) with the switchable forward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            _LOCAL.on
            and input.dtype is torch.float32
            and weight.dtype is torch.float32
            and input.device.type == "cpu"
            and weight.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(input, weight, self.bias, "none", [], "")
        return F.linear(input, weight, self.bias)


def install(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` an ``OneDNNLinear`` in place (idempotent;
    behaviour is unchanged outside ``onednn_linears()``). -> the number of linears it holds."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
        count += isinstance(module, OneDNNLinear)
    return count
