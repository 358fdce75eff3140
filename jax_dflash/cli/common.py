"""What every command shares: the program's name, its exit statuses, the usage error and the
argparse pieces. Imports nothing heavy: the console script imports it before Ctrl-C is handled.
"""

from __future__ import annotations

import argparse
import difflib

PROG = "jax-dflash"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
SEED_LIMIT = 2**63  # numpy's default_rng takes any int; keep seeds in int64 for the JSON


class UsageError(Exception):
    """A flag combination that cannot run; the message is the one-line reason."""


def int_in(minimum: int, limit: int | None = None):
    """An argparse type: an integer >= ``minimum`` (and < ``limit``), else a one-line reason."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if limit is not None and value >= limit:
            raise argparse.ArgumentTypeError(
                f"expected an integer < {limit} (2**{limit.bit_length() - 1}), got {text!r}"
            )
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def named(what: str, names, aliases: dict[str, str] | None = None):
    """An argparse type: one of ``names``, or an alias (which gives the name it stands for); a
    wrong name gets the closest one as "did you mean"."""
    aliases = aliases or {}

    def parse(text: str) -> str:
        if text in names:
            return text
        if text in aliases:
            return aliases[text]
        close = difflib.get_close_matches(text, [*names, *aliases], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        expected = ", ".join(names) + (f"; or {', '.join(aliases)}" if aliases else "")
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r}{hint}; expected one of {expected}"
        )

    parse.__name__ = what
    return parse


positive_int = int_in(1)
seed = int_in(0, SEED_LIMIT)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=100)


def version() -> str:
    try:
        from importlib import metadata

        return metadata.version("jax-dflash")
    except Exception:  # noqa: BLE001 - a source tree that was never installed
        return "0+unknown"
