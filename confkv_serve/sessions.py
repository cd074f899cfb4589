"""``confkv sessions list|show|delete``: the caller's own sessions on a running scheduler.

Scoped by the caller's token: the scheduler answers only with sessions that token's principal
created (another client's session is "not found"). Retention is the scheduler's ``--retention``.
"""

from __future__ import annotations

import json
import os
import sys

from confkv.cli.common import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("sessions", help="list, show or delete your sessions on a running scheduler")
    p.add_argument("action", choices=["list", "show", "delete"])
    p.add_argument("session_id", nargs="?", help="the session (show, delete)")
    p.add_argument(
        "--id",
        dest="session_id_opt",
        metavar="ID",
        help="the session, as an option: --id=ID also takes an id that begins with '-'",
    )
    p.add_argument("--address", default="127.0.0.1:50051", help="scheduler host:port")
    p.add_argument("--auth-token-env", default="CONFKV_AUTH_TOKEN", help="env var holding your client token")
    p.add_argument("--ca", help="CA certificate to verify the scheduler's TLS (default: plaintext)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run, extras=("serve",))


def run(args) -> int:
    import grpc

    from scheduler_svc.client import SchedulerClient

    if args.session_id and args.session_id_opt:
        raise UsageError("give the session id once: as an argument or as --id")
    args.session_id = args.session_id or args.session_id_opt
    if args.action == "list" and args.session_id:
        raise UsageError("'sessions list' takes no session id")
    if args.action != "list" and not args.session_id:
        raise UsageError(f"'sessions {args.action}' needs a session id")
    client = SchedulerClient(args.address, os.environ.get(args.auth_token_env) or None, args.ca)
    try:
        if args.action == "list":
            return _list(client, args.json)
        if args.action == "show":
            s = client.get_session(args.session_id, transcript=True)
            if args.json:
                print(json.dumps(_summary(s, transcript=True)))
            else:
                print(f"{s.session_id}  {s.policy} on {s.model}  turns={s.turns}  state={s.state}")
                for m in s.transcript:
                    print(f"{m.role}: {m.content}")
            return 0
        client.end_session(args.session_id)
        print(f"deleted {args.session_id}")
        return 0
    except grpc.RpcError as err:
        print(f"confkv: error: {err.code().name.lower()}: {err.details()}", file=sys.stderr)
        return 1 if err.code() != grpc.StatusCode.NOT_FOUND else 2
    finally:
        client.close()


def _list(client, as_json: bool) -> int:
    token, rows = "", []
    while True:
        reply = client.list_sessions(page_size=100, page_token=token)
        rows += [_summary(s) for s in reply.sessions]
        token = reply.next_page_token
        if not token:
            break
    if as_json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['session_id']}  {r['policy']}  turns={r['turns']}  state={r['state']}")
    return 0


def _summary(s, transcript: bool = False) -> dict:
    out = {"session_id": s.session_id, "policy": s.policy, "model": s.model, "turns": s.turns,
           "state": s.state, "updated_ms": s.updated_unix_ms}  # fmt: skip
    if transcript:
        out["transcript"] = [{"role": m.role, "content": m.content} for m in s.transcript]
    return out
