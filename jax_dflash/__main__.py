"""``python -m jax_dflash`` and the ``jax-dflash`` console script (see jax_dflash.cli.main).

Ctrl-C handling is installed here, before the command line imports jax: an interrupt prints
one line and leaves at once with status 130 (``os._exit``, after flushing), because XLA may
crash at interpreter exit while it is compiling, and a KeyboardInterrupt traceback from inside
an import helps nobody. Python runs signal handlers only between bytecodes of the main thread,
which may sit in a long XLA compilation; so the signal also wakes a helper thread (through
``signal.set_wakeup_fd``) that exits on its behalf.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

INTERRUPTED_STATUS = 130
_MESSAGE = b"\njax-dflash: interrupted\n"


def _exit_interrupted() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the exit
            pass
    try:
        os.write(2, _MESSAGE)
    finally:
        os._exit(INTERRUPTED_STATUS)


def _on_sigint(signum, frame):  # noqa: ARG001 - the signal handler signature
    _exit_interrupted()


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            _exit_interrupted()


def install_interrupt_handler() -> None:
    """Ctrl-C exits 130 with one line, whatever the main thread is doing."""
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (OSError, ValueError):  # not the main thread, or no pipes: the handler alone
        return
    threading.Thread(target=_watch, args=(read_fd,), name="jax-dflash-sigint", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    install_interrupt_handler()
    from jax_dflash.cli.main import main as cli_main  # imports jax: after the handler

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
