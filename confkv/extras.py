"""Optional extras (pyproject ``[project.optional-dependencies]``), checked when a command starts.

A command names the extras it needs; a missing one is reported as one line naming the extra
(``pip install 'confkv[eval]'``) with exit code 2 *before* any work, never as a
``ModuleNotFoundError`` after an evaluation ran. Only ``find_spec`` is used: nothing is imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# extra -> the import names it provides (keep in step with pyproject.toml).
EXTRAS: dict[str, tuple[str, ...]] = {
    "eval": ("matplotlib", "scipy"),
    "serve": ("grpc", "grpc_health", "google.protobuf", "redis", "prometheus_client", "fastapi", "uvicorn"),
    "gpu": ("triton",),
    "load": ("locust",),
}


class MissingExtraError(ValueError):
    """An optional extra a command needs is not installed (a usage error: exit code 2)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def missing_modules(extra: str) -> list[str]:
    if extra not in EXTRAS:
        raise KeyError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    return [module for module in EXTRAS[extra] if not _installed(module)]


def require(extras: Iterable[str], what: str) -> None:
    """Raise ``MissingExtraError`` naming the first extra ``what`` needs that is not installed."""
    for extra in extras:
        missing = missing_modules(extra)
        if missing:
            raise MissingExtraError(
                f"{what} needs {', '.join(missing)} (the '{extra}' extra); "
                f"install with pip install 'confkv[{extra}]'"
            )
