"""The locustfile, run headless for a few seconds against a fake Scheduler on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
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

    def CreateSession(self, request, context):
        sid = f"s{len(self.sessions)}"
        self.sessions[sid] = request.policy
        return scheduler_pb2.Session(session_id=sid, policy=request.policy)

    def Chat(self, request, context):
        if request.session_id not in self.sessions:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown session")
        self.roles.append(request.role)
        for i in range(3):
            yield scheduler_pb2.ChatEvent(token=worker_pb2.TokenChunk(token_id=i, text="x", index=i))
        done = worker_pb2.GenerationDone(
            reason=worker_pb2.FINISH_REASON_MAX_TOKENS, text="xxx", generated_tokens=3
        )
        yield scheduler_pb2.ChatEvent(done=done)

    def EndSession(self, request, context):
        return scheduler_pb2.EndSessionReply(ended=self.sessions.pop(request.session_id, None) is not None)


def test_locust_headless_against_fake_scheduler(tmp_path):
    fake = FakeScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    summary = tmp_path / "summary.json"
    try:
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
               "--host", f"127.0.0.1:{port}", "-u", "2", "-r", "2", "-t", "6s", "--only-summary",
               "--turns", "3", "--page-chars", "200", "--summary-json", str(summary)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        server.stop(0)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(summary.read_text())
    assert result["turns"] >= 3 and result["tokens"] == 3 * result["turns"]
    assert result["failed"] == 0 and result["ttft_ms_p50"] is not None and result["itl_ms_p50"] is not None
    assert {"user", "tool"} <= set(fake.roles)
    for name in ("CreateSession", "Chat", "Chat:ttft", "Chat:itl"):
        assert name in done.stderr + done.stdout
