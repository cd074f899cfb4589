"""The README's newcomer path (chat, eval, load test, plan), run verbatim from a fresh copy.

The commands are read from the README's ``<!-- newcomer:server -->`` and ``<!-- newcomer:steps -->``
blocks (only the port 50051 is swapped for a free one), in a copy of the tracked files (what a
clone holds: no build outputs, no ``../shared``), so the README cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_PORT = "50051"

pytestmark = pytest.mark.smollm2


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- newcomer:{marker} -->\s*```bash\n(.*?)```", text, re.S)
    assert match, f"README lost its newcomer:{marker} block"
    return match.group(1)


def commands(block: str) -> list[str]:
    """Shell commands of a block: comments dropped, backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def fresh_copy(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_readme_blocks_parse():
    assert commands(readme_block("server")) == ["confkv serve --port 50051"]
    steps = commands(readme_block("steps"))
    assert [c.split()[0] for c in steps] == ["confkv", "confkv", "locust", "confkv", "confkv"]
    assert all(README_PORT in c for c in steps if "--address" in c or "--host" in c)


@pytest.mark.skipif(shutil.which("locust", path=str(Path(sys.executable).parent)) is None, reason="no locust")
def test_newcomer_path_from_a_fresh_copy(tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("CONFKV_AUTH_TOKEN", None)
    server_cmd = commands(readme_block("server"))[0].replace(README_PORT, port)
    server = subprocess.Popen(
        server_cmd,
        shell=True,
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the shell's child too is stopped below, never left behind
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line or server.poll() is None, "confkv serve exited before listening"
            if "scheduler on" in line:
                break
        else:
            pytest.fail("confkv serve did not start in 180 s")
        for command in commands(readme_block("steps")):
            done = subprocess.run(
                command.replace(README_PORT, port), shell=True, cwd=clone, env=env,
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert done.returncode == 0, f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
            assert "Traceback" not in done.stderr, command
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the shell and the ``confkv serve`` it started
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
    for out in ("ppl.json", "ppl.md", "ppl.png", "locust.json", "trace.json"):
        assert (clone / out).is_file(), out
