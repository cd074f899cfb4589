"""HF ``generate`` integration: a logits processor that feeds confidence into a ConfKVCache.

    cache = ConfKVCache.for_model(model, "confkv:n_high=512,n_low=256")
    model.generate(ids, past_key_values=cache, logits_processor=[ConfidenceProcessor(cache)])

Put it first in the list so it sees the model's raw logits.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from confkv.cache import ConfKVCache


class ConfidenceProcessor(LogitsProcessor):
    def __init__(self, cache: ConfKVCache):
        self.cache = cache
        self.history: list[list[float]] = []  # confidence per step, per batch row

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.history.append(self.cache.observe_logits(scores).tolist())
        return scores
