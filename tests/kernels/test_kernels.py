"""Triton kernels vs the PyTorch reference (CUDA when present, else TRITON_INTERPRET=1 on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton.language (the repo-root conftest.py does it for a suite run).
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
_INTERPRETED = type(triton.language.zeros).__name__ == "InterpretedFunction"
if os.environ.get("TRITON_INTERPRET") == "1" and not _INTERPRETED:
    pytest.fail(
        "triton.language was imported before TRITON_INTERPRET=1 was set; set it earlier "
        "(conftest.py at the repo root does) or export it",
        pytrace=False,
    )

from confkv_kernels import Backend, reference, triton_ops  # noqa: E402
from confkv_kernels import decode_attention as dispatched_decode  # noqa: E402
from confkv_kernels.triton_decode import decode_attention as decode_with_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[2]
# (out atol, out rtol, mass atol, mass rtol): fp16 output is rounded to fp16 and P.V uses fp16 P.
TOL = {
    torch.float32: (2e-5, 1e-4, 2e-6, 1e-4),
    torch.float16: (3e-3, 5e-3, 2e-4, 2e-3),
    torch.bfloat16: (3e-2, 3e-2, 2e-3, 2e-2),
}
# bf16 tl.dot is wrong in the interpreter: bf16 attention is checked on CUDA only.
ATTN_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _int8(hkv, n, d, gen):
    return reference.quantize_int8_ref(torch.randn(hkv, n, d, generator=gen).to(DEVICE))


def _decode_case(lens8, lensf, kv_heads, groups, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k8, k8s = _int8(kv_heads, sum(lens8), dim, gen)
    v8, v8s = _int8(kv_heads, sum(lens8), dim, gen)
    kf = torch.randn(kv_heads, sum(lensf), dim, generator=gen).to(DEVICE, dtype)
    vf = torch.randn(kv_heads, sum(lensf), dim, generator=gen).to(DEVICE, dtype)
    q = (2 * torch.randn(len(lens8), kv_heads * groups, dim, generator=gen)).to(DEVICE, dtype)
    offsets8 = torch.tensor([0, *lens8], device=DEVICE).cumsum(0)
    offsetsf = torch.tensor([0, *lensf], device=DEVICE).cumsum(0)
    return q, k8, k8s, v8, v8s, kf, vf, offsets8, offsetsf, dim**-0.5


def _assert_matches(got, want, dtype):
    out_atol, out_rtol, mass_atol, mass_rtol = TOL[dtype]
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=out_atol, rtol=out_rtol)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=mass_atol, rtol=mass_rtol)


# Lengths straddle the 64-slot block; sequence 1 has no INT8 part, sequence 2 no FP part.
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=str)
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_matches_reference(dim, groups, dtype):
    args = _decode_case([70, 0, 130], [30, 17, 0], 2 if groups < 8 else 1, groups, dim, dtype)
    _assert_matches(triton_ops.decode_attention(*args), reference.decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged_batch_and_split_k(num_splits):
    # Very different lengths, a sequence with no slots at all, several splits per sequence.
    args = _decode_case([300, 3, 0, 65], [5, 200, 0, 64], 3, 3, 64, torch.float32, seed=1)
    got = decode_with_splits(*args, num_splits=num_splits)
    _assert_matches(got, reference.decode_attention_ref(*args), torch.float32)


def _buffer_view(t):
    """The same values as a prefix view of a larger preallocated buffer (non-contiguous heads)."""
    buf = torch.zeros(t.shape[0], t.shape[1] + 7, *t.shape[2:], dtype=t.dtype, device=t.device)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


@pytest.mark.parametrize("op", ["decode", "chunk"])
def test_accepts_cache_buffer_views(op):
    if op == "decode":
        args = _decode_case([50, 20], [10, 30], 2, 3, 64, torch.float32, seed=5)
        fast, slow = triton_ops.decode_attention, reference.decode_attention_ref
    else:
        args = _chunk_case(50, 40, 16, 2, 3, 64, torch.float32, seed=5)
        fast, slow = triton_ops.chunk_attention, reference.chunk_attention_ref
    views = (args[0], *(_buffer_view(t) for t in args[1:7]), *args[7:])
    assert not views[1].is_contiguous()
    _assert_matches(fast(*views), slow(*args), torch.float32)


def test_decode_through_dispatch():
    args = _decode_case([40], [20], 1, 3, 64, torch.float32, seed=2)
    got = dispatched_decode(*args, backend=Backend.TRITON)
    _assert_matches(got, reference.decode_attention_ref(*args), torch.float32)


def _chunk_case(n8, nf, queries, kv_heads, groups, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k8, k8s = _int8(kv_heads, n8, dim, gen)
    v8, v8s = _int8(kv_heads, n8, dim, gen)
    kf = torch.randn(kv_heads, nf, dim, generator=gen).to(DEVICE, dtype)
    vf = torch.randn(kv_heads, nf, dim, generator=gen).to(DEVICE, dtype)
    q = (2 * torch.randn(kv_heads * groups, queries, dim, generator=gen)).to(DEVICE, dtype)
    # Unordered slots: FP positions follow the INT8 ones in shuffled order; the chunk is the newest.
    posf = (n8 + torch.randperm(nf, generator=gen)).to(DEVICE)
    q_pos = (n8 + nf - queries + torch.randperm(queries, generator=gen)).to(DEVICE)
    if nf == 0:
        q_pos = q_pos + queries  # the chunk's own tokens are not in the cache yet
    return q, k8, k8s, v8, v8s, kf, vf, q_pos, posf, dim**-0.5


@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=str)
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("dim", [64, 128])
def test_chunk_matches_reference(dim, groups, dtype):
    args = _chunk_case(70, 50, 20, 2 if groups < 8 else 1, groups, dim, dtype)
    _assert_matches(triton_ops.chunk_attention(*args), reference.chunk_attention_ref(*args), dtype)


@pytest.mark.parametrize(
    ("n8", "nf", "queries"),
    [(0, 90, 70), (100, 0, 17), (130, 150, 150)],
    ids=["no-int8", "no-fp", "multi-tile"],
)
def test_chunk_edge_cases(n8, nf, queries):
    args = _chunk_case(n8, nf, queries, 1, 3, 64, torch.float32, seed=3)
    _assert_matches(triton_ops.chunk_attention(*args), reference.chunk_attention_ref(*args), torch.float32)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.float32, torch.bfloat16], ids=["fp16", "fp32", "bf16"]
)
@pytest.mark.parametrize("dim", [64, 128])
def test_quantize_is_bit_exact(dim, dtype):
    gen = torch.Generator().manual_seed(4)
    x = 3 * torch.randn(2, 37, dim, generator=gen)
    x[0, 0] = 0.0  # amax 0: the 1e-6 scale floor
    x[1, 0] = 0.25 + 0.5 * torch.arange(dim) % 63.5  # scale 0.5 exactly: every value is a .5 tie
    x[1, 0, 0] = 63.5
    x = x.to(DEVICE, dtype)
    got, want = triton_ops.quantize_int8(x), reference.quantize_int8_ref(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_quantize_empty():
    x8, scale = triton_ops.quantize_int8(torch.zeros(2, 0, 64, device=DEVICE))
    assert x8.shape == (2, 0, 64) and scale.shape == (2, 0) and scale.dtype == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the benchmark would really run")
def test_bench_without_cuda_exits_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "confkv_kernels.bench"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0 and "needs CUDA" in done.stdout


# --- our folder must never pass for HuggingFace's ``kernels`` (transformers probes that name) ---

_PROBE = (
    "import importlib.util, json, sys\n"
    "from transformers.utils import is_kernels_available\n"
    "available = is_kernels_available()\n"
    "import kernels\n"
    "print(json.dumps({'available': available, 'file': getattr(kernels, '__file__', None),\n"
    "                  'ours': hasattr(kernels, 'decode_attention'),\n"
    "                  'confkv_kernels': importlib.util.find_spec('confkv_kernels').origin}))\n"
)


def _probe(cwd: Path, hf_site: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if hf_site is not None:
        env["PYTHONPATH"] = str(hf_site)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )
    if done.returncode != 0 and hf_site is None and "No module named 'kernels'" in done.stderr:
        return {"available": False, "file": None, "ours": False, "missing": True}
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fake_hf_kernels(root: Path) -> Path:
    """A stand-in for the HF ``kernels`` distribution at a version transformers accepts."""
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text("__version__ = '0.18.5'\n")
    meta = root / "kernels-0.18.5.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.18.5\n")
    return root


def test_installed_name_is_not_kernels(tmp_path):
    spec = importlib.util.find_spec("confkv_kernels")
    assert Path(spec.origin).parent == REPO / "kernels"
    elsewhere = _probe(tmp_path, None)  # no repo root on sys.path: the normal installed case
    assert not elsewhere["ours"] and not elsewhere["available"]


@pytest.mark.parametrize("with_hf", [False, True], ids=["no-hf-kernels", "hf-kernels-installed"])
def test_repo_root_does_not_shadow_hf_kernels(tmp_path, with_hf):
    hf_site = _fake_hf_kernels(tmp_path / "site") if with_hf else None
    elsewhere = _probe(tmp_path, hf_site)
    from_root = _probe(REPO, hf_site)  # ``python -c`` from the checkout puts the repo root first
    assert from_root["available"] == elsewhere["available"] == with_hf
    assert not from_root["ours"]
    if with_hf:
        assert from_root["file"] == str(hf_site / "kernels" / "__init__.py")
    else:
        assert from_root["file"] is None
