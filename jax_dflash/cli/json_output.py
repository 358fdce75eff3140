"""Where ``run --json`` writes its summary, opened before the run.

A path that cannot take the summary fails before anything runs, with one line naming ``--json``:
the file is opened (created if new) and handed a zero-byte write, which devices and kernel
files that refuse writes (``/dev/full``, ``/proc/version``) answer with their error. An existing
file keeps its content until the summary replaces it; a file the run created is removed again if
the run ends without a summary (an error, or Ctrl-C).
"""

from __future__ import annotations

import errno
import os
import stat

from jax_dflash.cli import interrupt
from jax_dflash.cli.common import UsageError


class SummaryNotWritten(Exception):
    """The summary could not be written at the end (the disk filled up meanwhile, say)."""


class StdoutSummary:
    """``--json`` or ``--json -``: the summary on stdout."""

    def write(self, text: str) -> None:
        print(text)

    def close(self) -> None:
        pass


class FileSummary:
    """``--json PATH``: an open file descriptor, kept from before the run to its end."""

    def __init__(self, path: str, fd: int, created: bool):
        self.path, self.fd, self.created = path, fd, created
        self.regular = stat.S_ISREG(os.fstat(fd).st_mode)
        self.written = False
        if created:
            interrupt.add_cleanup(self._remove)

    def _remove(self) -> None:
        os.unlink(self.path)

    def write(self, text: str) -> None:
        data = memoryview((text + "\n").encode())
        try:
            if self.regular:  # replaces what an existing file held
                os.ftruncate(self.fd, 0)
                os.lseek(self.fd, 0, os.SEEK_SET)
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError as e:
            raise SummaryNotWritten(f"--json {self.path}: {e.strerror}") from None
        self.written = True

    def close(self) -> None:
        """Closes the file; removes it if the run created it and wrote no summary."""
        interrupt.remove_cleanup(self._remove)
        os.close(self.fd)
        if self.created and not self.written:
            try:
                self._remove()
            except OSError:
                pass


def _open_error(path: str, error: OSError, existed: bool) -> UsageError:
    folder = os.path.dirname(os.path.realpath(path))
    if error.errno == errno.ENOENT:
        return UsageError(
            f"--json {path}: folder {folder} does not exist (expected a path in an existing folder)"
        )
    if error.errno == errno.EISDIR:
        return UsageError(f"--json {path}: is a folder (expected a file path)")
    if error.errno in (errno.EACCES, errno.EPERM):
        what = "the file" if existed else f"folder {folder}"
        return UsageError(f"--json {path}: {what} is not writable")
    return UsageError(f"--json {path}: cannot write there ({error.strerror})")


def open_summary(path: str | None) -> StdoutSummary | FileSummary | None:
    """The destination of ``--json PATH`` (None without ``--json``), ready to take the summary
    at the end of the run; UsageError, naming ``--json``, when it cannot."""
    if path is None:
        return None
    if path == "-":
        return StdoutSummary()
    if path == "":
        raise UsageError("--json '': expected a file path, or '-' (or no value) for stdout")
    if os.path.isdir(path):
        raise UsageError(f"--json {path}: is a folder (expected a file path)")
    existed = os.path.exists(path)  # a dangling link does not: opening creates its target
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _open_error(path, e, existed) from None
    try:
        os.write(fd, b"")  # a file or device that refuses writes says so now
    except OSError as e:
        os.close(fd)
        if not existed:
            os.unlink(path)
        raise UsageError(f"--json {path}: the file does not take writes ({e.strerror})") from None
    return FileSummary(path, fd, created=not existed)
