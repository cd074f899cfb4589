"""Wire contract of the worker and scheduler services (package ``confkv.v1``).

The ``*_pb2`` / ``*_pb2_grpc`` modules are generated from ``proto/confkv/v1/*.proto`` by
``confkv_proto.build`` (grpcio-tools), on first import if missing or stale. Use them as
``from confkv_proto import worker_pb2, worker_pb2_grpc`` or
``from confkv_proto.confkv.v1 import worker_pb2_grpc``.
"""

from __future__ import annotations

import os
from pathlib import Path

from confkv_proto import build as _build


def _output_root() -> Path:
    """The package folder when writable (source checkout), else a per-user cache folder."""
    here = Path(__file__).resolve().parent
    if os.access(here, os.W_OK):
        return here
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("confkv")) / "proto" / _build.PACKAGE


_root = _output_root()
_build.ensure_generated(_root)
if str(_root) not in __path__:
    __path__.append(str(_root))  # generated sub-packages live in the cache folder

from confkv_proto.confkv.v1 import (  # noqa: E402
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = ["scheduler_pb2", "scheduler_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
