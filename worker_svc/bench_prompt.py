"""Prompt tokenization per turn: incremental (``worker_svc.prompt``) versus a whole encode, on the
turn after a long transcript (issue 11: 120 messages of 30,000 characters, 3.6 MB).

    python -m worker_svc.bench_prompt --model smollm2 --out reports/tokenize

The previous turn's encode is cached (it covered the transcript up to the last user message);
the measured turn brings the assistant's reply and a new user message. Both paths must give the
same ids (checked and reported). Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from worker_svc.codec import HFChatCodec
from worker_svc.prompt import PromptEncoder
from worker_svc.types import ChatMessage


def transcript(messages: int, chars: int, corpus: str) -> list[ChatMessage]:
    """``messages`` alternating user/assistant messages of ``chars`` characters, cut from ``corpus``."""
    text = " ".join(corpus.split()) or "It is a truth universally acknowledged. "
    text = text * (chars // len(text) + 2)
    step = max(1, (len(text) - chars) // messages)
    return [
        ChatMessage("user" if i % 2 == 0 else "assistant", text[i * step % (len(text) - chars) :][:chars])
        for i in range(messages)
    ]


def measure(codec, history: list[ChatMessage], new: ChatMessage, repeats: int) -> dict:
    previous = history[:-1]  # the last turn's conversation: up to the last user message
    conversation = [*history, new]
    encoder = PromptEncoder(codec)
    _, prefix = encoder.encode(previous, None)
    incremental = []
    for _ in range(repeats):
        start = time.perf_counter()
        ids, _ = encoder.encode(conversation, prefix)
        incremental.append(time.perf_counter() - start)
    tokens_before = encoder.stats.snapshot()[0]
    full = []
    for _ in range(repeats):
        start = time.perf_counter()
        whole = codec.encode_chat(conversation)
        full.append(time.perf_counter() - start)
    new_tokens = (tokens_before - len(codec.encode_chat(previous))) // repeats
    return {
        "messages": len(conversation),
        "chars": sum(len(m.content) for m in conversation),
        "prompt_tokens": len(whole),
        "incremental": {"tokens_encoded": new_tokens, "seconds": min(incremental)},
        "full": {"tokens_encoded": len(whole), "seconds": min(full)},
        "speedup": min(full) / min(incremental),
        "identical_ids": ids == whole,
    }


def markdown(result: dict, command: str) -> str:
    inc, full = result["incremental"], result["full"]
    return "\n".join([
        "# Prompt tokenization per turn: incremental vs whole",
        "",
        f"```\n{command}\n```",
        "",
        f"model `{result['model']}`; the turn after {result['messages'] - 1} messages of "
        f"{result['message_chars']:,} characters ({result['chars']:,} characters, "
        f"{result['prompt_tokens']:,} prompt tokens); best of {result['repeats']}.",
        "",
        "| encode | tokens tokenized | seconds |",
        "|---|---|---|",
        f"| incremental (`worker_svc.prompt`) | {inc['tokens_encoded']:,} | {inc['seconds']:.3f} |",
        f"| whole conversation | {full['tokens_encoded']:,} | {full['seconds']:.3f} |",
        "",
        f"{result['speedup']:.0f}x faster; identical ids: {result['identical_ids']}.",
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="tokenizer: smollm2, hub id or folder")
    p.add_argument("--messages", type=int, default=120, help="messages before the new turn")
    p.add_argument("--chars", type=int, default=30_000, help="characters a message")
    p.add_argument("--repeats", type=int, default=3, help="timed encodes of each kind (best is kept)")
    p.add_argument("--corpus", type=Path, help="text to cut messages from (default: the sample excerpt)")
    p.add_argument("--out", type=Path, default=Path("reports/tokenize"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.messages < 2 or args.chars < 1 or args.repeats < 1:
        p.error("--messages must be at least 2, --chars and --repeats at least 1")
    if not args.out.parent.is_dir():
        p.error(f"--out: no folder {args.out.parent}")
    from transformers import AutoTokenizer

    from confkv.data import sample_text
    from confkv.models import ModelNotFoundError, resolve

    try:
        corpus = (args.corpus or sample_text("persuasion")).read_text(encoding="utf-8", errors="ignore")
        codec = HFChatCodec(AutoTokenizer.from_pretrained(resolve(args.model)))
    except (OSError, ModelNotFoundError) as err:
        p.error(str(err).splitlines()[0])
    history = transcript(args.messages + 1, args.chars, corpus)
    result = measure(codec, history[:-1], ChatMessage("user", history[-1].content), args.repeats)
    result |= {"model": args.model, "message_chars": args.chars, "repeats": args.repeats}
    command = "python -m worker_svc.bench_prompt " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result, command.strip()))
    print(markdown(result, command.strip()))
    return 0 if result["identical_ids"] else 1


if __name__ == "__main__":
    sys.exit(main())
