"""Builds the decode-size probe (decode_probe.cu) into OUTDIR.

The probe times the shipped kernel as compiled from csrc/dflash (build.py), with its tuning
macros at their defaults or set on the command line, next to launch floors, copies and stripped
probe kernels of its own.

    python3 bench/kernel_variants/make_probe.py /tmp/probe && /tmp/probe/decode_probe
    python3 bench/kernel_variants/make_probe.py /tmp/probe256 DFLASH_BLOCK_THREADS=256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from build import HERE, KNOBS, build


def knob(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or name not in KNOBS or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(
            f"expected NAME=INT with NAME one of {KNOBS}, got {text!r}"
        )
    return name, int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the decode_probe binary")
    parser.add_argument("knobs", nargs="*", type=knob, help="tuning macros, NAME=INT")
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: CPUs)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    target = build(
        args.out.resolve(), HERE / "decode_probe.cu", "decode_probe", dict(args.knobs), args.jobs
    )
    print(f"built {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
