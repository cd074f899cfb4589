"""Cache policies, one per file, and the spec parser (``name:key=value,...``)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from confkv.policies.attention import AttentionPolicy
from confkv.policies.base import CachePolicy, GatedPolicy
from confkv.policies.confkv import ConfKVPolicy
from confkv.policies.full import FullPolicy
from confkv.policies.h2o import H2OPolicy
from confkv.policies.random_policy import RandomPolicy
from confkv.policies.recency import RecencyPolicy
from confkv.policies.select import TokenStats, select_keep
from confkv.policies.sinks import SinksPolicy
from confkv.policies.window import WindowPolicy

POLICIES: dict[str, type[CachePolicy]] = {
    cls.name: cls
    for cls in (
        FullPolicy,
        WindowPolicy,
        SinksPolicy,
        H2OPolicy,
        RandomPolicy,
        RecencyPolicy,
        AttentionPolicy,
        ConfKVPolicy,
    )
}
MATCHED_RATE = ("random", "recency", "attention", "confkv")


def _convert(name: str, key: str, raw: str, annotation) -> object:
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kind = next(h for h in hints if h is not type(None))
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            value = float(raw)  # accepts 1e6 for byte budgets
            if not value.is_integer():
                raise ValueError
            return int(value)
        return kind(raw)
    except ValueError:
        raise ValueError(f"policy {name!r}: {key}={raw!r} is not a valid {kind.__name__}") from None


# keys of the recall tier (``CachePolicy``): a spec without recall=1 that gives one is a mistake
RECALL_KEYS = ("page", "rtok", "stok", "obs", "hold", "trigger", "rate", "every", "cold_bytes", "vote")


def parse_policy(spec: str) -> CachePolicy:
    """``"confkv:n_high=512,n_low=256"`` -> a validated policy. Raises ValueError with the reason."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty policy spec; expected e.g. 'window:n=512' or 'confkv'")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    cls = POLICIES[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}  # values converted to each field's annotated type above
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not raw.strip():
            raise ValueError(f"policy {name!r}: expected key=value, got {item!r}")
        if key not in fields:
            raise ValueError(f"policy {name!r}: unknown key {key!r}; valid keys: {', '.join(sorted(fields))}")
        if key in kwargs:
            raise ValueError(f"policy {name!r}: key {key!r} given twice")
        kwargs[key] = _convert(name, key, raw.strip(), hints[key])
    if kwargs.get("recall"):  # keys the spec leaves out take the policy's recall defaults
        kwargs = {**cls.RECALL_DEFAULTS, **kwargs}
    elif idle := [key for key in RECALL_KEYS if key in kwargs]:  # they would do nothing
        verb = "applies" if len(idle) == 1 else "apply"
        raise ValueError(f"policy {name!r}: {', '.join(idle)} {verb} only with recall=1 (add recall=1)")
    try:
        return cls(**kwargs)
    except TypeError as err:  # pragma: no cover - fields were checked above
        raise ValueError(f"policy {name!r}: {err}") from None


__all__ = [
    "MATCHED_RATE",
    "POLICIES",
    "AttentionPolicy",
    "CachePolicy",
    "ConfKVPolicy",
    "FullPolicy",
    "GatedPolicy",
    "H2OPolicy",
    "RandomPolicy",
    "RecencyPolicy",
    "SinksPolicy",
    "TokenStats",
    "WindowPolicy",
    "parse_policy",
    "select_keep",
]
