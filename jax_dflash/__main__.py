"""``python -m jax_dflash`` and the ``jax-dflash`` console script (see jax_dflash.cli.main).

Ctrl-C handling is installed here, before jax is imported: an interrupt prints one line and
leaves at once with status 130 (``os._exit``), because XLA may crash at interpreter exit while
it is compiling, and a raw KeyboardInterrupt traceback from inside an import helps nobody.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED_STATUS = 130


def _on_sigint(signum, frame):  # noqa: ARG001 - the signal handler signature
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the exit
            pass
    try:
        os.write(2, b"\njax-dflash: interrupted\n")
    finally:
        os._exit(INTERRUPTED_STATUS)


def install_interrupt_handler() -> None:
    signal.signal(signal.SIGINT, _on_sigint)


def main(argv: list[str] | None = None) -> int:
    install_interrupt_handler()
    from jax_dflash.cli.main import main as cli_main  # imports jax: after the handler

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
