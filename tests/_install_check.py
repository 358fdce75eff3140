"""Makes the suite test the installed jax_dflash, not the checkout's source folder.

``python -m pytest`` puts the current directory first on ``sys.path``; run from a checkout, the
source folder ``jax_dflash/`` (which holds no compiled extension) would shadow a regular
(non-editable) install. Imported by tests/conftest.py before anything imports jax_dflash, this
drops the checkout's root from ``sys.path`` whenever jax_dflash is importable without it: a
regular install is then found, and an editable one (whose import hook points at the checkout)
is unaffected. With no install at all the path is left as it was.

A checkout that was never built (no compiled CPU extension anywhere) stops pytest before it
collects anything, saying how to build or install first: every test would fail on it otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "jax_dflash"


def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or os.curdir).resolve() == REPO
    except OSError:
        return False


def prefer_installed_package() -> str | None:
    """Drops the checkout root from sys.path when an installed jax_dflash exists; returns the
    directory jax_dflash will be imported from (None when it is not importable)."""
    loaded = sys.modules.get("jax_dflash")
    if loaded is not None:
        return str(Path(loaded.__file__).parent)
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if not _is_repo_root(entry)]
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("jax_dflash")
    if spec is None or spec.origin is None:
        sys.path[:] = saved  # not installed: the source folder is all there is
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("jax_dflash")
    return None if spec is None or spec.origin is None else str(Path(spec.origin).parent)


def describe(location: str | None) -> str:
    if location is None:
        return "jax_dflash is not importable"
    if Path(location).resolve() == SOURCE:
        return f"jax_dflash from the checkout ({location})"
    return f"jax_dflash installed at {location}"


NEVER_BUILT = (
    "{where} has no compiled CPU extension (jax_dflash._dflash_cpu): this checkout was never "
    "built or installed. Build it first: `make test` creates .venv, builds and runs the suite "
    '(`make build` only builds); or, in an environment of your own, pip install -e ".[test]" '
    "from the checkout, then run pytest with that environment's python"
)

LOCATION = prefer_installed_package()


def pytest_report_header(config):
    return describe(LOCATION)


def pytest_configure(config):
    """Stops before collection when jax_dflash imports without its compiled extension."""
    if LOCATION is not None and importlib.util.find_spec("jax_dflash._dflash_cpu") is None:
        pytest.exit(
            NEVER_BUILT.format(where=describe(LOCATION)),
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
