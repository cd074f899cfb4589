"""Argument helpers and the error type shared by every ``confkv`` command module."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from confkv.models import SMOLLM2
from confkv.policies import parse_policy


class UsageError(ValueError):
    """Bad input from the user: reported as a one-line message with exit code 2."""


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=SMOLLM2, help="'smollm2' (embedded), an HF hub id or a local folder"
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


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
    for spec in specs:
        parse_policy(spec)  # validate early: a clear message before any model is loaded
    return specs


def command_line() -> str | None:
    """The command as typed, for markdown reports (only when run as the console script)."""
    if sys.argv and Path(sys.argv[0]).name == "confkv":
        return shlex.join(["confkv", *sys.argv[1:]])
    return None
