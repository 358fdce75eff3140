"""The ``jax-dflash`` command line: ``run`` (the DFlash draft-cache workload,
:mod:`jax_dflash.cli.run`) and ``check`` (the environment and a parity self-test,
:mod:`jax_dflash.cli.check`). The benchmark lives apart from the package, in ``bench/``.

Exit status: 0 on success, 1 when a check fails (and only then), 2 on bad flags (one line on
stderr saying why, before anything runs), 3 on an unexpected error (with its traceback) or a
``--json`` file that failed at the end (one line; the summary then goes to stdout), 130 on
Ctrl-C.

Each command is a module with ``NAME``, ``SUMMARY`` (its line in the top-level help) and
``add_parser(commands)``, which sets ``execute(args) -> status``. This module and the commands'
module level import nothing heavy: a console script imports this module before ``main`` can
install the Ctrl-C handler.
"""

from __future__ import annotations

import os
import sys
import textwrap
import traceback

from jax_dflash.cli import check, run
from jax_dflash.cli.common import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    HelpFormatter,
    UsageError,
    version,
)
from jax_dflash.cli.interrupt import INTERRUPTED_STATUS, install_interrupt_handler

COMMANDS = (run, check)
_SUMMARY_INDENT = 10  # "  check   "
_HELP_WIDTH = 82


def _commands_help() -> str:
    lines = ["commands:"]
    for command in COMMANDS:
        lines.append(
            textwrap.fill(
                command.SUMMARY,
                width=_HELP_WIDTH,
                initial_indent=f"  {command.NAME:<{_SUMMARY_INDENT - 2}}",
                subsequent_indent=" " * _SUMMARY_INDENT,
            )
        )
    return "\n".join(lines) + "\n\n"


def build_parser():
    import argparse

    from jax_dflash.cli.presets import presets_help

    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=HelpFormatter,
        description=(
            "The DFlash target KV-cache update (one kernel for JAX and TensorRT), "
            "exercised the way a DFlash draft model uses it."
        ),
        epilog=_commands_help()
        + presets_help()
        + f"\n\nQuick start: `make demo` (= `{PROG} run`), then `{PROG} check`.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    names = ",".join(command.NAME for command in COMMANDS)
    commands = parser.add_subparsers(dest="command", metavar=f"{{{names}}}")
    commands.required = True
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        # Run as the process's command (a console script may point here): it owns Ctrl-C.
        install_interrupt_handler()
        argv = sys.argv[1:]
    args = build_parser().parse_args(list(argv))  # exits 2 with usage and a reason
    try:
        return args.execute(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # called in-process, without the handler
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except BrokenPipeError:
        # The reader left (`| head`): stop writing, quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception:  # noqa: BLE001 - not a failed check: say so, with the traceback
        traceback.print_exc()
        print(f"{PROG}: internal error (not a check failure)", file=sys.stderr)
        return EXIT_INTERNAL
