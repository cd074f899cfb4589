"""Request models of the OpenAI chat-completions API (pydantic), and their translation to the
scheduler's domain: messages, sampling, stops, the ``kv_policy`` extension.

Accepted as OpenAI documents them: ``messages`` (text content or text parts), ``max_tokens`` /
``max_completion_tokens``, ``temperature`` (0..2), ``top_p``, ``seed``, ``stop``, ``n`` = 1,
``stream`` and ``stream_options.include_usage``. Features this server cannot honour (``n`` > 1,
tools, logprobs, penalties, JSON mode) are refused
with 400 naming the parameter, never silently ignored. Unknown fields are ignored (as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from confkv import limits
from scheduler_svc.domain import Message
from scheduler_svc.http.errors import ApiError
from scheduler_svc.stops import MAX_STOPS

ROLE_MAP = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=limits.MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=limits.MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    # Not supported (refused when set to anything but their neutral value):
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    # Conf-KV extension (openai client: extra_body={"kv_policy": "confkv:int8=1"}).
    kv_policy: str | None = Field(default=None, max_length=512)


@dataclass(frozen=True)
class TurnRequest:
    """A chat-completions call in the scheduler's terms. ``history``: every message before the
    new one (blank ones dropped: they carry no tokens and the store never needs them)."""

    model: str
    history: tuple[Message, ...]
    message: Message
    max_new_tokens: int
    temperature: float
    seed: int
    top_p: float
    stops: tuple[str, ...]
    policy: str
    stream: bool
    include_usage: bool


def _content(message: ChatMessageIn, index: int) -> str:
    if message.tool_calls:
        raise ApiError(400, "tool calls are not supported by this server", f"messages.{index}.tool_calls")
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(
                400, f"only text content parts are supported, got {part.type!r}", f"messages.{index}.content"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if (req.n or 1) > 1:
        raise ApiError(400, "n > 1 is not supported: one choice per request", "n")
    if req.tools or req.functions:
        raise ApiError(400, "tool calling is not supported by this server", "tools")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported by this server", "logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported (use 0 or leave it out)", name)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "only response_format type 'text' is supported", "response_format")


def _temperature(value: float | None) -> float:
    value = 0.0 if value is None else value
    # Below the sampler's floor a temperature is greedy in all but name (logits / T overflow).
    return 0.0 if value < limits.MIN_TEMPERATURE else value


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop sequences", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "a stop sequence must not be empty", "stop")
    return stops


def to_turn(req: ChatCompletionRequest) -> TurnRequest:
    """Validate what pydantic cannot and translate; ``ApiError`` (400) naming the parameter."""
    _refuse_unsupported(req)
    messages = [Message(ROLE_MAP[m.role], _content(m, i)) for i, m in enumerate(req.messages)]
    last = messages[-1]
    if last.role not in limits.TURN_ROLES or not last.content.strip():
        raise ApiError(
            400,
            "the last message must be a non-empty 'user' or 'tool' message (the turn to answer)",
            f"messages.{len(messages) - 1}",
        )
    history = tuple(m for m in messages[:-1] if m.content.strip())
    return TurnRequest(
        model=req.model,
        history=history,
        message=last,
        max_new_tokens=req.max_completion_tokens or req.max_tokens or 0,
        temperature=_temperature(req.temperature),
        seed=req.seed or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
        stops=_stops(req.stop),
        policy=(req.kv_policy or "").strip(),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def validation_error(errors: list[dict]) -> ApiError:
    """A pydantic validation failure as OpenAI reports it: 400, the first offending field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return ApiError(400, message, param, code="invalid_value")
