"""Conf-KV attention kernels (installed as ``confkv_kernels``, never as a top-level ``kernels``).

HuggingFace ships a package called ``kernels`` that transformers probes for; this folder is
mapped to the import name ``confkv_kernels`` in pyproject.toml so the two can never be confused.

Public API (same signature for the Triton path and the PyTorch reference):
  decode_attention, chunk_attention, quantize_int8 -- dispatched by ``Backend``.
"""

if __name__ != "confkv_kernels":  # found as top-level ``kernels`` via the repo root on sys.path
    from confkv_kernels._shadow import step_aside

    step_aside(__name__)

from confkv_kernels.dispatch import (  # noqa: E402
    Backend,
    chunk_attention,
    decode_attention,
    default_backend,
    gather_pages,
    page_scores,
    quantize_int8,
    scatter_pages,
    summarize_pages,
)

__all__ = [
    "Backend",
    "chunk_attention",
    "decode_attention",
    "default_backend",
    "gather_pages",
    "page_scores",
    "quantize_int8",
    "scatter_pages",
    "summarize_pages",
]
