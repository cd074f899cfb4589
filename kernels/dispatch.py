"""Choose the Triton path on CUDA and the PyTorch reference elsewhere.

``CONFKV_KERNEL_BACKEND`` (read once at import, an entry point concern) may force
``reference`` or ``triton`` (the latter under ``TRITON_INTERPRET=1`` on a CPU in tests).
"""

from __future__ import annotations

import enum
import os

import torch
from confkv_kernels import recall_reference, reference


class Backend(enum.Enum):
    REFERENCE = "reference"
    TRITON = "triton"


def _forced() -> Backend | None:
    value = os.environ.get("CONFKV_KERNEL_BACKEND", "").strip().lower()
    if not value:
        return None
    try:
        return Backend(value)
    except ValueError:
        raise ValueError(f"CONFKV_KERNEL_BACKEND must be 'reference' or 'triton', got {value!r}") from None


_FORCED = _forced()


def default_backend(device: torch.device) -> Backend:
    if _FORCED is not None:
        return _FORCED
    return Backend.TRITON if device.type == "cuda" else Backend.REFERENCE


def _triton():
    from confkv_kernels import triton_ops  # imported lazily: triton is optional on CPU machines

    return triton_ops


def decode_attention(q, k8, k8s, v8, v8s, kf, vf, offsets8, offsetsf, scaling, backend=None):
    backend = backend or default_backend(q.device)
    impl = _triton().decode_attention if backend is Backend.TRITON else reference.decode_attention_ref
    return impl(q, k8, k8s, v8, v8s, kf, vf, offsets8, offsetsf, scaling)


def chunk_attention(q, k8, k8s, v8, v8s, kf, vf, q_pos, posf, scaling, backend=None):
    backend = backend or default_backend(q.device)
    impl = _triton().chunk_attention if backend is Backend.TRITON else reference.chunk_attention_ref
    return impl(q, k8, k8s, v8, v8s, kf, vf, q_pos, posf, scaling)


def quantize_int8(x, backend=None):
    backend = backend or default_backend(x.device)
    impl = _triton().quantize_int8 if backend is Backend.TRITON else reference.quantize_int8_ref
    return impl(x)


# -- recall tier (cold pages); see ``recall_reference`` for layouts ------------------------------
def summarize_pages(k8, ks, valid, backend=None):
    backend = backend or default_backend(k8.device)
    impl = _triton().summarize_pages if backend is Backend.TRITON else recall_reference.summarize_pages_ref
    return impl(k8, ks, valid)


def page_scores(q, lo8, hi8, sscale, lse, scaling, backend=None):
    backend = backend or default_backend(q.device)
    impl = _triton().page_scores if backend is Backend.TRITON else recall_reference.page_scores_ref
    return impl(q, lo8, hi8, sscale, lse, scaling)


def gather_pages(k8, v8, ks, vs, valid, slots, backend=None):
    backend = backend or default_backend(k8.device)
    impl = _triton().gather_pages if backend is Backend.TRITON else recall_reference.gather_pages_ref
    return impl(k8, v8, ks, vs, valid, slots)


def scatter_pages(k8, v8, ks, vs, valid, slot, offset, tk8, tv8, tks, tvs, backend=None):
    backend = backend or default_backend(k8.device)
    impl = _triton().scatter_pages if backend is Backend.TRITON else recall_reference.scatter_pages_ref
    return impl(k8, v8, ks, vs, valid, slot, offset, tk8, tv8, tks, tvs)
