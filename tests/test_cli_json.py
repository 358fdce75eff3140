"""``run --json PATH`` with paths that cannot take a file: each fails before the run, with one
line naming ``--json`` (and leaves nothing behind), or the run succeeds and the summary is
there. Runs in-process; "before the run" means the workload was never built."""

from __future__ import annotations

import errno
import json
import os

import pytest

from jax_dflash.cli import json_output, workload
from test_cli import run_cli

TINY_RUN = ("run", "--preset", "tiny", "--steps", "2", "--no-progress")


@pytest.fixture
def no_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the workload was built before --json was checked")

    monkeypatch.setattr(workload, "Workload", refuse)


def _fails_before_the_run(capsys, path: str, reason: str) -> str:
    status, out, err = run_cli(capsys, *TINY_RUN, "--json", path)
    assert status == 2, err
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"jax-dflash: error: --json {path}: "), err
    assert reason in err
    return err


def test_an_empty_path_fails_before_the_run(capsys, no_run):
    status, out, err = run_cli(capsys, *TINY_RUN, "--json", "")
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("jax-dflash: error: --json '': expected a file path, or '-'")


@pytest.mark.parametrize("path", ["/proc/version", "/dev/full"])
def test_a_file_that_refuses_writes_fails_before_the_run(capsys, no_run, path):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    reason = "is not writable" if not os.access(path, os.W_OK) else "does not take writes"
    _fails_before_the_run(capsys, path, reason)


def test_a_name_too_long_fails_before_the_run(capsys, no_run, tmp_path):
    path = str(tmp_path / ("s" * 300 + ".json"))
    _fails_before_the_run(capsys, path, os.strerror(errno.ENAMETOOLONG))
    assert os.listdir(tmp_path) == []


def test_a_dangling_link_into_a_missing_folder_fails_before_the_run(capsys, no_run, tmp_path):
    link = tmp_path / "summary.json"
    link.symlink_to(tmp_path / "gone" / "summary.json")
    _fails_before_the_run(capsys, str(link), f"folder {tmp_path / 'gone'} does not exist")
    assert os.listdir(tmp_path) == ["summary.json"] and link.is_symlink()


def test_a_dangling_link_into_a_folder_gets_the_summary_at_its_target(capsys, tmp_path):
    link, target = tmp_path / "summary.json", tmp_path / "target.json"
    link.symlink_to(target)
    status, _, err = run_cli(capsys, *TINY_RUN, "--json", str(link))
    assert status == 0, err
    assert link.is_symlink() and json.loads(target.read_text())["steps"] == 2


def test_dev_null_takes_the_summary(capsys):
    status, out, err = run_cli(capsys, *TINY_RUN, "--json", os.devnull)
    assert status == 0, err
    assert "dflash kernel" in out


def test_an_existing_file_is_replaced_whole(capsys, tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("x" * 100_000)  # longer than the summary: nothing of it may stay
    status, _, err = run_cli(capsys, *TINY_RUN, "--json", str(path))
    assert status == 0, err
    assert json.loads(path.read_text())["command"] == "run"


def test_a_run_that_fails_leaves_an_existing_file_and_removes_a_new_one(
    capsys, monkeypatch, tmp_path
):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug of the simulation")

    monkeypatch.setattr(workload, "Workload", broken)
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text('{"kept": true}')
    for path in (old, new):
        status, _, err = run_cli(capsys, *TINY_RUN, "--json", str(path))
        assert status == 3 and "a bug of the simulation" in err
    assert json.loads(old.read_text()) == {"kept": True}
    assert not new.exists()


def test_a_write_that_fails_at_the_end_shows_the_summary_on_stdout(capsys, monkeypatch, tmp_path):
    def disk_full(self, text):
        raise json_output.SummaryNotWritten(f"--json {self.path}: {os.strerror(errno.ENOSPC)}")

    monkeypatch.setattr(json_output.FileSummary, "write", disk_full)
    path = tmp_path / "summary.json"
    status, out, err = run_cli(capsys, *TINY_RUN, "--json", str(path))
    assert status == 3
    assert err.strip().splitlines() == [
        f"jax-dflash: error: --json {path}: No space left on device (the summary is on stdout)"
    ]
    summary = json.loads(out[out.index("\n{") + 1 :])  # after the tables
    assert summary["steps"] == 2 and summary["check_passed"] is True
    assert not path.exists()  # created before the run, never written: removed
