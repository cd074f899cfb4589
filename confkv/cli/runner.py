"""Build the ``confkv`` parser from a command table and run one command with uniform errors.

Errors a user can fix (bad policy spec, unknown model, empty prompt, missing file, missing
optional extra) print one line ``confkv: error: ...`` and exit with code 2, like argparse's own
usage errors. Extras a command declares (``set_defaults(extras=...)``) are checked before it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence

from confkv.extras import require


def build_parser(commands: Mapping[str, str]) -> argparse.ArgumentParser:
    """``commands``: command name -> module exposing ``add_parser(subparsers)`` and ``run(args)``."""
    parser = argparse.ArgumentParser(prog="confkv", description="Confidence-gated KV cache for LLM agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in commands.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        extras = args.extras(args) if callable(getattr(args, "extras", None)) else getattr(args, "extras", ())
        require(extras, f"'confkv {args.command}'")
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # UsageError, MissingExtraError, ModelNotFoundError
        print(f"confkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
