"""The locustfile, run headless for a few seconds against a fake Scheduler on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import pytest

# Only look for locust: importing it monkey-patches this process for gevent, which would break
# the thread-based fake server below.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed (pip install -e .[load])", allow_module_level=True)
grpc = pytest.importorskip("grpc")

from confkv_proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams three tokens per turn; fails every turn of sessions whose policy is 'bad'."""

    def __init__(self):
        self.sessions: dict[str, str] = {}
        self.roles: list[str] = []
        self.cancelled: list[str] = []

    def CreateSession(self, request, context):
        sid = f"s{len(self.sessions)}"
        self.sessions[sid] = request.policy
        return scheduler_pb2.Session(session_id=sid, policy=request.policy)

    def Chat(self, request, context):
        if request.session_id not in self.sessions:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown session")
        self.roles.append(request.role)
        if self.sessions[request.session_id] == "slow":  # a turn that outlives the run
            context.add_callback(lambda: self.cancelled.append(request.session_id))
            for i in range(600):
                time.sleep(0.1)
                yield scheduler_pb2.ChatEvent(token=worker_pb2.TokenChunk(token_id=i, text="x", index=i))
        for i in range(3):
            yield scheduler_pb2.ChatEvent(token=worker_pb2.TokenChunk(token_id=i, text="x", index=i))
        done = worker_pb2.GenerationDone(
            reason=worker_pb2.FINISH_REASON_MAX_TOKENS, text="xxx", generated_tokens=3
        )
        yield scheduler_pb2.ChatEvent(done=done)

    def EndSession(self, request, context):
        return scheduler_pb2.EndSessionReply(ended=self.sessions.pop(request.session_id, None) is not None)


def run_locust(tmp_path, fake, seconds: int, *extra: str):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    summary = tmp_path / "summary.json"
    try:
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
               "--host", f"127.0.0.1:{port}", "-u", "2", "-r", "2", "-t", f"{seconds}s", "--only-summary",
               "--turns", "3", "--page-chars", "200", "--summary-json", str(summary), *extra]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        time.sleep(0.5)  # let the server notice cancelled streams
    finally:
        server.stop(0)
    return done, json.loads(summary.read_text())


def test_locust_headless_against_fake_scheduler(tmp_path):
    fake = FakeScheduler()
    done, result = run_locust(tmp_path, fake, 6)
    assert done.returncode == 0, done.stderr[-2000:]
    assert result["turns"] >= 3 and result["tokens"] == 3 * result["turns"]
    assert result["failed"] == 0 and result["ttft_ms_p50"] is not None and result["itl_ms_p50"] is not None
    assert {"user", "tool"} <= set(fake.roles)
    for name in ("CreateSession", "Chat", "Chat:ttft", "Chat:itl"):
        assert name in done.stderr + done.stdout


def test_a_crashing_user_fails_the_run(tmp_path):
    """Users that die in on_start (no corpus) are failures, and a run with no turn exits non-zero."""
    done, result = run_locust(tmp_path, FakeScheduler(), 3, "--corpus", str(tmp_path / "no-such-corpus"))
    assert done.returncode != 0, done.stdout[-2000:]
    assert result["turns"] == 0
    assert result["failures"].get("user:FileNotFoundError") == 2 and result["failed"] == 2


def test_unfinished_turns_fail_and_are_cancelled(tmp_path):
    """A turn still streaming when the run stops counts as a failure and is cancelled on the server."""
    fake = FakeScheduler()
    done, result = run_locust(tmp_path, fake, 3, "--policy", "slow")
    assert done.returncode != 0
    assert result["turns"] == 0 and result["failures"].get("Chat:UNFINISHED") == 2
    assert len(fake.cancelled) == 2, fake.cancelled


STOPPING_PROBE = """
import json, sys
from types import SimpleNamespace
from locust.env import Environment
from locust.runners import STATE_CLEANUP, STATE_RUNNING
import loadtest.locustfile as lf

class Client:
    def __init__(self): self.calls = []
    def create_session(self, policy, model): self.calls.append("CreateSession"); return "s0"
    def chat(self, session, turn, max_new_tokens):
        self.calls.append("Chat")
        return SimpleNamespace(metrics=lf.TurnMetrics(tokens=1, seconds=0.01, ttft_s=0.01, itl_s=()))
    def end_session(self, session): self.calls.append("EndSession")
    def close(self): pass

options = SimpleNamespace(policy="full", model="", max_new_tokens=2, turns=3, page_chars=200, corpus="")
env = Environment(user_classes=[lf.ConversationUser], parsed_options=options, events=lf.events)
runner = env.create_local_runner()
out = {}
for state in (STATE_RUNNING, STATE_CLEANUP):
    runner.state = state
    user = lf.ConversationUser(env)
    user.client, user.corpus = Client(), lf.load_corpus()
    user.config = lf.ConversationConfig(page_chars=200, turns=3)
    user._conversation()
    out[state] = user.client.calls
print(json.dumps(out))
"""


def test_a_stopping_run_starts_no_turn():
    """Locust decides to stop a waiting user, then kills it a moment later; a user whose wait ends
    in between must not start a turn (it would be cut and counted unfinished, a false failure)."""
    done = subprocess.run([sys.executable, "-c", STOPPING_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    assert calls["running"] == ["CreateSession", "Chat", "Chat", "Chat", "EndSession"]
    assert calls["cleanup"] == []
