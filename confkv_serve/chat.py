"""``confkv chat``: a small client that streams turns from a running scheduler (used by ``serve --demo``)."""

from __future__ import annotations

import os
import sys

from confkv.cli.common import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a running scheduler (streams the reply)")
    p.add_argument("message", nargs="*", help="one turn to send (default: read turns from stdin, one a line)")
    p.add_argument("--address", default="127.0.0.1:50051", help="scheduler host:port")
    p.add_argument("--session", help="continue this session id (default: create one)")
    p.add_argument("--policy", default="", help="policy spec for a new session (default: the scheduler's)")
    p.add_argument("--model", default="", help="model for a new session (default: the scheduler's)")
    p.add_argument("--system", default="", help="system prompt for a new session")
    p.add_argument("--max-new-tokens", type=positive_int, default=0, help="0 = the scheduler's default")
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


def run(args) -> int:
    import grpc

    from scheduler_svc.client import SchedulerClient

    client = SchedulerClient(args.address, os.environ.get(args.auth_token_env) or None, args.ca)
    try:
        session_id = args.session
        if not session_id:
            session = client.create_session(args.policy, args.model, args.system)
            session_id = session.session_id
            print(f"[session {session_id}: {session.policy} on {session.model}]", file=sys.stderr, flush=True)
        turns = [" ".join(args.message)] if args.message else (line.rstrip("\n") for line in sys.stdin)
        for text in turns:
            if text.strip():
                stream_turn(client, session_id, text, args.max_new_tokens)
    except grpc.RpcError as error:
        if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            raise ValueError(error.details()) from None
        print(f"confkv: error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
