"""The OpenAI-compatible front door on loopback, driven by the real ``openai`` client: completions
streamed and not, usage and cached tokens, an agent loop that reuses its session, explicit
session ids, stop sequences, principals shared with gRPC."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from scheduler_svc.client import SchedulerClient
from tests.helpers import HTTP_MODEL, printable_byte_llama, start_live
from worker_svc.codec import ByteChatCodec
from worker_svc.types import ChatMessage

ALICE, BOB = "alice-secret", "bob-secret"
SESSION = "X-Confkv-Session-Id"


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(1)
    stack = start_live(printable_byte_llama())
    yield stack
    stack.stop()


def client(live, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def prompt_tokens(messages: list[dict]) -> int:
    """What the worker feeds for this conversation (the byte codec's chat encoding)."""
    return len(ByteChatCodec().encode_chat([ChatMessage(m["role"], m["content"]) for m in messages]))


def test_non_streamed_completion_usage_and_extension(live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    raw = client(live).chat.completions.with_raw_response.create(
        model=HTTP_MODEL, messages=messages, max_tokens=6
    )
    reply = raw.parse()
    choice = reply.choices[0]
    assert (
        reply.object == "chat.completion" and reply.model == HTTP_MODEL and reply.id.startswith("chatcmpl-")
    )
    assert choice.message.role == "assistant" and len(choice.message.content) == 6
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert usage.prompt_tokens == prompt_tokens(messages)
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details.cached_tokens == 0  # a new session reads everything once
    ext = reply.model_extra["confkv"]
    assert ext["session_id"] == raw.headers[SESSION] and ext["new_session"] is True
    assert ext["policy"] == "full" and ext["turn"] == 1 and ext["kv_bytes"] > 0
    stored = live.scheduler.get_session(ext["session_id"], "alice").record
    assert [(m.role, m.content) for m in stored.transcript] == [
        ("system", "Be brief."),
        ("user", "Hello there"),
        ("assistant", choice.message.content),
    ]


def test_nucleus_sampling_reaches_the_worker(live):
    """top_p travels HTTP -> scheduler -> worker: a nucleus too small for a second token makes a
    hot sampled reply equal the greedy one (two principals: two fresh sessions)."""
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    greedy = client(live).chat.completions.create(model=HTTP_MODEL, messages=messages, max_tokens=8)
    nucleus = client(live, BOB).chat.completions.create(
        model=HTTP_MODEL, messages=messages, max_tokens=8, temperature=2.0, top_p=1e-6, seed=5
    )
    assert nucleus.choices[0].message.content == greedy.choices[0].message.content


def test_streamed_equals_non_streamed_and_reports_usage(live):
    messages = [{"role": "user", "content": "Stream me something"}]
    plain = client(live).chat.completions.create(model=HTTP_MODEL, messages=messages, max_tokens=7)
    stream = client(live).chat.completions.create(
        model=HTTP_MODEL, messages=messages, max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # greedy, same prompt, same cache state
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert finishing[0].model_extra["confkv"]["session_id"] != plain.model_extra["confkv"]["session_id"]


def test_stream_without_include_usage_carries_usage_on_the_finishing_chunk(live):
    stream = client(live).chat.completions.create(
        model=HTTP_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3


def test_agent_loop_reuses_its_session_and_cache(live):
    """An unchanged agent loop: every call resends the whole conversation. Turns 2..N continue
    the first call's session, and the worker reads only the new message each time."""
    api = client(live)
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Step one."}]
    sessions, previous = [], None
    for step in range(5):
        raw = api.chat.completions.with_raw_response.create(model=HTTP_MODEL, messages=messages, max_tokens=5)
        reply = raw.parse()
        usage, ext = reply.usage, reply.model_extra["confkv"]
        sessions.append(raw.headers[SESSION])
        assert usage.prompt_tokens == prompt_tokens(messages)
        if previous is None:
            assert usage.prompt_tokens_details.cached_tokens == 0 and ext["new_session"]
        else:
            # everything fed before (the whole previous prompt and the reply, but its last token)
            cached = previous.prompt_tokens + previous.completion_tokens - 1
            assert usage.prompt_tokens_details.cached_tokens == cached and not ext["new_session"]
            # read this turn: the reply's last token and end, the user role, the new text and its
            # end, the assistant role; never the conversation before it
            assert usage.prompt_tokens - cached == len(messages[-1]["content"]) + 5
        assert ext["turn"] == step + 1
        previous = usage
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"Result {step}."},
        ]
    assert len(set(sessions)) == 1
    record = live.scheduler.get_session(sessions[0], "alice").record
    assert record.turns == 5 and len(record.transcript) == 11
    seq = live.engine.sessions[sessions[0]].seq
    assert seq.seen_tokens == previous.prompt_tokens + previous.completion_tokens - 1  # read once


def test_changed_history_or_other_principal_opens_a_new_session(live):
    messages = [{"role": "user", "content": "Branch point"}]
    first = client(live).chat.completions.create(model=HTTP_MODEL, messages=messages, max_tokens=4)
    sid = first.model_extra["confkv"]["session_id"]
    follow = [*messages, {"role": "assistant", "content": first.choices[0].message.content}]
    follow.append({"role": "user", "content": "next"})
    edited = [
        *messages,
        {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "next"},
    ]
    assert client(live).chat.completions.create(model=HTTP_MODEL, messages=edited, max_tokens=2).model_extra[
        "confkv"
    ]["session_id"] not in (sid,)
    other = client(live, BOB).chat.completions.create(model=HTTP_MODEL, messages=follow, max_tokens=2)
    assert other.model_extra["confkv"]["session_id"] != sid and other.model_extra["confkv"]["new_session"]
    mine = client(live).chat.completions.create(model=HTTP_MODEL, messages=follow, max_tokens=2)
    assert mine.model_extra["confkv"]["session_id"] == sid
    different_policy = client(live).chat.completions.create(
        model=HTTP_MODEL,
        messages=[
            *follow,
            {"role": "assistant", "content": mine.choices[0].message.content},
            {"role": "user", "content": "x"},
        ],
        max_tokens=2,
        extra_body={"kv_policy": "window:n=64"},
    )
    ext = different_policy.model_extra["confkv"]
    assert ext["session_id"] != sid and ext["policy"] == "window:n=64" and ext["new_session"]


def test_explicit_session_header(live):
    api = client(live)
    first = api.chat.completions.with_raw_response.create(
        model=HTTP_MODEL, messages=[{"role": "user", "content": "Remember me"}], max_tokens=3
    )
    sid = first.headers[SESSION]
    # only the new message: the session supplies the history
    again = api.chat.completions.with_raw_response.create(
        model=HTTP_MODEL, messages=[{"role": "user", "content": "And now?"}], max_tokens=3,
        extra_headers={SESSION: sid},
    )  # fmt: skip
    assert again.headers[SESSION] == sid and again.parse().usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.ConflictError) as info:
        api.chat.completions.create(
            model=HTTP_MODEL, max_tokens=3, extra_headers={SESSION: sid},
            messages=[{"role": "user", "content": "not it"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "go"}],
        )  # fmt: skip
    assert info.value.body["code"] == "transcript_mismatch"
    for key, session_id in ((BOB, sid), (ALICE, "no-such-session")):
        with pytest.raises(openai.NotFoundError):
            client(live, key).chat.completions.create(
                model=HTTP_MODEL,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={SESSION: session_id},
            )


def test_stop_sequence_cuts_the_reply_and_records_exactly_what_was_returned(live):
    api = client(live)
    messages = [{"role": "user", "content": "Say a long line"}]
    full = api.chat.completions.create(model=HTTP_MODEL, messages=messages, max_tokens=24)
    text = full.choices[0].message.content
    stop = text[6:8]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        response = api.chat.completions.create(
            model=HTTP_MODEL, messages=messages, max_tokens=24, stop=[stop, "\u00a7never"], stream=stream
        )
        if stream:
            chunks = list(response)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish, last = chunks[-1].choices[0].finish_reason, chunks[-1]
        else:
            content, finish, last = (
                response.choices[0].message.content,
                response.choices[0].finish_reason,
                response,
            )
        assert content == expected and finish == "stop"
        assert last.usage.completion_tokens == len(expected) + len(stop)  # one token per byte
        sid = last.model_extra["confkv"]["session_id"]
        stored = live.scheduler.get_session(sid, "alice").record.transcript
        assert stored[-1].content == expected  # the recorded turn is what the client got
        assert live.scheduler.cluster.location(sid) is None  # the worker's uncut copy was dropped
    # the client's next call (with the cut reply) continues that session; the transcript replays once
    follow = [*messages, {"role": "assistant", "content": expected}, {"role": "user", "content": "more"}]
    nxt = api.chat.completions.create(model=HTTP_MODEL, messages=follow, max_tokens=2)
    assert nxt.model_extra["confkv"]["session_id"] == sid
    assert nxt.usage.prompt_tokens_details.cached_tokens == 0 and nxt.usage.prompt_tokens == prompt_tokens(
        follow
    )


def test_http_sessions_are_the_grpc_sessions_of_the_same_principal(live):
    reply = client(live).chat.completions.create(
        model=HTTP_MODEL, messages=[{"role": "user", "content": "shared"}], max_tokens=2
    )
    sid = reply.model_extra["confkv"]["session_id"]
    grpc_client = SchedulerClient(live.grpc.address, ALICE)
    try:
        session = grpc_client.get_session(sid, transcript=True)
        assert [m.content for m in session.transcript] == ["shared", reply.choices[0].message.content]
        text, done = grpc_client.turn(sid, "from grpc", 2)
        assert done.turn == 2
    finally:
        grpc_client.close()


def test_models_and_health(live):
    models = client(live).models.list()
    assert [m.id for m in models.data] == [HTTP_MODEL]
    assert client(live).models.retrieve(HTTP_MODEL).id == HTTP_MODEL
    with pytest.raises(openai.NotFoundError):
        client(live).models.retrieve("gpt-4o")
    with urllib.request.urlopen(f"{live.http.url}/health", timeout=5) as health:  # open: no credentials
        assert health.status == 200
        body = json.loads(health.read())
    assert body["status"] == "ok" and body["workers_healthy"] == 1
