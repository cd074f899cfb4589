"""The gRPC code is generated at build time from the .proto files, with plain imports, and a
missing or stale generation fails loudly on import instead of being regenerated."""

from __future__ import annotations

import os
import shutil
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
    assert "from confkv_proto.confkv.v1 import worker_pb2" in text  # written so by protoc itself
    assert "from confkv.v1 import" not in text  # would resolve to the confkv library
    (tmp_path / build.PACKAGE / "__init__.py").write_text("")
    code = (
        "from confkv_proto.confkv.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc\n"
        "import confkv_proto.confkv.v1.worker_pb2 as w\n"
        "assert scheduler_pb2_grpc.SchedulerStub and worker_pb2_grpc.WorkerStub\n"
        "assert scheduler_pb2.ChatEvent(done=w.GenerationDone(text='hi')).done.text == 'hi'\n"
        "assert w.DESCRIPTOR.package == 'confkv.v1'  # wire names do not depend on file paths\n"
        "print(w.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path))


def test_stale_when_a_proto_changes(tmp_path: Path):
    proto_root, out_root = tmp_path / "src", tmp_path / "gen"
    shutil.copytree(build.PROTO_ROOT / "confkv", proto_root / "confkv")
    build.generate(out_root, proto_root)
    assert build.staleness(out_root, proto_root) is None
    worker = proto_root / "confkv/v1/worker.proto"
    worker.write_text(worker.read_text() + "\n// a change\n")
    assert "older than the .proto" in (build.staleness(out_root, proto_root) or "")
    (out_root / "confkv/v1/worker_pb2.py").unlink()
    assert "missing confkv/v1/worker_pb2.py" in (build.staleness(out_root, proto_root) or "")
    assert build.main(["--check", "--out", str(out_root)]) == 1


def test_import_fails_loudly_when_stale(tmp_path: Path):
    """A copy of the package whose .proto changed after generation: importing a module says how
    to regenerate instead of regenerating (or silently using old code)."""
    pkg = tmp_path / build.PACKAGE
    shutil.copytree(build.PROTO_ROOT, pkg, ignore=shutil.ignore_patterns("__pycache__", ".gen-*"))
    build.generate(pkg, pkg)
    worker = pkg / "confkv/v1/worker.proto"
    worker.write_text(worker.read_text() + "\n// a change\n")
    code = "import confkv_proto\nfrom confkv_proto import worker_pb2\n"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "make proto" in out.stderr


def test_package_exports_generated_modules():
    import confkv_proto

    assert build.staleness(build.PROTO_ROOT) is None  # the build generated it (make setup / pip install)
    request = confkv_proto.worker_pb2.GenerateRequest(session_id="s", max_new_tokens=3)
    assert request.SerializeToString()
    assert hasattr(confkv_proto.worker_pb2_grpc, "add_WorkerServicer_to_server")
    assert hasattr(confkv_proto.scheduler_pb2_grpc, "add_SchedulerServicer_to_server")
