"""Build the ``confkv`` parser from a command table and run one command with uniform errors.

Errors a user can fix (bad policy spec, unknown model, empty prompt, missing file, missing
optional extra) print one line ``confkv: error: ...`` and exit with code 2, like argparse's own
usage errors. Extras a command declares (``set_defaults(extras=...)``) are checked before it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from confkv.extras import require


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default, unless the help text already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == "" or default is argparse.SUPPRESS
        if "default" in text.lower() or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class ConfkvParser(argparse.ArgumentParser):
    """Usage errors as ONE line ``confkv: error: ...`` (exit 2), with a pointer to ``--help``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"confkv: error: {message} (see '{self.prog} --help')\n")


def build_parser(commands: Mapping[str, str]) -> argparse.ArgumentParser:
    """``commands``: command name -> module exposing ``add_parser(subparsers)`` and ``run(args)``."""
    parser = ConfkvParser(prog="confkv", description="Confidence-gated KV cache for LLM agents")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show library progress bars (weight loading) and logs"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in commands.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def quiet_libraries(verbose: bool) -> None:
    """Hide HF's "Loading weights" bar unless ``-v`` (our own progress bars have their own flags)."""
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # already imported (in-process callers): switch it off directly
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    args = parser.parse_args(argv)
    quiet_libraries(getattr(args, "verbose", False))
    try:
        extras = args.extras(args) if callable(getattr(args, "extras", None)) else getattr(args, "extras", ())
        require(extras, f"'confkv {args.command}'")
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # UsageError, MissingExtraError, ModelNotFoundError
        print(f"confkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
