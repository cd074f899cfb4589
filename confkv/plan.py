"""Capacity planning: KV bytes per session and how many sessions fit on an accelerator.

Pure arithmetic, no model weights: a model is its architecture numbers (``ModelSpec``), an
accelerator is a byte count. Per-session KV is the policy's worst case (``peak_bytes_bound``
with every layer's budget capped by the tokens the session can have seen), or, given a trace
from ``confkv generate --trace``, the expected footprint from the observed share of steps that
ran at the high budget. Units: ``*_bytes`` are bytes, ``*_tokens`` are tokens.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from confkv.memory import KVGeometry
from confkv.policies import CachePolicy, GatedPolicy, parse_policy
from confkv.units import parse_size


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a decoder-only transformer (Llama/Qwen/Mistral layout)."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    n_params: int | None = None  # published count; None -> computed from the layout

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {self.name}: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name}: {self.n_heads} heads not divisible by {self.n_kv_heads}")

    def layout_params(self) -> int:
        """Parameters of the Llama layout: embeddings, attention, gated MLP, RMSNorms."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        if self.qkv_bias:
            attn += q + 2 * kv
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embed + self.hidden

    @property
    def params(self) -> int:
        return self.n_params if self.n_params is not None else self.layout_params()

    def geometry(self, kv_dtype_bytes: int) -> KVGeometry:
        return KVGeometry(self.n_layers, self.n_kv_heads, self.head_dim, kv_dtype_bytes)

    @classmethod
    def from_hf_config(cls, path: Path) -> ModelSpec:
        """Read an HF ``config.json`` (or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config {path} not found")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        cfg = cfg.get("text_config", cfg)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                name=path.parent.name or path.stem,
                n_layers=int(cfg["num_hidden_layers"]),
                hidden=hidden,
                n_heads=heads,
                n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
            )
        except KeyError as err:
            raise ValueError(f"{path}: missing {err.args[0]!r}; expected a decoder-only HF config") from None


# Published configs (config.json on the HF hub); their layout parameter counts equal the published
# safetensors counts (tests/test_plan.py checks them).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True, False),
    "llama-3-8b": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, False),
    "mistral-7b": ModelSpec("Mistral-7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, False, False),
    "qwen2.5-7b": ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, True),
    "qwen2.5-32b": ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064, False, True),
}
MODEL_ALIASES = {"smollm2": "smollm2-135m", "llama3-8b": "llama-3-8b", "qwen-32b": "qwen2.5-32b"}

MIB, GIB = 2**20, 2**30
# Memory as ``nvidia-smi`` reports it (MiB) for common accelerators.
ACCELERATORS: dict[str, int] = {
    "h200": 143_771 * MIB,
    "h100-80gb": 81_559 * MIB,
    "a100-80gb": 81_920 * MIB,
    "a100-40gb": 40_960 * MIB,
    "l4": 23_034 * MIB,
}
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "int8": 1, "int4": 0.5,
}  # fmt: skip
_UNITS = {"": 10**9, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def resolve_model(name_or_path: str) -> ModelSpec:
    key = name_or_path.strip().lower()
    key = MODEL_ALIASES.get(key, key)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_dir():
        return ModelSpec.from_hf_config(path)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a config.json path or one of {', '.join(MODEL_PRESETS)}"
    )


def parse_memory(text: str) -> int:
    """``h200``, ``cpu`` (this machine's RAM), ``80GB`` (decimal), ``80GiB``; a bare number is GB."""
    key = text.strip().lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    if key in ("cpu", "cpu-ram", "ram"):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = parse_size(key, _UNITS) or 0
    if not 0 < size <= sys.float_info.max:  # 1e400 reads as infinity, 400 digits as a larger int
        raise ValueError(
            f"memory {text!r}: expected e.g. 80GB, 24GiB, 1e9B or one of {', '.join(ACCELERATORS)}, cpu"
        )
    return int(size)


def dtype_bytes(name: str) -> float:
    if name.lower() not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name.lower()]


@dataclass(frozen=True)
class TraceSummary:
    """What a ``confkv generate --trace`` file says about budgets and bytes."""

    model: str
    policy: str
    steps: int
    high_share: float  # fraction of decode steps at the high budget
    peak_kv_bytes: int
    mean_kv_bytes: float

    @classmethod
    def load(cls, path: Path) -> TraceSummary:
        try:
            data = json.loads(Path(path).read_text())
            # null = unbounded (``full``); older traces hold a huge sentinel instead
            budgets = [2**62 if step["budget"] is None else int(step["budget"]) for step in data["steps"]]
            kv = [int(step["kv_bytes"]) for step in data["steps"]]
            peak = int(data["peak_kv_bytes"])
        except FileNotFoundError:
            raise
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: not a 'confkv generate --trace' file ({err})") from None
        if not budgets:
            raise ValueError(f"{path}: the trace has no decode steps")
        return cls(str(data.get("model")), str(data.get("policy")), len(budgets),
                   _high_share(budgets, data.get("policy")), peak, sum(kv) / len(kv))  # fmt: skip


def _high_share(budgets: list[int], spec: str | None) -> float:
    high = max(budgets)
    if min(budgets) < high:
        return sum(b == high for b in budgets) / len(budgets)
    try:  # one budget all along: high only if it is the policy's n_high
        policy = parse_policy(spec or "")
    except ValueError:
        return 1.0
    if isinstance(policy, GatedPolicy) and policy.bytes is None and high == policy.n_low < policy.n_high:
        return 0.0
    return 1.0


