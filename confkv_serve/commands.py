"""The ``confkv`` console script: the one table of every command and the module that implements it.

It sits above every layer so that it may name them all: the core library's commands
(``confkv.cli.*``), each service's own command module beside the service (``worker_svc.cli``,
``scheduler_svc.cli``) and the commands that need both services (``confkv_serve.*``). Adding a
command = one line here. Run as ``confkv COMMAND`` or ``python -m confkv_serve COMMAND``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from confkv.cli.common import UsageError
from confkv.cli.runner import build_parser as _build_parser
from confkv.cli.runner import run_command

# command -> module exposing add_parser(subparsers) and run(args) -> int; --help lists them in this order.
COMMAND_MODULES: dict[str, str] = {
    "generate": "confkv.cli.generate",
    "plan": "confkv.cli.plan",
    "eval": "confkv.cli.eval",
    "worker": "worker_svc.cli",
    "scheduler": "scheduler_svc.cli",
    "serve": "confkv_serve.serve",
    "chat": "confkv_serve.chat",
    "sessions": "confkv_serve.sessions",
}
COMMANDS = list(COMMAND_MODULES)

__all__ = ["COMMANDS", "COMMAND_MODULES", "UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(COMMAND_MODULES)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
