"""KV geometry of a model and exact/upper-bound byte arithmetic.

Units: ``*_bytes`` are bytes, ``n``/budgets are tokens. One token of one layer stores a key and
a value for every KV head: FP = 2 * Hkv * D * itemsize; INT8 = 2 * Hkv * (D + 2) (payload plus
one float16 scale per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 2  # float16 per-(head, token) scale


@dataclass(frozen=True)
class KVGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVGeometry.{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config, dtype: torch.dtype = torch.float32) -> KVGeometry:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_layers = getattr(text, "num_hidden_layers", None) or text.n_layer
        n_heads = getattr(text, "num_attention_heads", None) or text.n_head
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        hidden = getattr(text, "hidden_size", None) or text.n_embd
        head_dim = getattr(text, "head_dim", None) or hidden // n_heads
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(n_layers, n_kv, head_dim, itemsize)

    @property
    def fp_token_bytes(self) -> int:
        """Bytes of one FP token in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def int8_token_bytes(self) -> int:
        return 2 * self.n_kv_heads * (self.head_dim + SCALE_BYTES)

    def layer_bytes_bound(self, n: int, int8: bool, window: int) -> int:
        """Most bytes a layer holding ``n`` tokens can use (at most ``window`` of them in FP)."""
        if not int8:
            return n * self.fp_token_bytes
        fp = min(n, window)
        return fp * self.fp_token_bytes + (n - fp) * self.int8_token_bytes

    def bytes_bound(self, layer_budgets: list[int], int8: bool, window: int) -> int:
        return sum(self.layer_bytes_bound(n, int8, window) for n in layer_budgets)

    def full_bytes(self, n_tokens: int) -> int:
        """Bytes of an uncompressed cache of ``n_tokens`` tokens (all layers)."""
        return n_tokens * self.fp_token_bytes * self.n_layers
