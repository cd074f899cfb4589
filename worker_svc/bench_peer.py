"""The peers our engine is measured against, on the same prompts in the same process: transformers'
``generate`` (padded batch, sdpa) and, when the installed transformers has it, its continuous
batching ``generate_batch``; plus our engine itself driven the same way. Greedy, EOS ignored.

Every runner takes the prompts already tokenized (the engine's chat encoding, so all systems see
the same ids) and returns a ``Run``: the generated ids per prompt and the wall time.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from confkv.attention import enable
from worker_svc.engine import Engine
from worker_svc.types import ChatMessage, TokenEvent, TurnDone, TurnRequest


@dataclass(frozen=True)
class Run:
    """One system's pass over a workload: ``tokens[i]`` generated for prompt i, in ``seconds``."""

    system: str
    tokens: list[list[int]]
    seconds: float
    peak_kv_bytes: int = 0
    # the engine's steps that decoded every sequence of the workload (prefill done): seconds each
    full_batch_steps: list[float] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds


@contextlib.contextmanager
def hf_attention(model, impl: str = "sdpa") -> Iterator[None]:
    """Run transformers' own attention inside the block; the ``confkv`` function again after."""
    model.set_attn_implementation(impl)
    try:
        yield
    finally:
        enable(model)


@torch.no_grad()
def hf_padded_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> Run:
    """transformers ``generate`` over one left-padded batch (sdpa), exactly ``max_new`` tokens each."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    # EOS ignored: ``eos_token_id=None`` would be filled in from the model's generation config
    # (transformers fills unset fields), so the batch would stop once every row had ended; an
    # id past the vocabulary is never generated
    never = model.get_output_embeddings().weight.shape[0]
    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=never, pad_token_id=pad_id
    )
    with hf_attention(model):
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        seconds = time.perf_counter() - start
    tokens = out[:, width:].tolist()
    if any(len(t) != max_new for t in tokens):
        lengths = sorted({len(t) for t in tokens})
        raise RuntimeError(f"transformers generated {lengths} tokens per row, not {max_new}")
    return Run("hf_generate", tokens, seconds)


def has_continuous_batching(model) -> bool:
    return callable(getattr(model, "generate_batch", None))


@torch.no_grad()
def hf_continuous_batching(model, prompts: list[list[int]], max_new: int, chunk: int) -> Run:
    """transformers ``generate_batch`` (paged cache sized to the workload, ``chunk`` tokens a step)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
    blocks = sum(math.ceil((len(p) + max_new) / page) for p in prompts) + len(prompts)
    cb = ContinuousBatchingConfig(num_blocks=blocks, page_size=page, max_batch_tokens=chunk)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with hf_attention(model):
        start = time.perf_counter()
        out = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=cb,
            max_new_tokens=max_new,
            warmup=False,
        )
        seconds = time.perf_counter() - start
    ordered = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    return Run("hf_generate_batch", [list(o.generated_tokens) for o in ordered], seconds)


def engine_run(engine: Engine, policy: str, texts: list[str], max_new: int, tag: str) -> Run:
    """All ``texts`` submitted at once as new sessions, stepped until every turn is done."""
    peak = [0]
    steps: list[float] = []

    def on_step(stats) -> None:
        peak[0] = max(peak[0], stats.used_bytes)
        if stats.batch_size == stats.tokens == len(texts):
            steps.append(stats.seconds)

    engine.on_step = on_step
    ids = [f"{tag}-{i}" for i in range(len(texts))]
    for sid in ids:
        engine.open_session(sid, policy, [])
    start = time.perf_counter()
    handles = [
        engine.submit(TurnRequest(sid, (ChatMessage("user", t),), max_new_tokens=max_new, ignore_eos=True))
        for sid, t in zip(ids, texts, strict=True)
    ]
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    tokens = []
    for handle in handles:
        events = list(handle)
        if not isinstance(events[-1], TurnDone):
            raise RuntimeError(f"a benchmark turn failed: {events[-1]}")
        tokens.append([e.token_id for e in events if isinstance(e, TokenEvent)])
    for sid in ids:
        engine.drop(sid)
    engine.on_step = None
    return Run(f"engine {policy}", tokens, seconds, peak[0], steps)


@dataclass(frozen=True)
class Arrivals:
    """Time to first token of sessions arriving one at a time while ``background`` others decode."""

    ttft_s: list[float]
    decode_step_s: list[float]  # every step taken while an arrival was prefilling (others' ITL)


def ttft_under_load(
    engine: Engine, policy: str, background: list[str], arriving: list[str], tag: str
) -> Arrivals:
    """Start ``background`` sessions, let them reach decoding, then submit each ``arriving`` prompt
    alone and step until its first token; the arrival is dropped again (the batch stays the same)."""
    steps: list[float] = []
    engine.on_step = lambda stats: steps.append(stats.seconds)
    for i, text in enumerate(background):
        engine.open_session(f"{tag}-bg{i}", policy, [])
        request = TurnRequest(
            f"{tag}-bg{i}", (ChatMessage("user", text),), max_new_tokens=4000, ignore_eos=True
        )
        engine.submit(request)
    while any(s.turn is not None and s.turn.pending for s in engine.sessions.values()):
        engine.step()
    ttft, during = [], []
    for j, text in enumerate(arriving):
        sid = f"{tag}-new{j}"
        engine.open_session(sid, policy, [])
        steps.clear()
        start = time.perf_counter()
        handle = engine.submit(
            TurnRequest(sid, (ChatMessage("user", text),), max_new_tokens=8, ignore_eos=True)
        )
        while handle.events.empty():
            engine.step()
        ttft.append(time.perf_counter() - start)
        during.extend(steps)
        engine.drop(sid)
    for sid in [s for s in engine.sessions if s.startswith(f"{tag}-bg")]:
        engine.drop(sid)
    engine.run_until_idle()
    engine.on_step = None
    return Arrivals(ttft, during)
