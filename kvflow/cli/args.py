"""The argument parser of every `kvflow` command (and of the benchmarks): errors in one line, no
abbreviated flags, each option's default in its help; and argument types that check values while
parsing, so that a bad argument fails before anything heavy (torch, the model) is imported.

The typed checks here are the command line's own: the configs they feed (`SamplingParams`,
`EngineConfig`, `APIConfig`) still validate themselves for callers that build them in Python.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

# Options whose default is implied by their kind (a flag is off unless given) or that have none.
_NO_DEFAULT_SHOWN = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                     argparse._HelpAction, argparse._VersionAction, argparse._CountAction, argparse._AppendConstAction)
_SAYS_DEFAULT = re.compile(r"\bdefault\b|%\(default\)", re.IGNORECASE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what its default is
    (a help for an option whose default is None must say it in words: "default: the checkpoint's")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (_SAYS_DEFAULT.search(text) or isinstance(action, _NO_DEFAULT_SHOWN) or action.required
                or action.default in (None, argparse.SUPPRESS) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with `allow_abbrev=False` (`--max-token` is an error, not `--max-tokens`), the
    `HelpFormatter`, and a one-line error instead of the whole usage block. Sub-command parsers made
    by `add_subparsers().add_parser` are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def number(kind: Callable[[str], float | int], low: float | None = None, high: float | None = None,
           low_open: bool = False) -> Callable[[str], float | int]:
    """An argparse type: `kind(text)` within [low, high] (`low_open`: (low, high])."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid <type> value" messages
    return parse


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers, e.g. "1,2,4"."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated positive numbers, e.g. "0.5,1,2"."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def length_dist(text: str) -> str:
    """An argparse type: an output-length distribution, lmsys, constant:N or lognormal:MEDIAN:P90
    (checked here; `kvflow.simulator.workload.LengthDist` is built from it later)."""
    kind, *vals = text.split(":")
    try:
        ok = ((kind == "lmsys" and not vals) or (kind == "constant" and len(vals) == 1 and int(vals[0]) >= 0)
              or (kind == "lognormal" and len(vals) == 2 and 0 < float(vals[0]) < float(vals[1])))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"use lmsys, constant:N or lognormal:MEDIAN:P90 (median < p90), got {text!r}")
    return text


def existing_path(text: str) -> Path:
    """An argparse type: a file or directory that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return path


def model_arg(text: str) -> str:
    """An argparse type for --model: the default model's name, or a local GGUF file or checkpoint
    directory that exists (`kvflow.model.loader.resolve`, which imports no torch)."""
    from kvflow.model.loader import resolve

    try:
        resolve(text)
    except (FileNotFoundError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """`HelpFormatter` keeping the description's own line breaks (a benchmark's module docstring)."""
