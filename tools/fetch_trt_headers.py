#!/usr/bin/env python3
"""Fetches the TensorRT 10.14 C++ headers the plugin compiles against, when no install is given.

The headers come from the PyPI wheel ``kernel-lens==2.0.1`` (only its
``kernel_lens/include/tensorrt/`` folder is used). They land in an ignored folder,
``.deps/tensorrt/include`` by default, and are never committed. With ``TENSORRT_ROOT`` set (a real
TensorRT install) nothing is fetched: CMake uses that install instead.

Usage: python tools/fetch_trt_headers.py [--dest DIR] [--force] [--quiet]
Exits 0 when the headers are present afterwards; 0 with a message also when they cannot be
fetched (no network), so that ``make build`` still builds everything else.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "kernel-lens==2.0.1"
WHEEL_PREFIX = "kernel_lens/include/tensorrt/"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO_ROOT / ".deps" / "tensorrt" / "include"
MARKER = "NvInferRuntimePlugin.h"


def _extract(wheel: Path, dest: Path) -> list[str]:
    written = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.startswith(WHEEL_PREFIX) or info.is_dir():
                continue
            relative = info.filename[len(WHEEL_PREFIX):]
            if not relative or ".." in Path(relative).parts:
                continue
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            written.append(relative)
    return written


def fetch(dest: Path, force: bool = False, quiet: bool = False) -> bool:
    say = (lambda *a: None) if quiet else (lambda *a: print("fetch_trt_headers:", *a))
    if os.environ.get("TENSORRT_ROOT"):
        say(f"TENSORRT_ROOT={os.environ['TENSORRT_ROOT']} is set; nothing to fetch")
        return True
    if (dest / MARKER).is_file() and not force:
        say(f"headers already in {dest}")
        return True
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("kernel_lens-*.whl"))
        if result.returncode != 0 or not wheels:
            say(f"could not download {PACKAGE} (the TensorRT plugin will be skipped): "
                f"{result.stderr.strip()[-500:]}")
            return False
        written = _extract(wheels[0], dest)
    if MARKER not in written:
        say(f"{PACKAGE} has no {WHEEL_PREFIX}{MARKER}; got {sorted(written)}")
        return False
    say(f"{len(written)} TensorRT headers from {PACKAGE} -> {dest}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST,
                        help=f"where the headers go (default {DEFAULT_DEST})")
    parser.add_argument("--force", action="store_true", help="download again even if present")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    fetch(args.dest, force=args.force, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
