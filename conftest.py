"""Repository-wide pytest setup that has to run before any test imports ``triton``.

Triton picks interpreter vs compiled mode once, when ``triton.language`` is first imported (which
transformers' model modules already do). Without a GPU the kernel tests need the interpreter, so
the switch is set here, above ``tests/conftest.py`` and every test module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
