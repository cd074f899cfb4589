"""Build hook: generate the gRPC code before packaging (``pip install .`` and ``pip install -e .``).

Everything else about the package is declared in pyproject.toml. The generator is loaded by path
(``proto/build.py`` imports nothing from the package), and a failure stops the build loudly.
"""

import importlib.util
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.warnings import InformationOnly

# An editable install of folders imported under another name (kernels/ -> confkv_kernels,
# proto/ -> confkv_proto: pyproject.toml's package-dir) goes through setuptools' meta path finder,
# which then prints a ten-line "Editable installation" notice on every `pip install -e .`, even
# with -q ("folders with the same name as your package may take precedence"; here the folder names
# differ from the import names on purpose). Information only: hide that one notice, nothing else.
warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)


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
