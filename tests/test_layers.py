"""The layers of the house, checked on the source: every ``import`` and ``from ... import``
statement, including the lazy ones inside functions.

    confkv_serve (command table, serve, chat)
        ^
    worker_svc   scheduler_svc   (side by side: they talk only over gRPC)      loadtest (a client)
        ^
    confkv (core, no network)   confkv_kernels (kernels/)   confkv_proto (proto/, generated)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (see pyproject.toml [tool.setuptools] package-dir)
FOLDERS = {
    "confkv": "confkv",
    "confkv_kernels": "kernels",
    "confkv_proto": "proto",
    "worker_svc": "worker_svc",
    "scheduler_svc": "scheduler_svc",
    "confkv_serve": "confkv_serve",
    "loadtest": "loadtest",
}
ABOVE_CORE = {"worker_svc", "scheduler_svc", "confkv_serve", "loadtest"}
FORBIDDEN = {
    "confkv": ABOVE_CORE,
    "confkv_kernels": ABOVE_CORE | {"confkv", "confkv_proto"},
    "confkv_proto": ABOVE_CORE | {"confkv", "confkv_kernels"},
    "worker_svc": {"scheduler_svc", "confkv_serve", "loadtest"},
    "scheduler_svc": {"worker_svc", "confkv_serve", "loadtest"},
    "confkv_serve": {"loadtest"},
    "loadtest": {"confkv_serve"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (absolute imports; relative ones stay inside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def sources(package: str) -> list[Path]:
    generated = ("_pb2.py", "_pb2_grpc.py")
    return sorted(p for p in (ROOT / FOLDERS[package]).rglob("*.py") if not p.name.endswith(generated))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_up_or_across_the_layers(package):
    assert sources(package), f"no sources found for {package}"
    offenders = {
        f"{path.relative_to(ROOT)} imports {sorted(bad)}"
        for path in sources(package)
        if (bad := imported_packages(path) & FORBIDDEN[package])
    }
    assert not offenders, "\n".join(sorted(offenders))


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker_svc.app import engine\n    import scheduler_svc.core\n")
    assert imported_packages(module) == {"worker_svc", "scheduler_svc"}


def test_command_table_is_the_only_place_that_names_every_layer():
    from confkv_serve.commands import COMMAND_MODULES

    owners = {name: module.split(".")[0] for name, module in COMMAND_MODULES.items()}
    assert owners == {
        "generate": "confkv", "plan": "confkv", "eval": "confkv", "worker": "worker_svc",
        "scheduler": "scheduler_svc", "serve": "confkv_serve", "chat": "confkv_serve",
        "sessions": "confkv_serve",
    }  # fmt: skip
