"""Ctrl-C in the command line: every interrupt of ``jax-dflash`` (the installed console script
and ``python -m jax_dflash``) exits 130 with exactly one line on stderr, whether it lands while
the command imports jax or while the run compiles and steps. The command runs in a subprocess
that gets a real SIGINT; the moments are fixed delays after two points: the handler in place,
and the run's header printed."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

if not pathlib.Path("/proc/self/status").exists():
    pytest.skip("needs /proc to see when the handler is in place (Linux)", allow_module_level=True)

SCRIPT = pathlib.Path(sys.executable).with_name("jax-dflash")
ENTRIES = {
    "console-script": [str(SCRIPT)],
    "python-m": [sys.executable, "-m", "jax_dflash"],
}
# A run that lasts minutes: every interrupt lands while it is still running.
RUN = ["run", "--preset", "tiny", "--steps", "100000", "--no-check", "--no-progress"]
# Seconds after the handler is in place: the command line's own imports, then jax's.
DURING_IMPORT = (0.0, 0.05, 0.1, 0.2, 0.3)
# Seconds after the header: the workload's compilation, then its steps.
DURING_RUN = (0.0, 0.1, 0.3, 0.6, 1.0)
ONE_LINE = "jax-dflash: interrupted\n"


def _threads(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def _handler_in_place(proc: subprocess.Popen) -> None:
    """Waits for the handler's helper thread: the command's second thread, started before
    anything imports numpy or jax (which start threads of their own)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _threads(proc.pid) >= 2:
                return
        except OSError:
            return
        time.sleep(0.001)
    raise AssertionError("the command never started its Ctrl-C thread")


def _header_printed(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.startswith("jax-dflash run: preset tiny"), line or proc.stderr.read()


def _interrupt(entry: str, wait_for, delay: float, cwd) -> tuple[int, str]:
    # JAX on the CPU alone: a GPU runtime's own start-up logs would add lines to stderr.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [*ENTRIES[entry], *RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,  # not the checkout, whose source folder would shadow the installed package
    )
    try:
        wait_for(proc)
        time.sleep(delay)
        assert proc.poll() is None, f"the command ended before the interrupt: {proc.stderr.read()}"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.fixture(params=list(ENTRIES))
def entry(request):
    if request.param == "console-script" and not SCRIPT.exists():
        pytest.skip(f"no console script at {SCRIPT} (the package is not installed)")
    return request.param


@pytest.mark.parametrize("delay", DURING_IMPORT)
def test_interrupt_while_importing_exits_130_with_one_line(entry, delay, tmp_path):
    status, err = _interrupt(entry, _handler_in_place, delay, tmp_path)
    assert (status, err) == (130, ONE_LINE)


@pytest.mark.parametrize("delay", DURING_RUN)
def test_interrupt_during_the_run_exits_130_with_one_line(entry, delay, tmp_path):
    status, err = _interrupt(entry, _header_printed, delay, tmp_path)
    assert (status, err) == (130, ONE_LINE)


def test_the_entries_import_neither_numpy_nor_jax_before_the_handler(tmp_path):
    """What runs before the handler is in place: the console script imports its entry's module
    (and the package); none of it may import numpy or jax, whose imports take the first second."""
    code = (
        "import sys, jax_dflash.__main__, jax_dflash.cli.main; "
        "print(sorted(m for m in ('numpy', 'jax') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
