"""Command modules of the core library (``generate``, ``plan``, ``eval``) and the runner they share.

Each command module exposes ``add_parser(subparsers)`` (which sets ``run`` and, optionally,
``extras`` on the parsed args) and ``run(args) -> int``. The table of every ``confkv`` command,
including the services' ones, lives above all layers in ``confkv_serve.commands``.
"""