@dataclass(frozen=True)
class PlanRequest:
    model: ModelSpec
    memory_bytes: int
    policy: CachePolicy
    context_tokens: int
    generated_tokens: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    utilization: float = 0.9  # share of memory the serving process may use (weights + KV)
    trace: TraceSummary | None = None

    def __post_init__(self) -> None:
        if self.context_tokens < 0 or self.generated_tokens < 0 or self.total_tokens == 0:
            raise ValueError("context and generated tokens must be >= 0 and not both 0")
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if dtype_bytes(self.kv_dtype) < 1:
            raise ValueError(f"KV dtype {self.kv_dtype} is not supported; use fp32, fp16/bf16 or fp8")
        dtype_bytes(self.weight_dtype)

    @property
    def total_tokens(self) -> int:
        return self.context_tokens + self.generated_tokens


def session_bytes(policy: CachePolicy, geometry: KVGeometry, tokens: int, budget: int | None = None) -> int:
    """Most KV bytes one session holds after ``tokens`` tokens at per-layer budget ``budget``
    (default: the policy's peak). Every layer holds at most the tokens seen so far."""
    if not policy.evicts:
        return geometry.full_bytes(tokens)
    budget = policy.budget_rule().peak if budget is None else budget
    layers = [min(n, tokens) for n in policy.layer_budgets(budget, geometry.n_layers)]
    return geometry.bytes_bound(layers, policy.int8, policy.w)


def make_plan(req: PlanRequest) -> dict:
    """The plan as a JSON-ready dict (see ``format_plan`` for the table)."""
    geometry = req.model.geometry(int(dtype_bytes(req.kv_dtype)))
    policy = req.policy.resolve(geometry)
    weights = int(req.model.params * dtype_bytes(req.weight_dtype))
    pool = int(req.memory_bytes * req.utilization) - weights
    if pool <= 0:
        raise ValueError(
            f"{req.model.name} weights ({weights / GIB:.1f} GiB in {req.weight_dtype}) do not fit in "
            f"{req.utilization:.0%} of {req.memory_bytes / GIB:.1f} GiB"
        )
    full = geometry.full_bytes(req.total_tokens)
    worst = session_bytes(policy, geometry, req.total_tokens)
    out = {
        "model": asdict(req.model) | {"params": req.model.params},
        "memory_bytes": req.memory_bytes,
        "utilization": req.utilization,
        "weight_dtype": req.weight_dtype,
        "kv_dtype": req.kv_dtype,
        "weight_bytes": weights,
        "kv_pool_bytes": pool,
        "policy": policy.spec(),
        "context_tokens": req.context_tokens,
        "generated_tokens": req.generated_tokens,
        "kv_bytes_per_token_full": geometry.full_bytes(1),
        "full_session_bytes": full,
        "full_max_sessions": pool // full,
        "session_bytes_worst": worst,
        "max_sessions_worst": pool // worst,
        "reduction_vs_full": full / worst,
        "host_bytes_per_session": policy.worst_case_cold_bytes(geometry, req.total_tokens),
    }
    if req.trace is not None:
        out["trace"] = asdict(req.trace) | _trace_estimate(req, policy, geometry, pool)
    return out


def _trace_estimate(req: PlanRequest, policy: CachePolicy, geometry: KVGeometry, pool: int) -> dict:
    """Expected footprint from the observed high-budget share. An upper bound on the mean: after
    a low step the cache regrows one token per step, so it rarely reaches n_high again at once."""
    high = session_bytes(policy, geometry, req.total_tokens)
    low_budget = getattr(policy, "n_low", None) if policy.evicts else None
    low = session_bytes(policy, geometry, req.total_tokens, low_budget) if low_budget else high
    assert req.trace is not None  # only called with a trace
    expected = req.trace.high_share * high + (1 - req.trace.high_share) * low
    return {
        "session_bytes_low": low,
        "session_bytes_expected": int(expected),
        "max_sessions_expected": int(pool // expected),
    }


def format_plan(plan: dict) -> str:
    rows = [
        ("model", f"{plan['model']['name']} ({plan['model']['params'] / 1e9:.2f}B params)"),
        ("memory", f"{plan['memory_bytes'] / GIB:.1f} GiB x {plan['utilization']:.0%}"),
        ("weights", f"{_size(plan['weight_bytes'])} ({plan['weight_dtype']})"),
        ("KV pool", _size(plan["kv_pool_bytes"])),
        ("tokens / session", f"{plan['context_tokens']} context + {plan['generated_tokens']} generated"),
        ("KV per token (full)", f"{_size(plan['kv_bytes_per_token_full'])} ({plan['kv_dtype']})"),
        ("full: KV / session", _size(plan["full_session_bytes"])),
        ("full: max sessions", str(plan["full_max_sessions"])),
        (f"{plan['policy']}: KV / session (worst)", _size(plan["session_bytes_worst"])),
        (f"{plan['policy']}: max sessions (worst)", str(plan["max_sessions_worst"])),
        ("reduction vs full", f"{plan['reduction_vs_full']:.2f}x"),
    ]
    if plan.get("host_bytes_per_session"):
        rows.append(("host memory / session (cold tier, worst)", _size(plan["host_bytes_per_session"])))
    if "trace" in plan:
        t = plan["trace"]
        rows += [
            ("trace", f"{t['steps']} steps of {t['policy']}, high-budget share {t['high_share']:.1%}"),
            ("KV / session (expected)", _size(t["session_bytes_expected"])),
            ("max sessions (expected)", str(t["max_sessions_expected"])),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({int(n):,} B)"
    return f"{int(n):,} B"
