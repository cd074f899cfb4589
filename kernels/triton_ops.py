"""Public Triton entry points, same signatures and return types as ``confkv_kernels.reference``.

Each wrapper lives beside its kernel (``triton_decode``, ``triton_chunk``, ``triton_quant``,
``triton_recall`` with the recall-tier ops of ``recall_reference``);
this module only gathers them for ``dispatch``. Importing it needs ``triton``; running it needs
CUDA, or ``TRITON_INTERPRET=1`` (fp16/fp32 only: bf16 ``tl.dot`` is wrong in the interpreter).
"""

from __future__ import annotations

from confkv_kernels.triton_chunk import chunk_attention
from confkv_kernels.triton_decode import decode_attention
from confkv_kernels.triton_quant import quantize_int8
from confkv_kernels.triton_recall import gather_pages, page_scores, scatter_pages, summarize_pages

__all__ = [
    "chunk_attention",
    "decode_attention",
    "gather_pages",
    "page_scores",
    "quantize_int8",
    "scatter_pages",
    "summarize_pages",
]
