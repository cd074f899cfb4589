"""Real processes for end-to-end tests: a tiny random Llama saved with the SmolLM2 tokenizer,
``confkv worker`` / ``confkv scheduler`` subprocesses on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

TOKEN = "e2e-shared-secret"


def save_tiny_model(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from confkv.models import ModelNotFoundError, smollm2_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    except ModelNotFoundError as err:
        pytest.skip(f"needs the SmolLM2 tokenizer: {err}")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Proc:
    """A ``confkv`` subprocess with its output in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log = args, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        env = {
            **os.environ,
            "CONFKV_AUTH_TOKEN": TOKEN,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "confkv.cli.main", *self.args],
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
