"""Sizes written by people (``256MiB``, ``1.5GB``, ``1e9``), read one way for every command.

``confkv plan --memory`` and the worker's pool flags differ only in their units (a bare number is
GB for one, bytes for the other) and in the range they accept, so both read through here."""

from __future__ import annotations

import re
from collections.abc import Mapping

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, units: Mapping[str, int]) -> int | float | None:
    """The size ``text`` names, ``units`` mapping a lower-case suffix ("" for none) to its
    multiplier; None when it is not a number with one of those suffixes. Whole numbers stay exact
    ints; anything else is a float, infinity for ``1e400``, so callers check the range."""
    match = _SIZE.fullmatch(str(text))
    if match is None or (unit := match.group(2).lower()) not in units:
        return None
    number = match.group(1)
    return (int(number) if number.isdigit() else float(number)) * units[unit]
