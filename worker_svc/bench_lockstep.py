"""Engines taking turns one step at a time: step-time ratios that a noisy machine cannot skew.

Whole runs of a few seconds, even interleaved, see this shared 2-core machine change speed by
10-20% between them. Here each system (an engine and a policy) decodes the same prompts in a
thread of its own (the decode arena and the oneDNN switch are per thread, as in a worker), and
the threads take turns: system A steps, then B, then A again. The k-th decode step of every
system ran within a few hundred milliseconds of the others', so a slow phase hits them alike,
and the median of the per-step ratios measures the engines, not the machine.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass

from worker_svc.engine import Engine
from worker_svc.types import ChatMessage, TurnDone, TurnRequest


@dataclass(frozen=True)
class System:
    name: str
    engine: Engine
    policy: str


def lockstep(systems: list[System], texts: list[str], max_new: int, tag: str) -> dict[str, list[float]]:
    """Every system decodes ``texts`` (greedy, EOS ignored, all submitted at once), one engine
    step per turn, round robin. -> per system, the seconds of each step that decoded every
    sequence (prefill done), in order."""
    steps: dict[str, list[float]] = {s.name: [] for s in systems}
    turn = _Round(len(systems))
    errors: list[BaseException] = []

    def run(i: int) -> None:
        system = systems[i]
        engine = system.engine
        record = steps[system.name]

        def on_step(stats) -> None:
            if stats.batch_size == stats.tokens == len(texts):
                record.append(stats.seconds)

        engine.on_step = on_step
        ids = [f"{tag}-{i}-{j}" for j in range(len(texts))]
        handles = []
        try:
            for sid, text in zip(ids, texts, strict=True):
                engine.open_session(sid, system.policy, [])
                request = TurnRequest(
                    sid, (ChatMessage("user", text),), max_new_tokens=max_new, ignore_eos=True
                )
                handles.append(engine.submit(request))
            busy = True
            while busy:
                turn.wait(i)
                try:
                    busy = engine.step()
                finally:
                    turn.passed(i, stays=busy)
            for handle in handles:
                last = list(handle)[-1]
                if not isinstance(last, TurnDone):
                    raise RuntimeError(f"a benchmark turn failed: {last}")
        except BaseException as err:  # reported by the caller; the other threads go on
            errors.append(err)
            turn.leave(i)
        finally:
            for sid in ids:
                if sid in engine.sessions:
                    engine.drop(sid)
            engine.on_step = None

    threads = [threading.Thread(target=run, args=(i,), name=f"lockstep-{i}") for i in range(len(systems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return steps


class _Round:
    """Whose turn it is: the systems still stepping, in order, and the one that steps next."""

    def __init__(self, n: int):
        self.live = list(range(n))
        self.at = 0
        self.cond = threading.Condition()

    def wait(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.live[self.at] == i)

    def passed(self, i: int, stays: bool) -> None:
        """``i`` took its step: the next system's turn (``i`` leaves the round unless it ``stays``)."""
        with self.cond:
            at = self.live.index(i)
            if stays:
                self.at = (at + 1) % len(self.live)
            else:
                self.live.remove(i)
                self.at = at % len(self.live) if self.live else 0
            self.cond.notify_all()

    def leave(self, i: int) -> None:
        with self.cond:
            if i in self.live:
                self.passed(i, stays=False)  # the condition's lock is reentrant


def ratios(steps: dict[str, list[float]], reference: str) -> dict[str, dict[str, float]]:
    """Per system: median step (ms) and the median over k of reference step k / its step k (>1:
    faster than the reference), over the steps both took."""
    base = steps[reference]
    out = {}
    for name, mine in steps.items():
        pairs = list(zip(base, mine, strict=False))
        out[name] = {
            "step_ms_median": 1000 * statistics.median(mine),
            "steps": len(mine),
            "speed_vs_reference": statistics.median(b / m for b, m in pairs) if pairs else float("nan"),
        }
    return out
