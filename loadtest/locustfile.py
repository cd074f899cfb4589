"""Locust users speaking gRPC to the Conf-KV scheduler, holding agent-like conversations.

Headless against ``confkv serve`` (default 127.0.0.1:50051; needs ``pip install -e .[load]``)::

    locust -f loadtest/locustfile.py --headless --host 127.0.0.1:50051 -u 4 -r 1 -t 2m \
        --policy confkv:int8=1 --max-new-tokens 32 --summary-json reports/locust_summary.json

Each user opens a session and sends the turns of a conversation (pasted Austen pages, tool
results as JSON, follow-up questions about earlier turns), then ends the session and starts a
new one. Per RPC, locust's stats show ``CreateSession``, ``Chat`` (whole turn, response length
= tokens), ``Chat:ttft`` (time to first token) and ``Chat:itl`` (mean inter-token latency of
the turn); failures carry the gRPC status code. ``--summary-json`` adds p50/p95 TTFT and ITL,
aggregate tokens/s and failures per RPC.

``--http-url http://127.0.0.1:8000/v1`` runs the same conversations as ``OpenAIConversationUser``
instead: the official ``openai`` client against the scheduler's OpenAI-compatible HTTP API, the
whole conversation sent each call (the server continues one Conf-KV session per conversation);
stats are named ``POST /v1/chat/completions`` (plus ``:ttft`` and ``:itl``) and failures carry
the HTTP status (``HTTP429``) or the client's error type.

Honest accounting: a user that crashes (``user:<Exception>``, e.g. a missing ``--corpus``) and a
turn still streaming when the run stops (``Chat:UNFINISHED``; it is cancelled, so the server stops
generating it) are failures. The run exits 1 when anything failed or no turn completed. Once the
run (or a ramp-down) stops a user, it starts no new turn: its conversation ends between turns.
"""

from __future__ import annotations

# gevent must patch grpc before any channel exists: locust runs users as greenlets, and a
# blocking grpc call would otherwise freeze every user on the same process.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
from gevent import GreenletExit  # noqa: E402
from locust import User, between, events, task  # noqa: E402
from locust.runners import STATE_CLEANUP, STATE_STOPPED, STATE_STOPPING  # noqa: E402
from locust.user.users import LOCUST_STATE_STOPPING  # noqa: E402

from loadtest.client import SchedulerClient  # noqa: E402
from loadtest.conversations import SYSTEM_PROMPT, ConversationConfig, conversation, load_corpus  # noqa: E402
from loadtest.http_client import OpenAIChatClient  # noqa: E402
from loadtest.metrics import TurnMetrics, summarize  # noqa: E402

_seeds = itertools.count()
_turns: list[TurnMetrics] = []
_failures: Counter[str] = Counter()
_started = time.perf_counter()
_last_summary: dict = {}


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--policy", default="confkv:int8=1", help="policy spec of every session")
    parser.add_argument("--model", default="", help="model name (empty = the server's default)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--page-chars", type=int, default=1200, help="characters per pasted page")
    parser.add_argument(
        "--corpus", default="", help="folder of austen_*.txt (default: confkv.data.sample_corpus())"
    )
    parser.add_argument("--summary-json", default="", help="write TTFT/ITL/tokens-per-second summary here")
    parser.add_argument(
        "--http-url",
        default="",
        help="use the OpenAI HTTP API at this base URL (e.g. http://127.0.0.1:8000/v1)",
    )


@events.init.add_listener
def _choose_users(environment, **_) -> None:
    """gRPC users, or OpenAI-HTTP users with --http-url (one protocol per run)."""
    options = environment.parsed_options
    if options is not None and options.http_url:
        environment.user_classes = [OpenAIConversationUser]
        # load the HTTP client now, not in the users' on_start: a first import in a fresh
        # environment blocks every greenlet for seconds of the run's measured time
        import openai  # noqa: F401


@events.test_start.add_listener
def _reset(environment, **_) -> None:
    global _started
    _turns.clear()
    _failures.clear()
    _started = time.perf_counter()


@events.test_stop.add_listener
def _write_summary(environment, **_) -> None:
    options = environment.parsed_options
    summary = summarize(_turns, dict(_failures), time.perf_counter() - _started)
    summary |= {"policy": options.policy, "users": options.num_users, "host": environment.host}
    _last_summary.clear()
    _last_summary.update(summary)
    print("confkv load summary:", json.dumps(summary))
    if options.summary_json:
        Path(options.summary_json).write_text(json.dumps(summary, indent=1) + "\n")


@events.quitting.add_listener
def _exit_code(environment, **_) -> None:
    """Non-zero when any user crashed, any turn failed or was left unfinished, or none completed."""
    if _last_summary and (_last_summary["failed"] or not _last_summary["turns"]):
        why = "failures" if _last_summary["failed"] else "no turn completed"
        print(f"confkv load test FAILED: {why} ({json.dumps(_last_summary['failures'])})")
        environment.process_exit_code = 1


class TurnUnfinished(Exception):
    """A turn still streaming when the run stopped (it is cancelled on the server)."""

    def __str__(self) -> str:
        return "UNFINISHED"


def failure_code(error: BaseException) -> str:
    """gRPC status name, ``HTTP<status>`` for an HTTP error answer, else the exception's type."""
    if isinstance(error, TurnUnfinished):
        return "UNFINISHED"
    if isinstance(error, grpc.RpcError):
        return error.code().name
    status = getattr(error, "status_code", None)
    return f"HTTP{status}" if isinstance(status, int) else type(error).__name__


