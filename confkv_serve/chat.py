"""``confkv chat``: a small client that streams turns from a running scheduler (used by ``serve --demo``)."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable, Iterator

from confkv.cli.common import UsageError, check_input_file, token_count

# Appended to a refusal for KV room, so the user knows which knob to turn.
POOL_HINT = (
    "hint: give the worker a bigger pool (confkv serve/worker --kv-pool-bytes 1GiB), choose a bounded "
    "policy (--policy confkv:int8=1), ask for fewer tokens (--max-new-tokens), or cap the context "
    "(confkv worker --max-context N)"
)


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a running scheduler (streams the reply)")
    p.add_argument("message", nargs="*", help="one turn to send (default: read turns from stdin, one a line)")
    p.add_argument("--address", default="127.0.0.1:50051", help="scheduler host:port")
    p.add_argument("--session", help="continue this session id (default: create one)")
    p.add_argument("--policy", default="", help="policy spec for a new session (default: the scheduler's)")
    p.add_argument("--model", default="", help="model for a new session (default: the scheduler's)")
    p.add_argument("--system", default="", help="system prompt for a new session")
    p.add_argument("--max-new-tokens", type=token_count, default=0, help="0 = the scheduler's default")
    p.add_argument("--auth-token-env", default="CONFKV_AUTH_TOKEN", help="env var holding the bearer token")
    p.add_argument("--ca", help="CA certificate to verify the scheduler's TLS (default: plaintext)")
    p.set_defaults(run=run, extras=("serve",))


def stream_turn(client, session_id: str, text: str, max_new_tokens: int, out=sys.stdout, err=sys.stderr):
    """Print the reply as it streams; returns the done event."""
    done = None
    for event in client.chat(session_id, text, max_new_tokens):
        if event.HasField("queued"):
            print(f"[queued: position {event.queued.position}, {event.queued.reason}]", file=err, flush=True)
        elif event.HasField("token"):
            out.write(event.token.text)
            out.flush()
        elif event.HasField("done"):
            done = event
    out.write("\n")
    if done is not None:
        s = done.done.session
        print(
            f"[turn {done.turn} on {done.worker}: {done.done.generated_tokens} tokens, "
            f"KV {s.kv_bytes} bytes now, {s.reserved_bytes} reserved]",
            file=err,
            flush=True,
        )
    return done


def validate(args) -> None:
    """Everything checkable locally, before any remote call (a bad flag never creates a session)."""
    if args.message and not " ".join(args.message).strip():
        raise UsageError("empty message; give some text (or none, to read turns from stdin)")
    if args.policy:
        from confkv.policies import parse_policy

        parse_policy(args.policy)
    if args.ca:
        check_input_file(args.ca, "--ca")
    if args.session is not None and not args.session.strip():
        raise UsageError("empty --session id")


def turns_from(args, stdin: Iterable[str]) -> Iterator[str]:
    """The non-blank turns; raises UsageError when there is none (checked before the session opens)."""
    lines = [" ".join(args.message)] if args.message else (line.rstrip("\n") for line in stdin)
    turns = (text for text in lines if text.strip())
    first = next(turns, None)
    if first is None:
        raise UsageError("no message: stdin held no non-blank line (give a message, or one turn a line)")
    return itertools.chain([first], turns)


def run(args) -> int:
    import grpc

    from scheduler_svc.client import SchedulerClient

    validate(args)
    turns = turns_from(args, sys.stdin)  # waits for the first non-blank line before any remote call
    client = SchedulerClient(args.address, os.environ.get(args.auth_token_env) or None, args.ca)
    try:
        session_id = args.session
        if not session_id:
            session = client.create_session(args.policy, args.model, args.system)
            session_id = session.session_id
            print(f"[session {session_id}: {session.policy} on {session.model}]", file=sys.stderr, flush=True)
        for text in turns:
            stream_turn(client, session_id, text, args.max_new_tokens)
    except grpc.RpcError as error:
        if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            raise ValueError(error.details()) from None
        hint = f"; {POOL_HINT}" if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else ""
        print(f"confkv: error: {error.code().name}: {error.details()}{hint}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
