"""The one module of shared test builders: tiny models, reference logits, fake workers, real
processes and Redis helpers. Test modules import from here (or use conftest fixtures), never
from another test module."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from confkv.memory import KVGeometry
from confkv.policies import parse_policy
from scheduler_svc.domain import Message, TokenEvent, TurnResult, WorkerReport
from scheduler_svc.errors import NotFound, WorkerRefused, WorkerUnavailable
from scheduler_svc.placement import reservation_bytes

# --- Tiny random models (fast unit tests) ---

VOCAB = 101


def tiny_llama(layers: int = 3, seed: int = 0, vocab: int = VOCAB, **overrides):
    return tiny_causal_lm(LlamaConfig, LlamaForCausalLM, layers, seed, vocab, **overrides)


def tiny_causal_lm(config_cls, model_cls, layers: int = 2, seed: int = 0, vocab: int = VOCAB, **overrides):
    """A tiny random decoder of any transformers architecture (GQA 4/2, hidden 64)."""
    torch.manual_seed(seed)
    cfg = config_cls(
        **{
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            **overrides,
        }
    )  # fmt: skip
    return model_cls(cfg).eval()


def tiny_gpt2(layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


# --- Reference attention: what a cache must reproduce ---


def banded_mask(t: int, n: int, sinks: int = 0) -> torch.Tensor:
    """Additive (1, 1, T, T) mask: token i sees j in (i-n+sinks, i] and the first ``sinks`` tokens."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    ok = (j <= i) & ((j > i - n + sinks) | (j < sinks))
    return torch.zeros(t, t).masked_fill(~ok, float("-inf"))[None, None]


def reference_logits(model, ids, mask=None):
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits
    finally:
        model.set_attn_implementation(impl)


# --- In-process fake workers for the scheduler's transport-free tests ---

GEOMETRY = KVGeometry(n_layers=2, n_kv_heads=2, head_dim=8, dtype_bytes=4)  # 128 B per token (FP)
MAX_CONTEXT = 256


def reply_for(transcript: list[Message]) -> str:
    """Deterministic reply: depends on the whole transcript, so a replay is checkable."""
    last = transcript[-1].content
    return f"echo{len(transcript)} " + " ".join(reversed(last.split()))


class FakeWorker:
    def __init__(self, address: str, capacity_bytes: int, model: str = "tiny") -> None:
        self.address, self.capacity, self.model = address, capacity_bytes, model
        self.sessions: dict[str, dict] = {}
        self.dead = False
        self.opens = 0
        self.gate: threading.Event | None = None  # when set, turns wait on it after the first token
        self.running: set[str] = set()
        self._lock = threading.Lock()

    def _alive(self) -> None:
        if self.dead:
            raise WorkerUnavailable(f"{self.address} is down")

    def used(self) -> int:
        return sum(s["bytes"] for s in self.sessions.values())

    def report(self) -> WorkerReport:
        self._alive()
        with self._lock:
            per = {sid: s["bytes"] for sid, s in self.sessions.items()}
        return WorkerReport(
            self.address, self.model, GEOMETRY, MAX_CONTEXT, self.capacity, sum(per.values()), per
        )

    def open(self, session_id: str, policy: str, transcript: list[Message]) -> None:
        self._alive()
        need = reservation_bytes(parse_policy(policy), GEOMETRY, MAX_CONTEXT)
        with self._lock:
            # like the real worker: idle sessions give up their KV when a new one needs the room
            for idle in [s for s in self.sessions if s not in self.running]:
                if sum(s["need"] for s in self.sessions.values()) + need <= self.capacity:
                    break
                del self.sessions[idle]
            reserved = sum(s["need"] for s in self.sessions.values())
            if reserved + need > self.capacity:
                raise WorkerRefused(f"{self.address}: pool full")
            self.opens += 1
            self.sessions[session_id] = {
                "transcript": list(transcript),
                "need": need,
                "bytes": 0,
                "tokens": 0,
            }
            self._grow(session_id, sum(len(m.content.split()) + 4 for m in transcript))

    def _grow(self, session_id: str, tokens: int) -> None:
        session = self.sessions[session_id]
        session["tokens"] += tokens
        session["bytes"] = min(session["need"], GEOMETRY.full_bytes(session["tokens"]))
        assert self.used() <= self.capacity, "fake worker pool exceeded"

    def turn(self, session_id, message, sampling, request_id=""):
        max_new_tokens = sampling.max_new_tokens
        self._alive()
        if session_id not in self.sessions:
            raise NotFound(f"{self.address} does not hold {session_id}")
        session = self.sessions[session_id]
        reply = reply_for([*session["transcript"], message])
        words = reply.split()[:max_new_tokens]
        with self._lock:
            self._grow(session_id, len(message.content.split()) + 4)
        self.running.add(session_id)
        try:
            for index, word in enumerate(words):
                if index == 1 and self.gate is not None:
                    self.gate.wait(10)
                self._alive()
                with self._lock:
                    self._grow(session_id, 1)
                yield TokenEvent((" " if index else "") + word, index=index, session_bytes=session["bytes"])
        finally:
            self.running.discard(session_id)
        text = " ".join(words)
        session["transcript"] += [message, Message("assistant", text)]
        reason = "eos" if len(words) == len(reply.split()) else "max_tokens"
        yield TurnResult(text, reason, generated_tokens=len(words), kv_bytes=session["bytes"])

    def drop(self, session_id: str) -> None:
        self._alive()
        with self._lock:
            self.sessions.pop(session_id, None)

    def cancel_calls(self) -> None:
        pass

    def close(self) -> None:
        pass


