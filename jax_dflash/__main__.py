"""``python -m jax_dflash`` and the ``jax-dflash`` console script: the command line
(:mod:`jax_dflash.cli.main`) with the Ctrl-C handler (:mod:`jax_dflash.cli.interrupt`) installed
first, before anything imports jax."""

from __future__ import annotations

import sys

from jax_dflash.cli.interrupt import install_interrupt_handler


def main(argv: list[str] | None = None) -> int:
    install_interrupt_handler()
    from jax_dflash.cli.main import main as cli_main  # the commands import jax: after the handler

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
