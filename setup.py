"""Build hook: generate the gRPC code before packaging (``pip install .`` and ``pip install -e .``).

Everything else about the package is declared in pyproject.toml. The generator is loaded by path
(``proto/build.py`` imports nothing from the package), and a failure stops the build loudly.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _codegen():
    path = Path(__file__).resolve().parent / "proto" / "build.py"
    spec = importlib.util.spec_from_file_location("_confkv_proto_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithGrpc(build_py):
    def run(self):
        codegen = _codegen()
        if codegen.is_stale():
            codegen.generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithGrpc})
