"""Conf-KV: confidence-gated KV-cache eviction for long-running LLM agents.

Public API (imported lazily so ``confkv`` CLI start-up stays fast)::

    from confkv import ConfKVCache, ConfidenceProcessor, load_model, parse_policy
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ConfKVCache": "confkv.cache",
    "ConfidenceProcessor": "confkv.processor",
    "load_model": "confkv.models",
    "parse_policy": "confkv.policies",
    "confidence": "confkv.confidence",
    "generate": "confkv.decode",
    "prefill": "confkv.decode",
    "decode_one_token": "confkv.decode",
    "KVGeometry": "confkv.memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'confkv' has no attribute {name!r}")
