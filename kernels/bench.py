"""Decode/prefill kernel benchmark on a GPU: ``python -m confkv_kernels.bench [--quick]``.

Decode: our INT8-tail + FP16-window kernel (which also returns the per-key attention mass) against
torch SDPA in fp16 over the same number of tokens (no mass, no quantization), contexts 1K-32K,
batch 1-64. Reports microseconds and achieved bandwidth = bytes the kernel must move / time
(ours: INT8 K/V + scales + FP window + q/out + the logits it writes and re-reads + the mass;
SDPA: fp16 K/V + q/out). Chunk: one sequence, M new queries over the context, microseconds and
TFLOP/s (two Q.K^T products, one P.V). Writes reports/kernels_gpu.json and reports/kernels_gpu.md.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_CONTEXTS = (1024, 4096, 8192, 16384, 32768)
_BATCHES = (1, 8, 64)
_REPORTS = Path("reports")


@dataclass(frozen=True)
class Shape:
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    window: int = 512  # recent tokens kept FP16; the rest of the context is INT8


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    context: int
    ours_us: float
    ours_gbps: float
    sdpa_us: float
    sdpa_gbps: float
    max_abs_err: float


@dataclass(frozen=True)
class ChunkRow:
    context: int
    queries: int
    ours_us: float
    ours_tflops: float


def _decode_inputs(shape: Shape, batch: int, context: int, dev: str):
    from confkv_kernels.reference import quantize_int8_ref

    n_fp = min(shape.window, context)
    n_int8 = context - n_fp
    hkv, d = shape.kv_heads, shape.head_dim
    k8, k8s = quantize_int8_ref(torch.randn(hkv, batch * n_int8, d, device=dev, dtype=torch.float16))
    v8, v8s = quantize_int8_ref(torch.randn(hkv, batch * n_int8, d, device=dev, dtype=torch.float16))
    kf = torch.randn(hkv, batch * n_fp, d, device=dev, dtype=torch.float16)
    vf = torch.randn_like(kf)
    q = torch.randn(batch, shape.q_heads, d, device=dev, dtype=torch.float16)
    off8 = torch.arange(batch + 1, device=dev, dtype=torch.int32) * n_int8
    offf = torch.arange(batch + 1, device=dev, dtype=torch.int32) * n_fp
    return q, k8, k8s, v8, v8s, kf, vf, off8, offf


def _decode_bytes(shape: Shape, batch: int, context: int) -> tuple[int, int]:
    n_fp = min(shape.window, context)
    n_int8 = context - n_fp
    hkv, hq, d = shape.kv_heads, shape.q_heads, shape.head_dim
    qo = 2 * batch * hq * d * 2
    ours = batch * hkv * (2 * n_int8 * (d + 2) + 2 * n_fp * d * 2 + context * 4)
    ours += batch * hq * context * 4 * 2 + qo  # logits written in pass 1, read in pass 2
    sdpa = batch * hkv * context * d * 2 * 2 + qo
    return ours, sdpa


def _bench_decode(shape: Shape, batch: int, context: int, dev: str) -> DecodeRow:
    import torch.nn.functional as F
    from confkv_kernels import triton_ops
    from triton.testing import do_bench

    args = _decode_inputs(shape, batch, context, dev)
    scaling = shape.head_dim**-0.5
    ours_ms = do_bench(lambda: triton_ops.decode_attention(*args, scaling))
    err = 0.0
    if batch * context <= 8192:
        from confkv_kernels.reference import decode_attention_ref

        got, want = triton_ops.decode_attention(*args, scaling)[0], decode_attention_ref(*args, scaling)[0]
        err = (got.float() - want.float()).abs().max().item()
    q = torch.randn(batch, shape.q_heads, 1, shape.head_dim, device=dev, dtype=torch.float16)
    k = torch.randn(batch, shape.kv_heads, context, shape.head_dim, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)
    sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    ours_bytes, sdpa_bytes = _decode_bytes(shape, batch, context)
    return DecodeRow(
        batch,
        context,
        ours_ms * 1e3,
        ours_bytes / ours_ms / 1e6,
        sdpa_ms * 1e3,
        sdpa_bytes / sdpa_ms / 1e6,
        err,
    )


def _bench_chunk(shape: Shape, context: int, queries: int, dev: str) -> ChunkRow:
    from confkv_kernels import triton_ops
    from triton.testing import do_bench

    _, k8, k8s, v8, v8s, kf, vf, _, _ = _decode_inputs(
        Shape(shape.q_heads, shape.kv_heads, shape.head_dim, window=queries), 1, context, dev
    )
    q = torch.randn(shape.q_heads, queries, shape.head_dim, device=dev, dtype=torch.float16)
    posf = torch.arange(context - queries, context, device=dev)
    ms = do_bench(
        lambda: triton_ops.chunk_attention(q, k8, k8s, v8, v8s, kf, vf, posf, posf, shape.head_dim**-0.5)
    )
    flops = 3 * 2 * shape.q_heads * queries * context * shape.head_dim
    return ChunkRow(context, queries, ms * 1e3, flops / ms / 1e9)


def _markdown(shape: Shape, decode: list[DecodeRow], chunk: list[ChunkRow], device: str) -> str:
    lines = [
        f"# Conf-KV kernels on {device}",
        "",
        f"Shape: {asdict(shape)}; fp16; command: `python -m confkv_kernels.bench`",
        "",
        "| batch | context | ours us | ours GB/s | SDPA fp16 us | SDPA GB/s | max abs err |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.batch} | {r.context} | {r.ours_us:.1f} | {r.ours_gbps:.0f} | {r.sdpa_us:.1f} | "
        f"{r.sdpa_gbps:.0f} | {r.max_abs_err:.2e} |"
        for r in decode
    ]
    lines += ["", "| chunk context | queries | us | TFLOP/s |", "|---:|---:|---:|---:|"]
    lines += [f"| {r.context} | {r.queries} | {r.ours_us:.1f} | {r.ours_tflops:.1f} |" for r in chunk]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two contexts, two batches")
    parser.add_argument("--out-dir", type=Path, default=_REPORTS)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("confkv_kernels.bench needs CUDA (a GPU); nothing measured.")
        return 0
    torch.manual_seed(0)
    shape, dev = Shape(), "cuda"
    contexts = (1024, 32768) if opts.quick else _CONTEXTS
    batches = (1, 64) if opts.quick else _BATCHES
    decode = []
    for batch in batches:
        for context in contexts:
            decode.append(_bench_decode(shape, batch, context, dev))
            print(decode[-1], flush=True)
            torch.cuda.empty_cache()
    chunk = [_bench_chunk(shape, context, 512, dev) for context in contexts]
    device = torch.cuda.get_device_name()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python -m confkv_kernels.bench" + (" --quick" if opts.quick else ""),
        "shape": asdict(shape),
        "decode": [asdict(r) for r in decode],
        "chunk": [asdict(r) for r in chunk],
    }
    (opts.out_dir / "kernels_gpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    (opts.out_dir / "kernels_gpu.md").write_text(_markdown(shape, decode, chunk, device))
    print(_markdown(shape, decode, chunk, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
