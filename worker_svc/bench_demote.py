"""Resuming an idle session after KV-pool pressure: demoted to its cold tier vs released.

    python -m worker_svc.bench_demote --data reports/data/agentconv_dev.jsonl --items 8 \
        --json reports/demote_resume.json

Each agent conversation (chat-format JSONL with an ``answer``, DESIGN.md) runs on the real
engine: one turn reads the conversation up to its last user message, then the session is idle
and one of three things happens to its KV before the final question arrives as a new turn:

- ``kept``: nothing (no pressure, the reference);
- ``demoted``: the worker's answer to pressure for ``recall=1`` sessions: every hot token but
  sinks and the recent window moves to the cold tier; the question is fed on top and its
  prompt-end probe recalls what it asks about;
- ``released``: the KV is freed and the question's turn re-reads the whole conversation.

Reported per condition: answers containing the expected answer, replies identical to ``kept``,
prompt tokens the question's turn fed, its time to first token, hot and cold bytes while idle.
Greedy; the session's own first reply stands in for the conversation's last assistant message.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from worker_svc.engine import Engine
from worker_svc.types import ChatMessage, TokenEvent, TurnDone, TurnRequest

POLICY = "confkv:int8=1,recall=1,n_high=1617,n_low=1415"  # the agent eval's, at window:n=512 bytes
CONDITIONS = ("kept", "demoted", "released")


def _turn(engine: Engine, session_id: str, message: ChatMessage, max_new: int) -> tuple[TurnDone, float]:
    """Run one turn to its end; returns its TurnDone and the seconds to its first token."""
    handle = engine.submit(TurnRequest(session_id, (message,), max_new_tokens=max_new))
    start, first = time.perf_counter(), None
    events: list = []
    while engine.step() or not handle.events.empty():
        while not handle.events.empty():
            events.append(handle.events.get_nowait())
            if first is None and isinstance(events[-1], TokenEvent):
                first = time.perf_counter() - start
    done = events[-1]
    if not isinstance(done, TurnDone):
        raise RuntimeError(f"turn failed: {done}")
    return done, first if first is not None else float("nan")


def run_item(engine: Engine, item: dict, policy: str, max_new: int) -> dict:
    messages = [ChatMessage(m["role"], m["content"]) for m in item["messages"]]
    if messages[-1].role != "user" or len(messages) < 4:
        raise ValueError(f"{item.get('id')}: needs a conversation ending with the user's question")
    last_user = max(i for i, m in enumerate(messages[:-1]) if m.role == "user")
    out: dict = {"id": item.get("id", ""), "answer": item["answer"]}
    for condition in CONDITIONS:
        sid = f"{item.get('id', 'item')}-{condition}"
        engine.open_session(sid, policy, messages[:last_user])
        _turn(engine, sid, messages[last_user], 8)
        session = engine.sessions[sid]
        before = session.nbytes()
        with engine.lock:
            if condition == "demoted":
                engine._make_room(sid)  # exactly what hot-pool pressure does to an idle session
            elif condition == "released":
                engine._evict_idle(sid)
        idle_hot, idle_cold = session.nbytes(), session.cold_nbytes()
        done, ttft = _turn(engine, sid, messages[-1], max_new)
        out[condition] = {
            "reply": done.text,
            "correct": item["answer"].lower() in done.text.lower(),
            "prompt_tokens": done.prompt_tokens,
            "ttft_s": ttft,
            "hot_bytes_before": before,
            "idle_hot_bytes": idle_hot,
            "idle_cold_bytes": idle_cold,
        }
        engine.drop(sid)
    for condition in CONDITIONS[1:]:
        out[condition]["same_as_kept"] = out[condition]["reply"] == out["kept"]["reply"]
    return out


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for condition in CONDITIONS:
        cells = [r[condition] for r in rows]
        summary[condition] = {
            "correct": sum(c["correct"] for c in cells),
            "same_as_kept": sum(c.get("same_as_kept", True) for c in cells),
            "prompt_tokens_median": statistics.median(c["prompt_tokens"] for c in cells),
            "ttft_s_median": statistics.median(c["ttft_s"] for c in cells),
            "idle_hot_bytes_median": statistics.median(c["idle_hot_bytes"] for c in cells),
            "idle_cold_bytes_median": statistics.median(c["idle_cold_bytes"] for c in cells),
        }
    return summary


def markdown(result: dict) -> str:
    n = len(result["items"])
    lines = [
        f"# Resuming an idle session: demoted to cold vs released ({n} items)",
        "",
        f"`{result['command']}`",
        "",
        f"Policy `{result['policy']}`, model {result['model']}, greedy, "
        f"{result['max_new_tokens']} new tokens.",
        "",
        "| condition | correct | reply = kept | question turn fed (median tokens) | TTFT median s "
        "| idle hot MiB | idle cold MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for condition, s in result["summary"].items():
        lines.append(
            f"| {condition} | {s['correct']}/{n} | {s['same_as_kept']}/{n} | {s['prompt_tokens_median']:.0f} "
            f"| {s['ttft_s_median']:.2f} | {s['idle_hot_bytes_median'] / 2**20:.2f} "
            f"| {s['idle_cold_bytes_median'] / 2**20:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker_svc.bench_demote", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--data", type=Path, required=True, help="chat-format JSONL with an 'answer' per item"
    )
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--policy", default=POLICY)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, default=Path("reports/demote_resume.json"))
    args = parser.parse_args(argv)
    if not args.data.is_file():
        print(f"confkv: error: --data {args.data} is not a file", file=sys.stderr)
        return 2
    if args.items <= 0 or args.max_new_tokens <= 0:
        print("confkv: error: --items and --max-new-tokens must be positive", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from worker_svc.app import create_engine

    items = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: args.items]
    engine = create_engine(args.model, 1 << 34, device="cpu")
    rows = []
    for item in items:
        rows.append(run_item(engine, item, args.policy, args.max_new_tokens))
        print(
            json.dumps({k: rows[-1][k]["correct"] for k in CONDITIONS} | {"id": rows[-1]["id"]}), flush=True
        )
    command = "python -m worker_svc.bench_demote " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": command,
        "model": args.model,
        "policy": args.policy,
        "max_new_tokens": args.max_new_tokens,
        "summary": summarize(rows),
        "items": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    args.json.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
