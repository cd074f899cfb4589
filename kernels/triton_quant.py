"""Triton INT8 quantization: symmetric, one float16 scale per (head, token).

Bit-exact with ``reference.quantize_int8_ref``: the scale is max(amax / 127, 1e-6) rounded to
float16 *before* dividing, the division is correctly rounded (``div_rn``, not the fast
approximate one Triton emits for ``/``) and ties round to even like ``torch.round``.
One program quantizes ``_BLOCK_ROWS`` (head, token) rows; the row is the whole head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_QMAX = 127.0
_MIN_SCALE = 1e-6
_BLOCK_ROWS = 16


@triton.jit
def _round_half_even(y):
    # floor + exact fractional part: floor(y + 0.5) would misround 0.49999997 up.
    low = tl.floor(y)
    frac = y - low
    is_odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _quantize_int8_kernel(
    x_ptr,
    x8_ptr,
    scale_ptr,
    n_rows,
    dim,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)
    offs = rows[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), MIN_SCALE)
    scale = scale.to(tl.float16)
    q = _round_half_even(tl.math.div_rn(x, tl.broadcast_to(scale.to(tl.float32)[:, None], x.shape)))
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(x8_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < n_rows)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (Hkv, N, D) float -> (x8 (Hkv, N, D) int8, scale (Hkv, N) float16)."""
    hkv, n, dim = x.shape
    x = x.contiguous()
    x8 = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty((hkv, n), dtype=torch.float16, device=x.device)
    n_rows = hkv * n
    if n_rows == 0:
        return x8, scale
    grid = (triton.cdiv(n_rows, _BLOCK_ROWS),)
    _quantize_int8_kernel[grid](
        x,
        x8,
        scale,
        n_rows,
        dim,
        QMAX=_QMAX,
        MIN_SCALE=_MIN_SCALE,
        BLOCK_ROWS=_BLOCK_ROWS,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return x8, scale
