"""Ctrl-C in the command line: one line on stderr and status 130, at once, whatever is running.

Installed before anything imports jax (by ``jax_dflash.__main__``, the console script's entry):
an interrupt leaves with ``os._exit`` after flushing what was printed, because XLA may crash at
interpreter exit while it compiles or runs, and a KeyboardInterrupt traceback from inside an
import helps nobody. Python runs signal handlers only between bytecodes of the main thread, which
may sit in a long XLA call; so the signal also wakes a helper thread (``signal.set_wakeup_fd``)
that exits on its behalf. Whichever of the two comes first exits; the other waits for the end.

Imports only what the interpreter has already loaded at startup (and threading).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

INTERRUPTED_STATUS = 130
MESSAGE = "jax-dflash: interrupted"
# A stdout whose reader stopped reading (a pager left open) must not hold the exit up.
FLUSH_SECONDS = 1.0

_exiting = threading.Lock()
_cleanups: list[Callable[[], None]] = []
_installed = False


def add_cleanup(cleanup: Callable[[], None]) -> None:
    """``cleanup()`` runs on an interrupt before the exit (say, to remove a file the run made);
    it must not import anything (the main thread may hold the import lock)."""
    _cleanups.append(cleanup)


def remove_cleanup(cleanup: Callable[[], None]) -> None:
    if cleanup in _cleanups:
        _cleanups.remove(cleanup)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the exit
            pass


def exit_interrupted() -> None:
    """Flushes stdout and stderr (for a second at most), runs the cleanups, prints the one line
    and ends the process with status 130. A second caller waits here until the process ends."""
    _exiting.acquire()
    flusher = threading.Thread(target=_flush_streams, name="jax-dflash-flush", daemon=True)
    flusher.start()
    flusher.join(FLUSH_SECONDS)
    for cleanup in list(_cleanups):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - best effort: the exit comes first
            pass
    try:
        # On a terminal the line may follow a progress bar or the echoed ^C: start a new line.
        lead = "\n" if os.isatty(2) else ""
        os.write(2, f"{lead}{MESSAGE}\n".encode())
    except OSError:
        pass
    finally:
        os._exit(INTERRUPTED_STATUS)


def _on_sigint(signum, frame):  # noqa: ARG001 - the signal handler signature
    exit_interrupted()


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            exit_interrupted()


def install_interrupt_handler() -> bool:
    """Ctrl-C exits 130 with one line, whatever the main thread is doing. Idempotent; returns
    whether the handler is in place (it cannot be outside the main thread)."""
    global _installed
    if _installed:
        return True
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread
        return False
    _installed = True
    try:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (OSError, ValueError):  # no pipes: the handler alone
        return True
    threading.Thread(target=_watch, args=(read_fd,), name="jax-dflash-sigint", daemon=True).start()
    return True
