"""Entry point of the `kvflow` command: builds the sub-command parser and dispatches."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvflow import __version__
from kvflow.cli.args import ArgumentParser
from kvflow.plotting import MissingExtra

# Each module listed here defines `register(subparsers)`, which adds its sub-commands and sets
# `func` on them (a callable taking the parsed args and returning an exit code).
COMMAND_MODULES = [
    "kvflow.cli.generate",
    "kvflow.cli.plan",
    "kvflow.cli.worker",
    "kvflow.cli.serve",
    "kvflow.cli.router",
]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="kvflow", description="kvflow: LLM serving built around KV-cache streaming")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or an argument error (already printed in one line)
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvflow plan ... | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit does not fail again
        return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kvflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MissingExtra as e:  # e.g. a plot without matplotlib (the `plot` extra)
        print(f"kvflow {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
