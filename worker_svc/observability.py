"""Structured logs (one JSON object a line, with session/request ids) and Prometheus metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from worker_svc.prompt import PromptStats
from worker_svc.stats import StepStats

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}``; extras carry session_id, request_id, ..."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(message)s"))
    root = logging.getLogger("confkv")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class WorkerMetrics:
    """Prometheus series of one worker, in their own registry (several workers may share a
    process in tests and in ``confkv serve``)."""

    def __init__(
        self,
        worker_id: str,
        used_bytes: Callable[[], int] | None = None,
        prompt_stats: PromptStats | None = None,
    ):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels, r = ["worker"], self.registry
        self.kv_used = Gauge(
            "confkv_worker_kv_bytes_used", "exact KV bytes stored", labels, registry=self.registry
        )
        self.kv_capacity = Gauge(
            "confkv_worker_kv_bytes_capacity", "KV pool bytes", labels, registry=self.registry
        )
        self.batch = Gauge("confkv_worker_batch_size", "sequences in the last decode step", labels,
                           registry=self.registry)  # fmt: skip
        self.tokens = Counter("confkv_worker_tokens", "tokens generated", labels, registry=r)
        self.tps = Gauge("confkv_worker_tokens_per_second", "tokens/s over the last step", labels,
                         registry=self.registry)  # fmt: skip
        self.step_seconds = Histogram("confkv_worker_step_seconds", "engine step time", labels,
                                      registry=self.registry)  # fmt: skip
        self.worker_id = worker_id
        if used_bytes is not None:  # read at scrape time: never stale after a drop without steps
            self.kv_used.labels(worker_id).set_function(used_bytes)
        self._live_used = used_bytes is not None
        if prompt_stats is not None:
            self.registry.register(PromptCollector(worker_id, prompt_stats))
        self._server: Any = None  # prometheus WSGIServer once serving
        self._last = time.monotonic()

    def on_step(self, stats: StepStats) -> None:
        w = self.worker_id
        if not self._live_used:
            self.kv_used.labels(w).set(stats.used_bytes)
        self.kv_capacity.labels(w).set(stats.capacity_bytes)
        self.batch.labels(w).set(stats.batch_size)
        self.tokens.labels(w).inc(stats.tokens)
        self.step_seconds.labels(w).observe(stats.seconds)
        if stats.seconds > 0:
            self.tps.labels(w).set(stats.tokens / stats.seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class PromptCollector:
    """``confkv_worker_prompt_tokens_encoded_total`` and ``confkv_worker_prompt_encodes_total{mode}``,
    read from the engine's ``PromptStats`` at scrape time (encodes happen on request threads)."""

    def __init__(self, worker_id: str, stats: PromptStats):
        self.worker_id, self.stats = worker_id, stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        tokens, encodes = self.stats.snapshot()
        encoded = CounterMetricFamily(
            "confkv_worker_prompt_tokens_encoded", "prompt tokens tokenized (only new text when incremental)",
            labels=["worker"],
        )  # fmt: skip
        encoded.add_metric([self.worker_id], tokens)
        per_mode = CounterMetricFamily(
            "confkv_worker_prompt_encodes", "prompt encodes by mode (full: whole conversation)",
            labels=["worker", "mode"],
        )  # fmt: skip
        for mode, count in encodes.items():
            per_mode.add_metric([self.worker_id, mode.value], count)
        return [encoded, per_mode]