# --- Real processes for end-to-end tests (tiny model + SmolLM2 tokenizer, confkv subprocesses) ---

TOKEN = "e2e-client-secret"  # clients -> scheduler
WORKER_TOKEN = "e2e-worker-secret"  # scheduler -> workers (a different credential)


def save_tiny_model(folder: Path, config_cls=LlamaConfig, model_cls=LlamaForCausalLM, **overrides) -> Path:
    """A tiny random model with SmolLM2's tokenizer, saved as an HF folder (Llama unless told)."""
    import torch
    from transformers import AutoTokenizer

    from confkv.models import ModelNotFoundError, smollm2_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    except ModelNotFoundError as err:
        pytest.skip(f"needs the SmolLM2 tokenizer: {err}")
    torch.manual_seed(0)
    config = config_cls(
        **{
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "tie_word_embeddings": True, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id, **overrides,
        }
    )  # fmt: skip
    model_cls(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Proc:
    """A ``confkv`` subprocess with its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.log, self.env = args, log, env or {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        env = {
            **os.environ,
            "CONFKV_AUTH_TOKEN": TOKEN,
            "CONFKV_WORKER_TOKEN": WORKER_TOKEN,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "confkv_serve", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    def wait_serving(self, port: int, timeout_s: float = 120.0) -> None:
        """Until the gRPC health service on ``port`` answers SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.time() + timeout_s
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.time() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"process exited; log:\n{self.log.read_text()[-3000:]}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"nothing serving on {port}; log:\n{self.log.read_text()[-3000:]}")


# --- Redis: a unique key prefix on the shared server, or a private throw-away redis-server ---

SHARED_URL = "redis://127.0.0.1:6379/0"


def shared_redis_or_skip():
    import redis

    client = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    return client


def unique_prefix() -> str:
    return f"test:confkv-sched:{secrets.token_hex(4)}:"


def delete_prefix(client, prefix: str) -> None:
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """``redis-server --port P --save ''`` that a test may stop and start again (same port)."""

    def __init__(self, aof_folder: Path | None = None) -> None:
        """``aof_folder``: keep an append-only file there (fsync always), so a restart recovers."""
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.aof_folder = aof_folder
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.aof_folder is None:
            args += ["--appendonly", "no"]
        else:
            args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.aof_folder)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def byte_llama(seed: int = 0):
    """A tiny random Llama over the byte codec's vocabulary (worker tests, fuzz tests)."""
    from confkv.attention import enable
    from worker_svc.codec import ByteChatCodec

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=ByteChatCodec.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    enable(model)
    return model


# --- A live stack for the HTTP front door: real worker (printable byte model), scheduler gRPC + HTTP ---

HTTP_MODEL = "tiny-bytes"
HTTP_TOKENS = {"alice-secret": "alice", "bob-secret": "bob"}


def printable_byte_llama():
    """byte_llama whose logits allow only printable ASCII bytes (32..126): no EOS, valid UTF-8."""
    model = byte_llama(seed=1)
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.fill_(-1e4)
        biased.bias[32:127] = 0.0
    model.lm_head = biased
    return model


@dataclass
class LiveStack:
    engine: Any  # worker_svc.engine.Engine
    worker: Any  # worker_svc.server.WorkerServer
    grpc: Any  # scheduler_svc.server.SchedulerServer
    http: Any  # scheduler_svc.http.HttpServer
    store: Any  # scheduler_svc.store.SessionStore

    @property
    def scheduler(self):
        return self.grpc.scheduler

    @property
    def base_url(self) -> str:
        return f"{self.http.url}/v1"

    def stop(self) -> None:
        self.http.stop(1.0)
        self.grpc.stop(1.0)
        self.worker.stop(1.0)


def start_live(model, store=None, config=None, kv_pool_bytes: int = 64 << 20, max_body_bytes: int = 1 << 20):
    """Worker + scheduler (gRPC and HTTP, client tokens HTTP_TOKENS) on free loopback ports."""
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core import Scheduler
    from scheduler_svc.grpc_worker import GrpcWorkerClient
    from scheduler_svc.http import start_http_server
    from scheduler_svc.server import start_scheduler
    from scheduler_svc.store import MemoryStore
    from worker_svc.codec import ByteChatCodec
    from worker_svc.engine import Engine
    from worker_svc.server import start_worker
    from worker_svc.types import EngineConfig

    engine = Engine(
        model,
        ByteChatCodec(),
        EngineConfig(kv_pool_bytes=kv_pool_bytes, prefill_chunk=64, max_context_tokens=2048),
    )
    worker = start_worker(engine, HTTP_MODEL, port=0)
    store = store or MemoryStore()
    config = config or SchedulerConfig(default_policy="full", default_max_new_tokens=8, poll_interval_s=0.2)
    grpc_server = start_scheduler(
        Scheduler(store, [GrpcWorkerClient(worker.address)], config), client_tokens=HTTP_TOKENS
    )
    http = start_http_server(grpc_server.scheduler, client_tokens=HTTP_TOKENS, max_body_bytes=max_body_bytes)
    return LiveStack(engine, worker, grpc_server, http, store)
