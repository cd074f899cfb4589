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
    turn = threading.Condition()
    state = {"next": 0, "live": list(range(len(systems)))}
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
                with turn:
                    turn.wait_for(lambda: state["live"][state["next"]] == i)
                try:
                    busy = engine.step()
                finally:
                    with turn:
                        live = state["live"]
                        at = live.index(i)
                        if not busy:
                            live.remove(i)
                        state["next"] = (at + (1 if busy else 0)) % len(live) if live else 0
                        turn.notify_all()
            for handle in handles:
                last = list(handle)[-1]
                if not isinstance(last, TurnDone):
                    raise RuntimeError(f"a benchmark turn failed: {last}")
        except BaseException as err:  # reported by the caller; the other threads go on
            errors.append(err)
            with turn:
                if i in state["live"]:
                    at = state["live"].index(i)
                    state["live"].remove(i)
                    state["next"] = at % len(state["live"]) if state["live"] else 0
                turn.notify_all()
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
