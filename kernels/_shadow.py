"""Keep this folder from posing as HuggingFace's ``kernels`` package.

The folder is installed as ``confkv_kernels``, but whenever the repository root is on ``sys.path``
(``python -c``/``-m`` or ``python -m pytest`` run from the checkout) Python also finds it as a
top-level ``kernels``, the name transformers probes and imports for its hub kernels. When that
happens ``kernels/__init__.py`` calls ``step_aside``: the import resolves to the real package if
one is installed further down ``sys.path``, otherwise to an empty stub without ``__file__``, which
transformers treats as "not installed" (the way it treats a stray namespace folder).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

_FOLDER = Path(__file__).resolve().parent


def _finds_this_folder(entry: str) -> bool:
    try:
        return (Path(entry or ".").resolve() / _FOLDER.name) == _FOLDER
    except OSError:
        return False


def step_aside(name: str) -> None:
    """Swap ``sys.modules[name]`` (this folder under the wrong name) for the real package or a stub."""
    other_entries = [entry for entry in sys.path if not _finds_this_folder(entry)]
    spec = importlib.machinery.PathFinder.find_spec(name, other_entries)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    stub = types.ModuleType(name, f"Not HuggingFace's {name!r}: {_FOLDER} is imported as confkv_kernels.")
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # like a namespace folder
    stub.__spec__.submodule_search_locations = []
    stub.__path__ = []
    sys.modules[name] = stub
