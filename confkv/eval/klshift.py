"""``confkv eval klshift``: how much does dropping old context move the next-token distribution,
and does the model's confidence predict it?

Rows of one batch: ``full`` and ``window:n=K`` (sees only the last K tokens). At every
``every``-th step once the context exceeds K, we record KL(p_full || p_recent_K) and the full
row's confidence, then report Pearson and Spearman r with percentile bootstrap CIs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.cache import ConfKVCache
from confkv.confidence import confidence
from confkv.eval.common import teacher_forced_batch

TARGET_R = -0.5


@dataclass(frozen=True)
class KLShiftConfig:
    recent: int = 256
    every: int = 8
    bootstrap: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.recent < 1:
            raise ValueError(f"klshift: recent (K) must be >= 1, got {self.recent}")
        if self.every < 1:
            raise ValueError(f"klshift: every must be >= 1, got {self.every}")
        if self.bootstrap < 10:
            raise ValueError(f"klshift: bootstrap must be >= 10 resamples, got {self.bootstrap}")


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats for logits (..., V)."""
    logp = torch.log_softmax(logits_p.float(), -1)
    logq = torch.log_softmax(logits_q.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def correlations(x: list[float], y: list[float], resamples: int, seed: int = 0) -> dict:
    """Pearson and Spearman r with 95% percentile bootstrap intervals."""
    import numpy as np
    from scipy import stats

    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 3:
        raise ValueError(f"klshift: only {len(xa)} sampled steps; use more --tokens or a smaller --every")
    out: dict[str, object] = {"n": len(xa), "pearson_r": float(stats.pearsonr(xa, ya)[0])}
    out["spearman_r"] = float(stats.spearmanr(xa, ya)[0])
    rng = np.random.default_rng(seed)
    boot_p, boot_s = [], []
    for _ in range(resamples):
        idx = rng.integers(0, len(xa), len(xa))
        bx, by = xa[idx], ya[idx]
        if bx.std() == 0 or by.std() == 0:
            continue
        boot_p.append(np.corrcoef(bx, by)[0, 1])
        boot_s.append(stats.spearmanr(bx, by)[0])
    out["pearson_ci95"] = [float(v) for v in np.percentile(boot_p, [2.5, 97.5])]
    out["spearman_ci95"] = [float(v) for v in np.percentile(boot_s, [2.5, 97.5])]
    return out


def run_klshift(model, ids: torch.Tensor, config: KLShiftConfig, progress: bool = False) -> tuple[dict, dict]:
    """ids (T,) -> (summary, samples{step, confidence, kl})."""
    cache = ConfKVCache.for_model(model, ["full", f"window:n={config.recent}"])
    samples: dict[str, list] = {"step": [], "confidence": [], "kl": []}

    def hook(step: int, logits: torch.Tensor, _cache: ConfKVCache) -> None:
        context = step + 1  # tokens seen when these logits were produced
        if context > config.recent and (context - config.recent) % config.every == 0:
            samples["step"].append(step)
            samples["confidence"].append(float(confidence(logits[0])))
            samples["kl"].append(float(kl_divergence(logits[0], logits[1])))

    run = teacher_forced_batch(model, cache, ids, on_step=hook, progress=progress, desc="klshift")
    summary = correlations(samples["confidence"], samples["kl"], config.bootstrap, config.seed)
    summary.update(
        recent=config.recent,
        every=config.every,
        mean_kl=float(sum(samples["kl"]) / len(samples["kl"])),
        target_r=TARGET_R,
        met=bool(summary["pearson_r"] <= TARGET_R),
        peak_kv_bytes=int(run.peak_bytes[1]),
        mean_kv_bytes=float(run.mean_bytes[1]),
        full_peak_kv_bytes=int(run.peak_bytes[0]),
        seconds=run.seconds,
    )
    return summary, samples
