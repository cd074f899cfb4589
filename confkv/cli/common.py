"""Argument helpers and the error type shared by every ``confkv`` command module."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from confkv.models import SMOLLM2, ModelNotFoundError, locate

# Upper bound of any token count flag: far above every model's context, far below the int32 fields
# of the wire format (a bigger number would otherwise fail deep inside protobuf).
MAX_TOKENS = 1 << 20


class UsageError(ValueError):
    """Bad input from the user: reported as a one-line message with exit code 2."""


def model_name(text: str) -> str:
    """argparse type: a model that can be found (embedded, local folder, HF cache or a reachable hub)."""
    try:
        locate(text)
    except ModelNotFoundError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip()


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=model_name,
        default=SMOLLM2,
        help="'smollm2' (embedded), an HF hub id or a local folder",
    )


def positive_int(text: str) -> int:
    """argparse type: an integer in [0, 2**31 - 1] (the name is historical: 0 is allowed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    if value > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"must be <= {2**31 - 1}, got {value}")
    return value


def token_count(text: str) -> int:
    """argparse type: a number of tokens in [0, MAX_TOKENS]."""
    value = positive_int(text)
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_TOKENS} tokens, got {value}")
    return value


def temperature(text: str) -> float:
    """argparse type: a finite float >= 0 (0 = greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text}")
    return value


def finite_float(minimum: float = 0.0):
    """argparse type factory: a finite float >= ``minimum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def check_input_file(path: Path | str | None, flag: str) -> None:
    """An input the command will read: it must be an existing file (checked before any work)."""
    if path is not None and not Path(path).is_file():
        raise UsageError(f"{flag}: file not found: {path}")


def check_output_path(path: Path | str | None, flag: str) -> None:
    """An output the command will write: its folder must exist and be writable (checked up front)."""
    if path is None:
        return
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag}: {path} is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag}: folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag}: folder {folder} is not writable")


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0 = any free port); anything else is a usage error (exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = any free port), got {value}")
    return value


def require_auth_off_loopback(host: str, has_credentials: bool, insecure: bool, what: str) -> None:
    """Authentication is on by default outside loopback: binding another address without
    credentials needs an explicit ``--insecure``."""
    import ipaddress

    try:
        loopback = host in ("localhost",) or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not has_credentials and not insecure:
        raise UsageError(
            f"{what} would listen on {host} without authentication; set the token env var "
            "(see --help) or pass --insecure to allow unauthenticated access"
        )


def policy_list(text: str) -> list[str]:
    """Comma-separated specs; a comma followed by key=value belongs to the previous spec."""
    specs: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part.split(":")[0] and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    if not specs:
        raise ValueError("no policy given")
    from confkv.policies import parse_policy

    for spec in specs:
        parse_policy(spec)  # validate early: a clear message before any model is loaded
    return specs


def command_line() -> str | None:
    """The command as typed, for markdown reports (only when run as the console script)."""
    if sys.argv and Path(sys.argv[0]).name == "confkv":
        return shlex.join(["confkv", *sys.argv[1:]])
    return None
