"""Every bad input gets the OpenAI error shape ``{"error": {message, type, param, code}}`` and the
status OpenAI uses (the ``openai`` client raises the matching exception class); auth; a full
admission queue (429); an unreachable store (503); a client that goes away mid-stream."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.errors import StoreUnavailable
from scheduler_svc.store import MemoryStore
from tests.helpers import HTTP_MODEL, printable_byte_llama, start_live

ALICE = "alice-secret"
HI = [{"role": "user", "content": "hi"}]


class SwitchableStore(MemoryStore):
    """An in-memory store that can be switched off like an unreachable Redis."""

    down = False

    def ping(self) -> None:
        if self.down:
            raise StoreUnavailable("session store unavailable (test switch)")

    def get(self, session_id):
        self.ping()
        return super().get(session_id)

    def create(self, record, request_id: str = ""):
        self.ping()
        return super().create(record, request_id)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return printable_byte_llama()


@pytest.fixture(scope="module")
def live(model):
    stack = start_live(model, store=SwitchableStore(), max_body_bytes=4096)
    yield stack
    stack.stop()


def raw(live, path: str, body: bytes | None = None, key: str | None = ALICE, method: str | None = None):
    """(status, parsed JSON body) of one plain HTTP call."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{live.http.url}{path}", data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post(live, payload: dict, key: str | None = ALICE):
    return raw(live, "/v1/chat/completions", json.dumps(payload).encode(), key)


def base(**fields) -> dict:
    return {"model": HTTP_MODEL, "messages": HI, "max_tokens": 2, **fields}


BAD_INPUTS = [
    (base(n=2), 400, "n"),
    (base(messages=[]), 400, "messages"),
    (base(messages=[{"role": "assistant", "content": "prefill"}]), 400, "messages.0"),
    (base(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    (base(messages=[{"role": "user", "content": "   "}]), 400, "messages.0"),
    (base(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400, None),
    (base(temperature=2.5), 400, "temperature"),
    (base(top_p=0, temperature=0.8), 400, "top_p"),
    (base(top_p=1.5, temperature=0.8), 400, "top_p"),
    (base(max_tokens=0), 400, "max_tokens"),
    (base(max_tokens=5000), 400, None),
    (base(seed=-1), 400, "seed"),
    (base(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (base(stop=[""]), 400, "stop"),
    (base(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (base(logprobs=True), 400, "logprobs"),
    (base(kv_policy="nosuch:n=1"), 400, "kv_policy"),
    (base(kv_policy="full:bytes=1"), 400, "kv_policy"),
    (base(model="gpt-4o"), 404, "model"),
    ({"messages": HI}, 400, "model"),
    (
        base(messages=[{"role": "user", "content": "x" * 3000}, {"role": "user", "content": "y" * 2000}]),
        413,
        None,
    ),
]


@pytest.mark.parametrize(("payload", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_openai_error_shape_and_status(live, payload, status, param):
    got, body = post(live, payload)
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (
        error["type"]
        == {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}[status]
    )
    if param is not None:
        assert error["param"] == param


def test_invalid_json_unknown_route_and_wrong_method(live):
    assert raw(live, "/v1/chat/completions", b"{not json")[0] == 400
    status, body = raw(live, "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert raw(live, "/v1/chat/completions", method="GET")[0] == 404


def test_the_openai_client_raises_the_matching_exception(live):
    api = openai.OpenAI(base_url=f"{live.http.url}/v1", api_key=ALICE, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=HTTP_MODEL, messages=HI, n=3)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="nope", messages=HI)


def test_auth_is_required_with_client_tokens(live):
    for key in (None, "wrong-secret", "e2e-worker-secret"):
        status, body = post(live, base(), key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error", key
        assert raw(live, "/v1/models", key=key)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.http.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert raw(live, "/health", key=None)[0] == 200  # open for orchestrators, as the gRPC health


def test_store_down_is_503_then_recovers(live):
    live.store.down = True
    try:
        live.scheduler.check_store()
        status, body = raw(live, "/health", key=None)
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        status, body = post(live, base())
        assert status == 503 and "unavailable" in body["error"]["message"]
    finally:
        live.store.down = False
    live.scheduler.check_store()
    assert raw(live, "/health", key=None)[0] == 200
    assert post(live, base())[0] == 200


def test_full_admission_queue_is_429(model):
    # A pool for exactly one full-context session: a second concurrent turn waits 1 s, then is refused.
    stack = start_live(
        model,
        config=SchedulerConfig(
            default_policy="full", queue_limit=1, admission_timeout_s=1.0, poll_interval_s=0.2
        ),
        kv_pool_bytes=512 * 2048 + 1000,
    )
    try:
        api = openai.OpenAI(base_url=stack.base_url, api_key=ALICE, max_retries=0, timeout=60)
        first = api.chat.completions.create(
            model=HTTP_MODEL, messages=[{"role": "user", "content": "long one"}], max_tokens=1500, stream=True
        )
        next(iter(first))  # the first turn holds the pool
        with pytest.raises(openai.RateLimitError) as info:
            api.chat.completions.create(model=HTTP_MODEL, messages=HI, max_tokens=2)
        assert info.value.response.headers["Retry-After"] == "1"
        first.close()
    finally:
        stack.stop()


def test_client_gone_mid_stream_cancels_the_turn_unrecorded(live):
    api = openai.OpenAI(base_url=f"{live.http.url}/v1", api_key=ALICE, max_retries=0)
    raw_stream = api.chat.completions.with_raw_response.create(
        model=HTTP_MODEL, messages=[{"role": "user", "content": "go on and on"}], max_tokens=1500, stream=True
    )
    sid = raw_stream.headers["X-Confkv-Session-Id"]
    stream = raw_stream.parse()
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + 20
    while live.engine.footprint().active_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.engine.footprint().active_sessions == 0  # the worker stopped generating
    assert live.scheduler.get_session(sid, "alice").record.turns == 0  # nothing recorded
    reply = api.chat.completions.create(
        model=HTTP_MODEL, messages=[{"role": "user", "content": "go on and on"}], max_tokens=2,
        extra_headers={"X-Confkv-Session-Id": sid},
    )  # fmt: skip
    assert reply.model_extra["confkv"]["turn"] == 1
