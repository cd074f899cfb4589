"""The locustfile's OpenAI-HTTP users (``--http-url``), headless against a live scheduler's HTTP
front door on loopback (tiny model): conversations complete and reuse their sessions; a wrong
API key makes every turn a counted failure and the run exit non-zero."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed (pip install -e .[load])", allow_module_level=True)

from tests.helpers import printable_byte_llama, start_live  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(1)
    stack = start_live(printable_byte_llama())
    yield stack
    stack.stop()


def run_locust(tmp_path, url: str, token: str, seconds: int = 5):
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
           "--http-url", url, "-u", "2", "-r", "2", "-t", f"{seconds}s", "--only-summary",
           "--stop-timeout", "30", "--turns", "3", "--page-chars", "200", "--max-new-tokens", "4",
           "--policy", "full", "--summary-json", str(summary)]  # fmt: skip
    env = {**os.environ, "CONFKV_TOKEN": token}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    return done, json.loads(summary.read_text())


def test_http_users_hold_conversations_in_one_session_each(live, tmp_path):
    done, result = run_locust(tmp_path, live.base_url, "alice-secret")
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    assert result["turns"] >= 3 and result["failed"] == 0 and result["ttft_ms_p50"] is not None
    assert "POST /v1/chat/completions" in done.stdout + done.stderr
    sessions = live.scheduler.list_sessions(principal="alice")
    assert sessions and max(v.record.turns for v in sessions) >= 2  # later turns continued the session


def test_http_failures_are_counted_and_fail_the_run(live, tmp_path):
    done, result = run_locust(tmp_path, live.base_url, "wrong-secret", seconds=3)
    assert done.returncode != 0
    assert result["turns"] == 0 and result["failed"] >= 2
    assert set(result["failures"]) == {"user:HTTP401"}  # each user failed to list the models
