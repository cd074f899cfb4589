"""The load-test client sends a request id with every create and turn, and retries an unknown
outcome with the same id: against a scheduler whose first replies are lost, one session and one
recorded turn."""

from __future__ import annotations

from concurrent import futures

import grpc
from confkv_proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

from loadtest.client import SchedulerClient
from loadtest.conversations import Turn


class ForgetfulNetwork(scheduler_pb2_grpc.SchedulerServicer):
    """Does each request's work once (by request id), but the first reply of each kind is lost."""

    def __init__(self):
        self.created: dict[str, str] = {}  # request id -> session
        self.turns: dict[str, str] = {}  # request id -> reply
        self.seen: list[tuple[str, str]] = []

    def CreateSession(self, request, context):
        self.seen.append(("create", request.request_id))
        sid = self.created.setdefault(request.request_id, f"s{len(self.created)}")
        if len(self.seen) == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost")
        return scheduler_pb2.Session(session_id=sid)

    def Chat(self, request, context):
        self.seen.append(("chat", request.request_id))
        first = request.request_id not in self.turns
        text = self.turns.setdefault(request.request_id, f"reply {len(self.turns)}")
        if first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "stream cut after the turn was recorded")
        done = worker_pb2.GenerationDone(reason=worker_pb2.FINISH_REASON_EOS, text=text)
        yield scheduler_pb2.ChatEvent(done=done, replayed=True)


def test_retries_reuse_the_request_id_so_nothing_happens_twice():
    fake = ForgetfulNetwork()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = SchedulerClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        sid = client.create_session("window:n=32")
        reply = client.chat(sid, Turn("followup", "user", "hello"), max_new_tokens=4)
        assert (sid, reply.text, client.retried) == ("s0", "reply 0", 2)
        assert len(fake.created) == 1 and len(fake.turns) == 1
        (create_1, create_2, chat_1, chat_2) = fake.seen
        assert create_1 == create_2 and chat_1 == chat_2 and all(rid for _, rid in fake.seen)
        client.chat(sid, Turn("followup", "user", "again"), max_new_tokens=4)
        assert len(fake.turns) == 2  # a new turn: a new request id
    finally:
        client.close()
        server.stop(0)