class ConversationUser(User):
    """One agent: a session per conversation, turns sent one after another."""

    wait_time = between(0.5, 2.0)
    abstract = False
    protocol = "grpc"  # locust's request_type

    client: SchedulerClient | None = None

    def on_start(self) -> None:
        options = self.environment.parsed_options
        try:
            self.client = SchedulerClient(self.host or "127.0.0.1:50051")
            self.corpus = load_corpus(options.corpus) if options.corpus else load_corpus()
            self.config = ConversationConfig(page_chars=options.page_chars, turns=options.turns)
        except Exception as error:
            self._crashed(error)
            raise

    def on_stop(self) -> None:
        if self.client is not None:
            self.client.close()  # cancels a turn still streaming

    def _stopping(self) -> bool:
        """The run (or a ramp-down) is stopping this user: finish the turn in flight, start none.

        Checked before every call: locust decides to stop a waiting user and kills it a moment
        later, so a user whose wait ends in between would otherwise start a turn only to have it
        cut (and counted unfinished) although the run had already stopped."""
        runner = self.environment.runner
        stopping_run = runner is not None and runner.state in (STATE_STOPPING, STATE_CLEANUP, STATE_STOPPED)
        return stopping_run or self._state == LOCUST_STATE_STOPPING

    def _crashed(self, error: Exception) -> None:
        """A user that dies is a failure of the run, not a silent absence."""
        self._fire("user", time.perf_counter(), error=error)

    def _fire(self, name: str, started: float, length: int = 0, error: Exception | None = None, ms=None):
        elapsed = ms if ms is not None else 1000 * (time.perf_counter() - started)
        events.request.fire(
            request_type=self.protocol, name=name, response_time=elapsed, response_length=length,
            exception=error, context={},
        )  # fmt: skip
        if error is not None:
            _failures[f"{name}:{failure_code(error)}"] += 1

    def _unfinished(self, started: float) -> None:
        self._fire("Chat", started, error=TurnUnfinished("the run stopped during this turn"))

    def _call(self, name: str, fn, *args):
        started = time.perf_counter()
        try:
            result = fn(*args)
        except grpc.RpcError as err:
            self._fire(name, started, error=err)
            return None
        except GreenletExit:  # the run is stopping this user mid-call (the client cancelled it)
            if name == "Chat":
                self._unfinished(started)
            raise
        if name != "Chat":
            self._fire(name, started)
        return result

    @task
    def hold_conversation(self) -> None:
        try:
            self._conversation()
        except Exception as error:  # a bug or bad data in a user: count it, then let locust log it
            self._crashed(error)
            raise

    def _conversation(self) -> None:
        assert self.client is not None
        options = self.environment.parsed_options
        if self._stopping():
            return
        session = self._call("CreateSession", self.client.create_session, options.policy, options.model)
        if session is None:
            return
        for turn in conversation(self.corpus, next(_seeds), self.config):
            if self._stopping():
                break
            reply = self._call("Chat", self.client.chat, session, turn, options.max_new_tokens)
            if reply is None:
                break
            metrics = reply.metrics
            _turns.append(metrics)
            self._fire("Chat", time.perf_counter(), metrics.tokens, ms=1000 * metrics.seconds)
            if metrics.ttft_s is not None:
                self._fire("Chat:ttft", 0.0, ms=1000 * metrics.ttft_s)
            if metrics.itl_s:
                self._fire("Chat:itl", 0.0, ms=1000 * sum(metrics.itl_s) / len(metrics.itl_s))
        self._call("EndSession", self.client.end_session, session)


class OpenAIConversationUser(ConversationUser):
    """The same agent over the OpenAI HTTP API (chosen with --http-url): no session calls; every
    completion carries the conversation so far, as an agent framework sends it."""

    abstract = True  # not discovered on its own: _choose_users picks it
    protocol = "http"
    CHAT = "POST /v1/chat/completions"

    def on_start(self) -> None:
        options = self.environment.parsed_options
        try:
            self.http = OpenAIChatClient(options.http_url)
            self.model = options.model or self.http.default_model()
            self.corpus = load_corpus(options.corpus) if options.corpus else load_corpus()
            self.config = ConversationConfig(page_chars=options.page_chars, turns=options.turns)
        except Exception as error:
            self._crashed(error)
            raise

    def on_stop(self) -> None:
        if getattr(self, "http", None) is not None:
            self.http.close()

    def _conversation(self) -> None:
        import openai

        options = self.environment.parsed_options
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for turn in conversation(self.corpus, next(_seeds), self.config):
            if self._stopping():
                return
            messages.append({"role": turn.role, "content": turn.content})
            started = time.perf_counter()
            try:
                reply = self.http.chat(messages, self.model, options.policy, options.max_new_tokens)
            except openai.OpenAIError as err:
                self._fire(self.CHAT, started, error=err)
                return
            except GreenletExit:
                self._fire(self.CHAT, started, error=TurnUnfinished("the run stopped during this turn"))
                raise
            messages.append({"role": "assistant", "content": reply.text})
            metrics = reply.metrics
            _turns.append(metrics)
            self._fire(self.CHAT, started, metrics.tokens, ms=1000 * metrics.seconds)
            if metrics.ttft_s is not None:
                self._fire(f"{self.CHAT}:ttft", 0.0, ms=1000 * metrics.ttft_s)
            if metrics.itl_s:
                self._fire(f"{self.CHAT}:itl", 0.0, ms=1000 * sum(metrics.itl_s) / len(metrics.itl_s))
