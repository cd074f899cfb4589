"""The gRPC code is generated from the .proto files and importable as a normal package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from confkv_proto import build  # noqa: E402


def test_generate_into_a_clean_folder_and_import(tmp_path: Path):
    """A fresh checkout has no generated files: generate into an empty root, import from there."""
    written = build.generate(tmp_path / build.PACKAGE)
    names = {p.relative_to(tmp_path / build.PACKAGE).as_posix() for p in written}
    assert set(build.expected_outputs()) == names
    assert not build.is_stale(tmp_path / build.PACKAGE)
    text = (tmp_path / build.PACKAGE / "confkv/v1/scheduler_pb2.py").read_text()
    assert "from confkv_proto.confkv.v1 import worker_pb2" in text
    assert "from confkv.v1 import" not in text  # would resolve to the confkv library
    (tmp_path / build.PACKAGE / "__init__.py").write_text("")
    code = (
        "from confkv_proto.confkv.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc\n"
        "import confkv_proto.confkv.v1.worker_pb2 as w\n"
        "assert scheduler_pb2_grpc.SchedulerStub and worker_pb2_grpc.WorkerStub\n"
        "assert scheduler_pb2.ChatEvent(done=w.GenerationDone(text='hi')).done.text == 'hi'\n"
        "print(w.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path))


def test_stale_when_proto_is_newer(tmp_path: Path):
    out_root = tmp_path / "gen"
    build.generate(out_root)
    assert not build.is_stale(out_root)
    pb2 = out_root / "confkv/v1/worker_pb2.py"
    sources = [build.PROTO_ROOT / name for name in build.PROTO_FILES]
    old = min(path.stat().st_mtime for path in sources) - 60  # older than the .proto it came from
    os.utime(pb2, (old, old))
    assert build.is_stale(out_root)
    pb2.unlink()
    assert build.is_stale(out_root)
    assert build.ensure_generated(out_root) is True
    assert build.ensure_generated(out_root) is False


def test_package_exports_generated_modules():
    import confkv_proto

    request = confkv_proto.worker_pb2.GenerateRequest(session_id="s", max_new_tokens=3)
    assert request.SerializeToString()
    assert hasattr(confkv_proto.worker_pb2_grpc, "add_WorkerServicer_to_server")
    assert hasattr(confkv_proto.scheduler_pb2_grpc, "add_SchedulerServicer_to_server")
