"""The ``jax-dflash`` command line: ``run`` (the DFlash draft-cache workload) and ``check`` (the
environment and a parity self-test). The benchmark lives apart from the package, in ``bench/``.

Exit status: 0 on success, 1 when a check fails, 2 on bad flags (one line on stderr saying why).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import json
import os
import sys
import textwrap

import numpy as np

PROG = "jax-dflash"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2
BACKENDS = ("default", "cpu", "gpu")
DEFAULT_ACCEPT = "geometric:0.8"


class UsageError(Exception):
    """A flag combination that cannot run; the message is the one-line reason."""


# ---- argument parsing ---------------------------------------------------------------------------


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, else a one-line reason."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


_positive_int = _int_at_least(1)
_seed = _int_at_least(0)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=100)


def build_parser() -> argparse.ArgumentParser:
    from jax_dflash.cli.presets import DEFAULT_PRESET, DTYPE_NAMES, PRESETS, presets_help
    from jax_dflash.cli.workload import ACCEPT_HELP

    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=_Formatter,
        description=("The DFlash target KV-cache update (one kernel for JAX and TensorRT), "
                     "exercised the way a DFlash draft model uses it."),
        epilog=textwrap.dedent(f"""\
            commands:
              run     simulate the draft side of DFlash decoding and check the result
              check   report the JAX backends, the CUDA extension and the TensorRT plugin, and
                      test the op against the NumPy reference on every backend

            """) + presets_help() + (
            f"\n\nQuick start: `make demo` (= `{PROG} run`), then `{PROG} check`."),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{run,check}")
    commands.required = True

    run = commands.add_parser(
        "run", formatter_class=_Formatter,
        help="simulate DFlash draft-cache updates and check them against the NumPy reference",
        description=textwrap.dedent("""\
            Simulates the draft side of DFlash decoding. For each step, every sequence of the
            batch accepts 1..block-size tokens (--accept); random context features go through
            every draft layer's random k_proj/v_proj and a k-norm, and one jitted step writes
            the keys (with RoPE) and values of all layers into their paged pools with the op
            (layer-batched: pools [layers, 2, numPages, P, H, D], donated: updated in place).
            Positions advance by the accepted length; a sequence that reaches its slot's
            capacity STOPS (its last step is clipped, later steps write nothing; no wrap).

            At the end the final pools are compared bit for bit with the NumPy reference
            (jax_dflash.reference), replayed on the host as one update per sequence.

            Summary: steps/s; accepted tokens/s; step time; update time, measured by running
            the same steps again with only the update (same positions and lengths, fixed
            deltas); the update's share of the step = update time / step time; update GB/s =
            bytes the update must move (per accepted token and layer: read k and v, write both
            into the pool, read one float32 RoPE row) / update time. Timings exclude
            compilation, warm-up steps and the fetches for the check; on a busy CPU they are
            noisy."""),
        epilog=presets_help(),
    )
    run.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET,
                     help=f"draft shape (default: {DEFAULT_PRESET}; list below)")
    run.add_argument("--backend", choices=BACKENDS, default="default",
                     help="JAX backend to run on (default: JAX's default backend)")
    run.add_argument("--steps", type=_positive_int, metavar="N",
                     help="decoding steps (default: the preset's)")
    run.add_argument("--batch", type=_positive_int, metavar="B",
                     help="sequences, at most the preset's slots (default: the preset's)")
    run.add_argument("--seed", type=_seed, default=0, metavar="S",
                     help="seed of every random draw (default: 0)")
    run.add_argument("--accept", default=DEFAULT_ACCEPT, metavar="DIST",
                     help=f"accepted lengths per step: {ACCEPT_HELP} (default: {DEFAULT_ACCEPT})")
    run.add_argument("--dtype", choices=DTYPE_NAMES,
                     help="pool and delta dtype (default: the preset's)")
    run.add_argument("--compare", action="store_true",
                     help="also run the straightforward jnp update (jax_dflash.baseline, looped "
                          "over the layers) and print both; only the kernel must be bit-exact")
    run.add_argument("--no-check", dest="check", action="store_false",
                     help="skip the comparison with the NumPy reference")
    run.add_argument("--json", nargs="?", const="-", metavar="PATH",
                     help="write a machine-readable summary to PATH, or to stdout with no PATH "
                          "or '-' (the table then goes to stderr)")
    run.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar")
    run.set_defaults(func=cmd_run)

    check = commands.add_parser(
        "check", formatter_class=_Formatter,
        help="report backends, extensions, the TensorRT plugin, and run a parity self-test",
        description=textwrap.dedent("""\
            Reports the JAX version, backends and devices; whether the CUDA extension
            (jax_dflash._dflash_cuda) loads; the TensorRT plugin library's path and whether a
            TensorRT runtime (tensorrt or tensorrt_lean) is installed and can load it. Then
            a parity self-test: the op against the NumPy reference, bit for bit, on every
            available backend (cpu, and gpu when JAX has one) for float16, bfloat16 and
            float32, on small random shapes with hostile positions (negative, past the slot,
            near INT32_MAX and INT32_MIN), padding, lengths past L, per-sequence RoPE and
            per-layer positions. Exits 1 if any case differs."""),
    )
    check.add_argument("--seed", type=_seed, default=0, metavar="S",
                       help="seed of the random cases (default: 0)")
    check.set_defaults(func=cmd_check)

    return parser


def _version() -> str:
    from jax_dflash import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with usage and a reason on bad flags
    try:
        return args.func(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`| head`): stop writing, quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


# ---- run ----------------------------------------------------------------------------------------


def select_device(backend: str):
    """The first device of ``backend`` ('default', 'cpu' or 'gpu'); UsageError if there is none
    or the op cannot run there."""
    import jax

    if backend == "default":
        device = jax.devices()[0]
    else:
        try:
            device = jax.devices(backend)[0]
        except RuntimeError:
            raise UsageError(
                f"--backend {backend}: JAX has no {backend} device here (JAX's default backend "
                f"is {jax.default_backend()})") from None
    if device.platform not in ("cpu", "gpu", "cuda"):
        raise UsageError(f"--backend {backend}: the op runs on cpu and CUDA GPUs, JAX's device "
                         f"here is {device.platform}")
    return device


def cmd_run(args) -> int:
    from jax_dflash.cli.presets import PRESETS
    from jax_dflash.cli.workload import Workload, parse_accept

    preset = PRESETS[args.preset]
    batch = args.batch if args.batch is not None else preset.default_batch
    steps = args.steps if args.steps is not None else preset.default_steps
    if batch > preset.num_slots:
        raise UsageError(
            f"--batch {batch} is larger than the pool's {preset.num_slots} slots of preset "
            f"{preset.name} (expected --batch <= {preset.num_slots})")
    try:
        accept = parse_accept(args.accept, preset.block_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    device = select_device(args.backend)

    to_stdout_json = args.json == "-"
    out = sys.stderr if to_stdout_json else sys.stdout
    workload = Workload(preset, batch=batch, steps=steps, seed=args.seed, accept=accept,
                        device=device, dtype=args.dtype)
    print(_run_header(workload, device), file=out, flush=True)

    impls = ["kernel", "baseline"] if args.compare else ["kernel"]
    results = []
    for impl in impls:
        results.append(workload.run(impl, check=args.check, progress=args.progress))
    print(file=out)
    print(_results_table(results, workload), file=out)
    failed = [r for r in results if r.failed]
    if failed:
        print(f"{PROG}: check FAILED: the kernel's pools differ from the NumPy reference in "
              f"{failed[0].mismatched_elements} of {failed[0].checked_elements} elements",
              file=sys.stderr)

    if args.json is not None:
        text = json.dumps(_run_summary(workload, device, results), indent=2)
        if to_stdout_json:
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def _run_header(w, device) -> str:
    p = w.preset
    s = w.schedule
    active = int(np.count_nonzero(s.lengths))
    mean = w.accepted_tokens / active if active else 0.0
    return "\n".join([
        f"{PROG} run: preset {p.name} ({p.summary})",
        f"  device {device.platform}:{device.id} ({device.device_kind}); {w.dtype_name}",
        f"  {p.num_layers} draft layers, pool [layers, 2, numPages, P, H, D] = "
        f"{list(w.pool_shape)} ({w.initial_pool.nbytes / 2**20:.1f} MiB), "
        f"block {p.block_size}, slot capacity {p.slot_capacity} tokens",
        f"  batch {w.batch} of {p.num_slots} slots, {w.steps} steps, accept {w.accept.describe()}"
        f": {w.accepted_tokens} tokens accepted (mean {mean:.2f} per sequence and step), "
        f"{s.stopped} of {w.batch} sequences reached the slot capacity and stopped",
    ])


def _fmt(value, spec, missing="n/a"):
    return missing if value is None else format(value, spec)


def _check_text(r) -> str:
    if r.check == "skipped":
        return "skipped"
    if r.check == "bit-exact":
        return "bit-exact vs reference"
    prefix = "FAILED: " if r.failed else ""
    return (f"{prefix}{r.mismatched_elements} of {r.checked_elements} elements differ "
            f"(max {r.max_ulp} ulp)")


def _results_table(results, w) -> str:
    header = ("implementation", "steps/s", "accepted tok/s", "step ms", "update ms",
              "update share", "update GB/s", "compile s", "check")
    rows = [header]
    for r in results:
        rows.append((
            r.label,
            f"{r.steps_per_s:.1f}",
            f"{r.accepted_tokens_per_s:.0f}",
            f"{r.timing.step_seconds * 1e3:.3f}",
            _fmt(r.update_seconds_per_step and r.update_seconds_per_step * 1e3, ".3f"),
            _fmt(r.update_share and r.update_share * 100, ".1f") + ("%" if r.update_share
                                                                    is not None else ""),
            _fmt(r.update_gb_per_s, ".3f"),
            f"{r.timing.compile_seconds:.2f}",
            _check_text(r),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(widths[i]) for i, c in enumerate(row[1:-1], start=1)]
        cells.append(row[-1])
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    lines.append(f"(update: the same {w.steps} steps with only the update; it moves "
                 f"{w.update_bytes / 1e6:.2f} MB per run)")
    return "\n".join(lines)


def _run_summary(w, device, results) -> dict:
    import jax

    p = w.preset
    active = int(np.count_nonzero(w.schedule.lengths))
    return {
        "command": "run",
        "preset": p.name,
        "preset_source": p.source,
        "backend": device.platform,
        "device": f"{device.platform}:{device.id} ({device.device_kind})",
        "jax_version": jax.__version__,
        "shape": {
            "layers": p.num_layers, "num_kv_heads": p.num_kv_heads, "head_dim": p.head_dim,
            "rotary_dim": p.head_dim, "hidden_size": p.hidden_size,
            "block_size": p.block_size, "page_size": p.page_size,
            "pages_per_slot": p.pages_per_slot, "slots": p.num_slots,
            "slot_capacity": p.slot_capacity, "pool_shape": list(w.pool_shape),
            "pool_bytes": int(w.initial_pool.nbytes), "dtype": w.dtype_name,
        },
        "batch": w.batch,
        "steps": w.steps,
        "seed": w.seed,
        "accept": w.accept.describe(),
        "capacity_policy": "stop",
        "accepted_tokens": w.accepted_tokens,
        "mean_accepted_length": w.accepted_tokens / active if active else 0.0,
        "sequences_stopped": w.schedule.stopped,
        "results": [r.as_dict() for r in results],
        "check_passed": (None if all(r.check == "skipped" for r in results)
                         else not any(r.failed for r in results)),
    }


# ---- check --------------------------------------------------------------------------------------


def available_backends() -> list[str]:
    import jax

    backends = ["cpu"]
    try:
        if jax.devices("gpu"):
            backends.append("gpu")
    except RuntimeError:
        pass
    return backends


def _tensorrt_report() -> tuple[str, str]:
    """(plugin library line, runtime line)."""
    import jax_dflash

    path_fn = getattr(jax_dflash, "trt_plugin_library_path", None)
    if path_fn is None:
        try:
            path_fn = importlib.import_module("jax_dflash._ext").trt_plugin_library_path
        except (ImportError, AttributeError):
            path_fn = None
    path = None
    if path_fn is None:
        library = "unknown (this installation has no jax_dflash.trt_plugin_library_path)"
    else:
        try:
            path = path_fn()
            library = str(path)
            try:
                ctypes.CDLL(path)
                library += " (dlopen: ok)"
            except OSError as e:
                library += f" (dlopen FAILED: {e})"
        except FileNotFoundError as e:
            library = f"not built ({e})"
        except Exception as e:  # noqa: BLE001 - a report, not a crash
            library = f"unavailable ({type(e).__name__}: {e})"

    runtime_module = None
    errors = []
    for name in ("tensorrt", "tensorrt_lean", "tensorrt_lean_bindings"):
        try:
            runtime_module = importlib.import_module(name)
            break
        except Exception as e:  # noqa: BLE001 - a missing CUDA library raises OSError too
            errors.append(f"{name}: {type(e).__name__}" if not isinstance(e, ImportError)
                          else None)
    if runtime_module is None:
        extra = "; ".join(e for e in errors if e)
        return library, "not installed (none of tensorrt, tensorrt_lean, tensorrt_lean_bindings imports" + (
            f"; {extra})" if extra else ")")
    runtime = f"{runtime_module.__name__} {getattr(runtime_module, '__version__', '?')}"
    if path is None:
        return library, f"{runtime} installed; no plugin library to load"
    try:
        registry = runtime_module.get_plugin_registry()
        if not registry.load_library(str(path)):
            return library, f"{runtime} installed, but its plugin registry did not load the library"
        creator = None
        try:
            creator = registry.get_creator("DFlashTargetKVCacheUpdate", "1", "")
        except Exception:  # noqa: BLE001
            creator = None
        found = "found" if creator is not None else "NOT found"
        return library, (f"{runtime} loaded the plugin library; creator "
                         f"DFlashTargetKVCacheUpdate v1 {found}")
    except Exception as e:  # noqa: BLE001
        return library, f"{runtime} could not load it: {type(e).__name__}: {e}"


def parity_cases(rng: np.random.Generator, dtype: np.dtype) -> list[tuple[str, tuple, int]]:
    """``(name, operands, pages_per_slot)``: small shapes with hostile positions."""
    int32_max, int32_min = np.iinfo(np.int32).max, np.iinfo(np.int32).min

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    def rope(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    def i32(values):
        return np.asarray(values, np.int32)

    cases = []
    # Unbatched; S < capacity (keys past S are written unrotated); R < D. Starts: negative,
    # straddling the slot's end, near INT32_MAX and INT32_MIN, plain; lengths: past L, zero,
    # negative.
    b, length, h, d, page, pps = 6, 5, 2, 16, 4, 3  # capacity 12
    cases.append(("unbatched, hostile positions", (
        normal(b, length, h, d), normal(b, length, h, d), normal(2, 7 * pps, page, h, d),
        rope(1, 9, 8), i32([-2, 9, int32_max - 2, 3, int32_min, 0]), i32([5, 9, 4, 0, 5, -1]),
    ), pps))
    # Layer-batched with per-layer positions and per-sequence RoPE.
    layers, b, length, h, d, page, pps = 3, 2, 4, 3, 8, 2, 4  # capacity 8
    cases.append(("layer-batched, per-layer positions, per-sequence RoPE", (
        normal(layers, b, length, h, d), normal(layers, b, length, h, d),
        normal(layers, 2, b * pps, page, h, d), rope(b, page * pps, d),
        rng.integers(-3, 11, (layers, b)).astype(np.int32),
        rng.integers(-1, length + 3, (layers, b)).astype(np.int32),
    ), pps))
    # Odd head dim, no rotation, one token per page; the second sequence runs off its slot.
    b, length, h, d, page, pps = 2, 3, 1, 7, 1, 5
    cases.append(("odd head dim, no RoPE, page size 1", (
        normal(b, length, h, d), normal(b, length, h, d), normal(2, b * pps, page, h, d),
        rope(1, 5, 0), i32([0, 3]), i32([3, 3]),
    ), pps))
    return cases


@functools.lru_cache(maxsize=None)
def _jitted_op(pages_per_slot: int):
    import jax

    from jax_dflash import target_kv_cache_update
    return jax.jit(functools.partial(target_kv_cache_update, pages_per_slot=pages_per_slot))


def run_parity(backend: str, dtype: np.dtype, seed: int) -> tuple[int, list[str]]:
    """Runs every parity case on ``backend``: (cases passed, one line per failure)."""
    import jax

    from jax_dflash import reference
    from jax_dflash.cli.workload import compare_bits

    device = jax.devices(backend)[0]
    rng = np.random.default_rng(seed)
    passed, failures = 0, []
    for name, operands, pages_per_slot in parity_cases(rng, dtype):
        expected = reference.target_kv_cache_update(*operands, pages_per_slot=pages_per_slot)
        try:
            args = [jax.device_put(x, device) for x in operands]
            actual = np.asarray(_jitted_op(pages_per_slot)(*args))
        except Exception as e:  # noqa: BLE001 - reported as a failed case
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        mismatches, max_ulp = compare_bits(actual, expected)
        if mismatches:
            failures.append(f"{name}: {mismatches} of {expected.size} elements differ "
                            f"(max {max_ulp} ulp)")
        else:
            passed += 1
    return passed, failures


def cmd_check(args) -> int:
    import jax

    from jax_dflash import _ext
    from jax_dflash.cli.presets import DTYPE_NAMES, dtype_from_name

    print(f"{PROG} {_version()}, JAX {jax.__version__}")
    print(f"default backend: {jax.default_backend()}")
    backends = available_backends()
    for backend in backends:
        devices = ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices(backend))
        print(f"  {backend}: {devices}")
    if "gpu" not in backends:
        print("  gpu: none (this JAX has no GPU backend or sees no GPU)")

    if _ext.cuda_extension_available():
        cuda = "loaded (jax_dflash._dflash_cuda)"
    else:
        try:
            _ext.extension("cuda")
        except ImportError as e:
            cuda = f"not available: {str(e).splitlines()[0]}"
        else:  # pragma: no cover - available after all
            cuda = "loaded"
    print(f"CUDA extension: {cuda}")
    library, runtime = _tensorrt_report()
    print(f"TensorRT plugin library: {library}")
    print(f"TensorRT runtime: {runtime}")

    print("parity self-test (op vs NumPy reference, bit for bit):")
    all_passed = True
    for backend in backends:
        for name in DTYPE_NAMES:
            passed, failures = run_parity(backend, dtype_from_name(name), args.seed)
            total = passed + len(failures)
            verdict = "bit-exact" if not failures else "FAILED"
            print(f"  {backend:<4} {name:<9} {passed}/{total} cases {verdict}")
            for failure in failures:
                print(f"      {failure}")
            all_passed &= not failures
    print("parity: all cases bit-exact" if all_passed else "parity: FAILED")
    return EXIT_OK if all_passed else EXIT_CHECK_FAILED
