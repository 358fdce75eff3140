#!/usr/bin/env python3
"""Fetches the TensorRT 10.14 C++ headers the plugin compiles against, when no install is given.

The headers come from the PyPI wheel ``kernel-lens==2.0.1`` (only its
``kernel_lens/include/tensorrt/`` folder is used); they are never committed. ``make build`` puts
them in ``.deps/tensorrt/include`` (ignored by git); a wheel build (``pip wheel .``) runs this
script at CMake configure time with ``--dest`` inside its build directory
(``cmake/TensorRTHeaders.cmake``). With ``TENSORRT_ROOT`` set (a real TensorRT install) nothing
is fetched.

The wheel is downloaded with ``pip download`` (so pip's index configuration applies) or, where
the running interpreter has no pip (an isolated build environment), from the package index's
JSON API (``$PIP_INDEX_URL``, else PyPI); either way the wheel's sha256 is checked.

Usage: python tools/fetch_trt_headers.py [--dest DIR] [--force] [--quiet]
Exit status 0 when the headers are in DIR afterwards, 1 (with the reason on stderr) when not.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

PROJECT, VERSION = "kernel-lens", "2.0.1"
PACKAGE = f"{PROJECT}=={VERSION}"
WHEEL_PREFIX = "kernel_lens/include/tensorrt/"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO_ROOT / ".deps" / "tensorrt" / "include"
WHEEL_NAME = "kernel_lens-2.0.1-py3-none-any.whl"
WHEEL_SHA256 = "07cc714e8b5e7f34b672f7c7fad93febe7c747be5837ba276b1527370134ffe0"
MARKER = "NvInferRuntimePlugin.h"
TIMEOUT_S = 30


class FetchError(RuntimeError):
    pass


def _extract(wheel: Path, dest: Path) -> list[str]:
    written = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.startswith(WHEEL_PREFIX) or info.is_dir():
                continue
            relative = info.filename[len(WHEEL_PREFIX) :]
            if not relative or ".." in Path(relative).parts:
                continue
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            written.append(relative)
    return written


def _download_with_pip(tmp: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--timeout",
        str(TIMEOUT_S),
        "--retries",
        "1",
        PACKAGE,
        "-d",
        str(tmp),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * TIMEOUT_S)
    wheels = sorted(tmp.glob("kernel_lens-*.whl"))
    if result.returncode != 0 or not wheels:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR:")]
        why = " ".join(errors[-2:]) if errors else result.stderr.strip()[-300:]
        raise FetchError(f"pip download {PACKAGE} failed: {why}")
    return wheels[0]


def _download_from_index(tmp: Path) -> Path:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    url = f"{index}/{PROJECT}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            files = json.load(response)["files"]
        info = next(f for f in files if f["filename"] == WHEEL_NAME)
        with urllib.request.urlopen(urllib.parse.urljoin(url, info["url"]), timeout=TIMEOUT_S) as r:
            data = r.read()
    except (OSError, ValueError, KeyError, StopIteration) as e:
        raise FetchError(f"download of {WHEEL_NAME} from {url} failed: {e!r}") from e
    wheel = tmp / WHEEL_NAME
    wheel.write_bytes(data)
    return wheel


def _check_hash(wheel: Path) -> None:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise FetchError(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}")


def fetch(dest: Path, force: bool = False, quiet: bool = False) -> None:
    """Puts the headers in ``dest``; raises FetchError saying why when it cannot."""
    say = (lambda *a: None) if quiet else (lambda *a: print("fetch_trt_headers:", *a))
    if (dest / MARKER).is_file() and not force:
        say(f"headers already in {dest}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        has_pip = importlib.util.find_spec("pip") is not None
        wheel = _download_with_pip(tmp) if has_pip else _download_from_index(tmp)
        _check_hash(wheel)
        written = _extract(wheel, dest)
    if MARKER not in written:
        raise FetchError(f"{PACKAGE} has no {WHEEL_PREFIX}{MARKER}; got {sorted(written)[:20]}")
    say(f"{len(written)} TensorRT headers from {PACKAGE} -> {dest}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_DEST,
        help=f"where the headers go (default {DEFAULT_DEST})",
    )
    parser.add_argument("--force", action="store_true", help="download again even if present")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TENSORRT_ROOT"):
        if not args.quiet:
            print(
                f"fetch_trt_headers: TENSORRT_ROOT={os.environ['TENSORRT_ROOT']} is set; "
                "nothing to fetch"
            )
        return 0
    try:
        fetch(args.dest, force=args.force, quiet=args.quiet)
    except (FetchError, OSError, subprocess.TimeoutExpired, zipfile.BadZipFile) as e:
        print(f"fetch_trt_headers: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
