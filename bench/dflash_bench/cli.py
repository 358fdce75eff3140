"""The command line: flags checked against their bounds before any work, then the run."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from dflash_bench.clocks import GpuClocks, clock_notes, mark_clock_limited
from dflash_bench.contenders import CONTENDERS
from dflash_bench.copy_floor import peak_copy_bandwidth
from dflash_bench.report import (
    device_name,
    errors,
    format_table,
    new_results,
    print_findings,
    write_outputs,
)
from dflash_bench.runner import run_shape
from dflash_bench.shapes import shapes_for
from dflash_bench.targets import evaluate_targets
from dflash_bench.timing import Settings, Skip

DEFAULT_OUT = Path(".")  # the current directory; pass --out bench/results to refresh the results
# --iters: a JAX contender's chain is unrolled when traced (jax_contenders.jitted_chain), and
# XLA's compile time and memory grow faster than linearly in its length; past this the unfused
# pair's chain no longer compiles within minutes (the op's own chain compiles in seconds).
MAX_ITERS = 2048
# --repeats: the median does not move with more; a run makes repeats x contenders x shapes
# measurements of at least --min-time each.
MAX_REPEATS = 1000
# --min-time: a minute per measurement; the calibration multiplies it into a call count, which
# for huge values overflows a float or never ends.
MAX_MIN_TIME_S = 60.0


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low} to {high}, got {text!r}"
            ) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low} to {high}, got {value}"
            )
        return value

    return parse


def _seconds(text: str) -> float:
    expected = f"expected a number of seconds > 0 and <= {MAX_MIN_TIME_S:g}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_MIN_TIME_S):
        raise argparse.ArgumentTypeError(f"{expected}, got {text}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Times the DFlash target KV-cache update (slot and paged contracts, FP8, "
        "int8 and int4 pools, dynamic scales, the fused k-norm) against the straightforward JAX version, FlashInfer and a "
        "device copy; prints a table, writes JSON and a PNG plot.",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="gpu when JAX sees one (auto), else cpu with scaled-down shapes",
    )
    p.add_argument(
        "--shapes",
        default="",
        help="comma-separated subset of shape names (default: all for the backend)",
    )
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)}",
    )
    p.add_argument(
        "--iters",
        type=_int_in(1, MAX_ITERS),
        default=None,
        help=f"updates per jitted call / CUDA graph, 1 to {MAX_ITERS} (default 512 GPU, so that "
        "JAX's per-call dispatch stays hidden behind the GPU at decode sizes; 16 "
        "CPU); the straightforward JAX version uses at most 32 on GPU (compile time)",
    )
    p.add_argument(
        "--repeats",
        type=_int_in(1, MAX_REPEATS),
        default=None,
        help=f"measurements per contender, 1 to {MAX_REPEATS}, interleaved with the other "
        "contenders' (median; default 10 GPU, 5 CPU, 3 with --quick)",
    )
    p.add_argument(
        "--min-time",
        type=_seconds,
        default=None,
        help=f"seconds per measurement at least, > 0 and <= {MAX_MIN_TIME_S:g} (default 0.05 "
        "GPU, 0.1 CPU, 0.01 with --quick)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="directory for the JSON and PNG, created if missing (default: the current directory)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer, shorter measurements (a smoke run, not for publishing)",
    )
    p.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    return p


def _settings(args, backend: str) -> Settings:
    gpu = backend == "gpu"
    chain = args.iters or ((64 if gpu else 4) if args.quick else (512 if gpu else 16))
    repeats = args.repeats or (3 if args.quick else 10 if gpu else 5)
    min_time = (
        args.min_time
        if args.min_time is not None
        else (0.01 if args.quick else 0.05 if gpu else 0.1)
    )
    baseline_chain = min(chain, 32) if gpu else chain
    return Settings(backend, chain, baseline_chain, repeats, min_time)


def _check_out_dir(out: Path) -> str | None:
    """None when ``out`` is (now) a writable directory, else why not."""
    if out.exists() and not out.is_dir():
        return "it exists and is not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create it ({e.strerror or e})"
    if not out.is_dir():
        return "it is not a directory"
    if not os.access(out, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def _detect_backend() -> str:
    import jax

    try:
        return "gpu" if jax.devices("gpu") else "cpu"
    except RuntimeError:
        return "cpu"


def _list_shapes(available: dict) -> None:
    for s in available.values():
        print(
            f"{s.name:<24} {s.describe()}, M = pages_per_slot = {s.pages_per_slot}, "
            f"{s.num_pages} pages{', unfused pair' if s.unfused else ''}"
            f"{', GEMM chain' if s.gemm_chain else ''}"
        )


def _contenders_or_error(args) -> tuple[list[str], str | None]:
    contenders = [n for n in args.contenders.split(",") if n]
    if bad := [n for n in contenders if n not in CONTENDERS]:
        return contenders, f"--contenders: unknown {bad}; expected names from {list(CONTENDERS)}"
    if not contenders:
        return contenders, f"--contenders: expected at least one of {list(CONTENDERS)}, got none"
    return contenders, None


def _backend_or_error(args) -> tuple[str, str | None]:
    if not args.list_shapes and (why := _check_out_dir(args.out)):
        return "", f"--out: expected a writable directory, got {str(args.out)!r}: {why}"
    backend = _detect_backend() if args.backend == "auto" else args.backend
    if backend == "gpu" and _detect_backend() != "gpu":
        return backend, "--backend gpu: expected JAX to see a GPU, it sees none here"
    return backend, None


def _shapes_or_error(args, backend: str, available: dict) -> tuple[list[str], str | None]:
    wanted = [n for n in args.shapes.split(",") if n] or list(available)
    unknown = [n for n in wanted if n not in available]
    if unknown:
        return wanted, (
            f"--shapes: unknown {unknown} for backend {backend}; expected names from "
            f"{list(available)}"
        )
    return wanted, None


def _measure(results: dict, settings: Settings, available: dict, wanted: list) -> None:
    """Every wanted shape into ``results``, the GPU's clocks sampled meanwhile; then the
    targets and the clock notes."""
    clocks = GpuClocks() if settings.backend == "gpu" else None
    off = clocks.start() if clocks is not None else "not sampled on the CPU backend"
    results["clock_sampling"] = (
        f"nvidia-smi --query-gpu={GpuClocks.QUERY} -i {clocks.gpu} every {clocks.period_ms} ms"
        if off is None
        else f"off: {off}"
    )
    peak = results["peak_copy_bandwidth"]["bytes_per_s"]
    try:
        for name in wanted:
            shape = available[name]
            results["shapes"].append(
                run_shape(shape, settings, results["contenders"], peak, clocks)
            )
    finally:
        if clocks is not None:
            clocks.stop()
    results["targets"] = evaluate_targets(results)
    results["clock_notes"] = clock_notes(results)
    mark_clock_limited(results)


def _peak(backend: str) -> dict:
    try:
        peak = peak_copy_bandwidth(backend)
    except Skip as e:
        peak = {"bytes_per_s": None, "method": f"not measured: {e}"}
    if peak["bytes_per_s"]:
        print(f"measured copy bandwidth: {peak['bytes_per_s'] / 1e9:.1f} GB/s ({peak['method']})")
    return peak


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    # JAX must not grab most of the GPU: torch (raw launcher, FlashInfer, copy) shares it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = build_parser(prog).parse_args(argv)  # numeric flags out of bounds exit 2 here
    contenders, why = _contenders_or_error(args)
    backend, why = (None, why) if why else _backend_or_error(args)
    if why:
        print(why, file=sys.stderr)
        return 2
    available = {s.name: s for s in shapes_for(backend)}
    if args.list_shapes:
        _list_shapes(available)
        return 0
    wanted, why = _shapes_or_error(args, backend, available)
    if why:
        print(why, file=sys.stderr)
        return 2
    settings = _settings(args, backend)

    device = device_name(backend)
    print(
        f"DFlash KV-update benchmark: backend {backend}, device {device}; "
        f"{settings.chain} updates per call (baseline {settings.baseline_chain}), "
        f"{settings.repeats} interleaved measurements of >= {settings.min_time} s per "
        f"contender",
        flush=True,
    )
    peak = _peak(backend)
    t0 = time.perf_counter()
    results = new_results(settings, device, argv, args.quick, contenders, peak)
    _measure(results, settings, available, wanted)
    results["wall_s"] = round(time.perf_counter() - t0, 1)

    print()
    print(format_table(results))
    print()
    wrong = print_findings(results)
    write_outputs(results, args.out)
    print(f"total {results['wall_s']} s")
    # A contender that could not run is no result either: the run fails (skips are reasoned).
    failed = errors(results)
    if failed:
        print(f"{len(failed)} contender-shape(s) failed with an error: the run exits 1")
    return 1 if wrong or failed else 0
