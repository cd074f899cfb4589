"""Wiring for a real worker: load the model once, build the engine, start the gRPC server.

In-process use (e.g. ``confkv serve``)::

    engine = create_engine("smollm2", kv_pool_bytes=parse_bytes("256MiB"))
    worker = start_worker(engine, "smollm2", port=0)   # worker.address, worker.stop(grace)
"""

from __future__ import annotations

from confkv.units import parse_size
from worker_svc.codec import HFChatCodec
from worker_svc.engine import Engine
from worker_svc.server import WorkerServer, start_worker
from worker_svc.types import MAX_POOL_BYTES, EngineConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"268435456"``, ``"256MiB"``, ``"1.5GB"``, ``"1e9"`` -> bytes (> 0, at most ``MAX_POOL_BYTES``)."""
    size = parse_size(text, _UNITS)
    if size is None:
        raise ValueError(f"not a byte size: {text!r} (examples: 268435456, 256MiB, 2GB)")
    if size > MAX_POOL_BYTES:  # pools are reported as int64; 1e400 reads as infinity, also larger
        raise ValueError(f"byte size too large: {text!r} (at most {MAX_POOL_BYTES} bytes)")
    value = int(size)
    if value <= 0:
        raise ValueError(f"byte size must be positive, got {text!r}")
    return value


def create_engine(
    model_name: str, kv_pool_bytes: int, device: str = "auto", dtype: str = "auto", **config
) -> Engine:
    """Load ``model_name`` (``smollm2``, hub id or folder) on ``device`` and build an engine.

    device ``auto`` = CUDA when available (Triton kernels) else CPU; dtype ``auto`` = bf16 on
    CUDA, fp32 on CPU.
    """
    import torch

    from confkv.models import load_model, sliding_window

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    dtypes = {
        "auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }
    if dtype not in dtypes:
        raise ValueError(f"--dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    model, tokenizer = load_model(model_name, dtype=dtypes[dtype], device=device)
    limit = int(getattr(model.config, "max_position_embeddings", None) or 8192)
    if (window := sliding_window(model.config)) is not None:  # no window mask: no context past it
        if config.get("max_context_tokens", 0) > window:
            raise ValueError(
                f"--max-context {config['max_context_tokens']} is past {model_name!r}'s sliding window of "
                f"{window} tokens, which Conf-KV attention does not apply"
            )
        limit = min(limit, window)
    config.setdefault("max_context_tokens", limit)
    return Engine(model, HFChatCodec(tokenizer), EngineConfig(kv_pool_bytes=kv_pool_bytes, **config))


__all__ = ["WorkerServer", "create_engine", "parse_bytes", "start_worker"]
