"""Data shipped with the package: a small public-domain sample corpus (well under 1 MB).

``sample_corpus()`` is the folder of ``austen_*.txt`` excerpts the load test, benchmarks, tests and
README examples use, so a clone or an installed wheel never needs ``../shared``; commands take a
file (``--text-file``, ``--haystack``, ``--corpus``) for anything bigger.
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = Path(__file__).resolve().parent  # austen_*.txt sit beside this file (package data)


def sample_corpus() -> Path:
    """The folder holding ``austen_<novel>.txt`` (six opening excerpts, about 48 KB each)."""
    return _CORPUS


def sample_text(novel: str = "persuasion") -> Path:
    """One excerpt, e.g. ``sample_text("emma")`` -> ``.../corpus/austen_emma.txt``."""
    path = _CORPUS / f"austen_{novel}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem.removeprefix("austen_") for p in _CORPUS.glob("austen_*.txt")))
        raise FileNotFoundError(f"no sample text {novel!r}; known: {known}")
    return path


__all__ = ["sample_corpus", "sample_text"]
