"""``python -m confkv.bench_decode`` with the cold tier's capacity growth as it was before stop 35:
doubling, at least 8 page slots, not capped by the pages of positions seen. Kept to measure what
the fix changed (reports/cold_alloc_before.*); run from the repository root with bench_decode's
arguments, e.g. ``python reports/scripts/bench_decode_old_cold_growth.py --contexts 2048,8192
--steps 8 --repeats 1 --policies "..." --out reports --name cold_alloc_before``."""

from __future__ import annotations

import sys

import confkv.cold as cold
from confkv.bench_decode import main

_grow = cold.ColdStore._grow


def _old_grow(self: cold.ColdStore, need: int, pages_seen: int) -> None:
    _grow(self, need, 1 << 62)  # no cap: max(need, 2 * capacity, 8), as before


if __name__ == "__main__":
    cold.ColdStore._grow = _old_grow  # type: ignore[method-assign]
    sys.argv = ["bench_decode", *sys.argv[1:]]
    raise SystemExit(main())
