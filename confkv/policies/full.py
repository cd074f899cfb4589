"""``full``: keep every token in the model dtype (the quality ceiling and the memory floor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from confkv.budgets import FixedBudget
from confkv.policies.base import CachePolicy

UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class FullPolicy(CachePolicy):
    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.int8 or self.pyramid or self.bytes is not None:
            raise ValueError("full: keeps everything in the model dtype; int8/pyramid/bytes do not apply")

    def budget_rule(self) -> FixedBudget:
        return FixedBudget(UNBOUNDED)
