"""``confkv`` console script: one sub-module per command, each with ``add_parser`` and ``run``.

Errors a user can fix (bad policy spec, unknown model, empty prompt, missing file) print one
line ``confkv: error: ...`` and exit with code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each entry names a module in confkv.cli exposing add_parser(subparsers) and run(args) -> int.
COMMANDS = ["generate", "plan", "eval", "worker", "scheduler", "serve", "chat"]


class UsageError(ValueError):
    """Bad input from the user: reported as a one-line message with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="confkv", description="Confidence-gated KV cache for LLM agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"confkv.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # ModelNotFoundError and UsageError are ValueErrors
        print(f"confkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
