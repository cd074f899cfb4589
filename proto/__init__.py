"""Wire contract of the worker and scheduler services (package ``confkv.v1``).

Folder ``proto/`` = import name ``confkv_proto`` (mapped in pyproject.toml, like ``kernels/`` =
``confkv_kernels``): a top-level ``proto`` would collide with proto-plus's ``proto`` package.

The ``*_pb2`` / ``*_pb2_grpc`` modules are generated from ``proto/confkv/v1/*.proto`` at build
time (``pip install``, ``make setup`` / ``make proto``, or ``python proto/build.py``), never on
import. Use them as ``from confkv_proto import worker_pb2, worker_pb2_grpc`` (checked: a missing
or stale generation raises ``ImportError`` saying how to regenerate) or
``from confkv_proto.confkv.v1 import worker_pb2_grpc``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from confkv_proto.confkv.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = ["scheduler_pb2", "scheduler_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
_checked = False


def check_generated() -> None:
    """Raise ``ImportError`` when the generated code is missing or does not match the .proto files."""
    global _checked
    if _checked:
        return
    from confkv_proto import build

    reason = build.staleness(Path(__file__).resolve().parent)
    if reason:
        raise ImportError(
            f"confkv_proto: the generated gRPC code is {reason}; regenerate it with "
            "`make proto` (or `python proto/build.py`, or reinstall: pip install -e '.[serve]')"
        )
    _checked = True


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'confkv_proto' has no attribute {name!r}")
    check_generated()
    module = importlib.import_module(f"confkv_proto.confkv.v1.{name}")
    globals()[name] = module
    return module
