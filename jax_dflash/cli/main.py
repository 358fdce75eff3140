"""The ``jax-dflash`` command line: ``run`` (the DFlash draft-cache workload) and ``check`` (the
environment and a parity self-test). The benchmark lives apart from the package, in ``bench/``.

Exit status: 0 on success, 1 when a check fails (and only then), 2 on bad flags (one line on
stderr saying why, before anything runs), 3 on an unexpected error (with its traceback), 130 on
Ctrl-C.
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
import traceback

import numpy as np

PROG = "jax-dflash"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
BACKENDS = ("default", "cpu", "gpu")
CONTRACTS = ("slot", "paged")
DEFAULT_ACCEPT = "geometric:0.8"
SEED_LIMIT = 2**63  # numpy's default_rng takes any int; keep seeds in int64 for the JSON
# Run bounds: a step costs milliseconds, so a million steps is already a long run; memory for
# the run's per-step inputs and the check's deltas is estimated and bounded below.
MAX_STEPS = 1_000_000
# The paged plan is simulated on the host, about 15 us per sequence and step.
MAX_PAGED_SEQUENCE_STEPS = 2_000_000
HOST_MEMORY_SHARE = 0.5  # of the machine's physical memory


class UsageError(Exception):
    """A flag combination that cannot run; the message is the one-line reason."""


# ---- argument parsing ---------------------------------------------------------------------------


def _int_in(minimum: int, limit: int | None = None):
    """An argparse type: an integer >= ``minimum`` (and < ``limit``), else a one-line reason."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if limit is not None and value >= limit:
            raise argparse.ArgumentTypeError(
                f"expected an integer < {limit} (2**{limit.bit_length() - 1}), got {text!r}"
            )
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


_positive_int = _int_in(1)
_seed = _int_in(0, SEED_LIMIT)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=100)


def build_parser() -> argparse.ArgumentParser:
    from jax_dflash.cli.presets import DEFAULT_PRESET, DTYPE_NAMES, KV_DTYPES, PRESETS, presets_help
    from jax_dflash.cli.workload import ACCEPT_HELP

    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_Formatter,
        description=(
            "The DFlash target KV-cache update (one kernel for JAX and TensorRT), "
            "exercised the way a DFlash draft model uses it."
        ),
        epilog=textwrap.dedent("""\
            commands:
              run     simulate the draft side of DFlash decoding and check the result
              check   report the JAX backends, the CUDA extension and the TensorRT plugin, and
                      test the op against the NumPy reference on every backend

            """)
        + presets_help()
        + (f"\n\nQuick start: `make demo` (= `{PROG} run`), then `{PROG} check`."),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{run,check}")
    commands.required = True

    run = commands.add_parser(
        "run",
        formatter_class=_Formatter,
        help="simulate DFlash draft-cache updates and check them against the NumPy reference",
        description=textwrap.dedent("""\
            Simulates the draft side of DFlash decoding as an engine runs it. Each step, every
            sequence of the batch accepts 1..block-size tokens (--accept); ONE jitted step
            takes their target features through the draft's fc projection and norm, all
            layers' k/v projections as one matmul, and the op (fused k-norm, RoPE, the pool
            dtype's FP8 scales), which writes every layer's pool in one launch (layer-batched
            pools [layers, 2, numPages, P, H, D], donated: updated in place).

            --contract slot: sequence b owns slot b (pages_per_slot pages); it starts at a
            random position, and when it reaches its slot's capacity it STOPS (its last step
            is clipped, later steps write nothing; no wrap).
            --contract paged: token-major ragged deltas and a page table. A page allocator
            hands out pages as sequences grow and takes them back when they finish; finished
            sequences are replaced by new ones started from a prompt pool, whose full pages
            are prefilled once and shared by every sequence using that prompt. --window N
            keeps a sliding window of N tokens per layer in N/P + 1 ring pages (ring=True).

            Checks: the final pools against the NumPy reference (jax_dflash.reference), bit for
            bit, replayed on the host; and a read-back check: attention of draft queries over
            the pool equals attention over keys and values recomputed from the features
            without a cache, within the pool dtype's rounding.

            Summary: pool memory; steps/s; accepted tokens/s; the update's share of the step,
            measured as the same jitted step with and without the update (share = 1 - step
            without / step with, at most 100%); update GB/s = bytes the update must move /
            the update's time. Timings exclude compilation, prefill, warm-up steps and the
            check's fetches; on a busy CPU they are noisy."""),
        epilog=presets_help(),
    )
    run.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=DEFAULT_PRESET,
        help=f"draft shape (default: {DEFAULT_PRESET}; list below)",
    )
    run.add_argument(
        "--contract",
        choices=CONTRACTS,
        help="slot (Edge-LLM 0.10) or paged (0.11) addressing (default: the "
        "preset's, slot for all but the sliding-window one)",
    )
    run.add_argument(
        "--window",
        type=_positive_int,
        metavar="N",
        help="sliding window of every draft layer, in tokens (a multiple of the "
        "page size; paged contract; default: the preset's)",
    )
    run.add_argument(
        "--backend",
        choices=BACKENDS,
        default="default",
        help="JAX backend to run on (default: JAX's default backend)",
    )
    run.add_argument(
        "--steps",
        type=_positive_int,
        metavar="N",
        help=f"decoding steps, at most {MAX_STEPS} (default: the preset's)",
    )
    run.add_argument(
        "--batch",
        type=_positive_int,
        metavar="B",
        help="sequences in flight, at most the preset's slots (default: the preset's)",
    )
    run.add_argument(
        "--seed",
        type=_seed,
        default=0,
        metavar="S",
        help="seed of every random draw, 0 <= S < 2**63 (default: 0)",
    )
    run.add_argument(
        "--accept",
        default=DEFAULT_ACCEPT,
        metavar="DIST",
        help=f"accepted lengths per step: {ACCEPT_HELP} (default: {DEFAULT_ACCEPT})",
    )
    run.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        help="delta (compute) dtype, and the pool's unless --kv-dtype (default: the preset's)",
    )
    run.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        help="pool dtype: fp16, bf16, fp32, or FP8 e4m3 / e5m2 with per-head "
        "k/v scales calibrated once (default: the delta dtype)",
    )
    run.add_argument(
        "--fused-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the op applies the k-norm (default: on when the op supports it); "
        "--no-fused-norm runs a jnp RMSNorm, then the op",
    )
    run.add_argument(
        "--compare",
        action="store_true",
        help="also run the unfused pipeline a JAX user writes (jnp RMSNorm, jnp "
        "RoPE, .at[].set per layer, FP8 by astype after a jnp saturation) "
        "and print both; only the kernel must be bit-exact. Says how long "
        "it will take before starting it",
    )
    run.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the checks (reference and read-back)",
    )
    run.add_argument("--force", action="store_true", help="run a GPU-sized preset on a CPU anyway")
    run.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write a machine-readable summary to PATH (checked before the run), "
        "or to stdout with no PATH or '-' (the table then goes to stderr)",
    )
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    run.set_defaults(func=cmd_run)

    check = commands.add_parser(
        "check",
        formatter_class=_Formatter,
        help="report backends, extensions, the TensorRT plugin, and run a parity self-test",
        description=textwrap.dedent("""\
            Reports the JAX version, backends and devices; whether the CUDA extension
            (jax_dflash._dflash_cuda) loads; the TensorRT plugin library's path and whether a
            TensorRT runtime (tensorrt or tensorrt_lean) is installed and can load it. Then
            a parity self-test: the op against the NumPy reference, bit for bit, on every
            available backend (cpu, and gpu when JAX has one) for float16, bfloat16 and
            float32 deltas, on small random shapes of both contracts: hostile positions
            (negative, past the slot, near INT32_MAX and INT32_MIN), padding, lengths past L,
            per-sequence RoPE, per-layer positions; paged tokens with hostile owners, positions
            and page ids, ring pages; FP8 pools with per-head scales and the fused norms.
            Exits 1 if any case differs."""),
    )
    check.add_argument(
        "--seed", type=_seed, default=0, metavar="S", help="seed of the random cases (default: 0)"
    )
    check.set_defaults(func=cmd_check)

    return parser


def _version() -> str:
    try:
        from importlib import metadata

        return metadata.version("jax-dflash")
    except Exception:  # noqa: BLE001 - a source tree that was never installed
        return "0+unknown"


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
    except Exception:  # noqa: BLE001 - not a failed check: say so, with the traceback
        traceback.print_exc()
        print(f"{PROG}: internal error (not a check failure)", file=sys.stderr)
        return EXIT_INTERNAL


# ---- run: validation ----------------------------------------------------------------------------


@functools.cache
def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16 << 30


def check_json_path(path: str | None) -> None:
    """``--json PATH`` must be writable, and its folder must exist: checked before the run,
    so a long run never ends in a failed write."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(
            f"--json {path}: folder {folder} does not exist (expected a path in an existing folder)"
        )
    if os.path.isdir(path):
        raise UsageError(f"--json {path}: is a folder (expected a file path)")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise UsageError(f"--json {path}: the file is not writable")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--json {path}: folder {folder} is not writable")


def estimate_run_bytes(
    preset, *, contract, batch, steps, window, check, delta_itemsize, pool_itemsize
) -> dict[str, int]:
    """Host memory the run needs, by part (its device needs are the pool and the inputs)."""
    from jax_dflash.cli import allocator

    p = preset
    tokens = batch * p.block_size
    if contract == "slot":
        pool = int(np.prod(p.pool_shape())) * pool_itemsize
        inputs = (steps + 1) * batch * 4 * 3  # lengths, positions and the schedule's copy
    else:
        m = allocator.table_pages_for(p.page_size, p.pages_per_slot, window)
        longest_prompt = (
            p.slot_capacity // 2 if window is None else min(p.slot_capacity // 2, window)
        )
        prompt_pages = max(1, batch // 2) * (max(longest_prompt, p.page_size) // p.page_size)
        pages = allocator.pool_pages_for(batch, m, prompt_pages)
        pool = p.num_layers * 2 * pages * p.page_size * p.num_kv_heads * p.head_dim * pool_itemsize
        # positions, owners, streams [T] and the table [B, 2, M] per step, host and device
        inputs = 2 * (steps + 1) * (3 * tokens + 2 * batch * m) * 4
    deltas = 0
    if check:  # every step's k and v, [layers, T, H, D], kept for the reference replay
        deltas = steps * 2 * p.num_layers * tokens * p.num_kv_heads * p.head_dim * delta_itemsize
    return {"pool (host copies)": 3 * pool, "per-step inputs": inputs, "checked deltas": deltas}


def validate_run(args, preset) -> dict:
    """Every flag of ``run`` checked before anything runs (no JAX needed); returns the
    resolved settings. UsageError with a one-line reason otherwise."""
    from jax_dflash.cli.presets import KV_DTYPES, dtype_from_name, human_bytes
    from jax_dflash.cli.workload import parse_accept

    check_json_path(args.json)
    contract = args.contract or preset.default_contract
    window = args.window if args.window is not None else preset.window
    if window is not None:
        if contract != "paged":
            source = "--window" if args.window is not None else f"preset {preset.name}'s window"
            raise UsageError(
                f"{source} {window} needs --contract paged (sliding windows live "
                f"in ring pages of a page table), got --contract {contract}"
            )
        if window % preset.page_size:
            raise UsageError(
                f"--window {window}: expected a positive multiple of the page size "
                f"{preset.page_size}"
            )
    batch = args.batch if args.batch is not None else preset.default_batch
    steps = args.steps if args.steps is not None else preset.default_steps
    if batch > preset.num_slots:
        raise UsageError(
            f"--batch {batch} is larger than the pool's {preset.num_slots} slots of preset "
            f"{preset.name} (expected --batch <= {preset.num_slots})"
        )
    try:
        accept = parse_accept(args.accept, preset.block_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    delta = args.dtype or preset.dtype
    pool = KV_DTYPES[args.kv_dtype] if args.kv_dtype else delta
    parts = estimate_run_bytes(
        preset,
        contract=contract,
        batch=batch,
        steps=steps,
        window=window,
        check=args.check,
        delta_itemsize=dtype_from_name(delta).itemsize,
        pool_itemsize=dtype_from_name(pool).itemsize,
    )
    need = sum(parts.values())
    limit = int(_physical_memory() * HOST_MEMORY_SHARE)
    biggest = max(parts, key=parts.get)
    if steps > MAX_STEPS:
        raise UsageError(f"--steps {steps}: expected at most {MAX_STEPS} steps")
    if need > limit:
        raise UsageError(
            f"--steps {steps} --batch {batch}: the run would need about {human_bytes(need)} of "
            f"host memory (mostly {biggest}: {human_bytes(parts[biggest])}); expected at most "
            f"{human_bytes(limit)}, half of this machine's"
            + (
                "; --no-check drops the deltas kept for the check"
                if biggest == "checked deltas"
                else ""
            )
        )
    if contract == "paged" and steps * batch > MAX_PAGED_SEQUENCE_STEPS:
        raise UsageError(
            f"--steps {steps} --batch {batch}: the paged plan simulates every sequence's every "
            f"step on the host (about {steps * batch * 15e-6:.0f} s here); expected steps x "
            f"batch <= {MAX_PAGED_SEQUENCE_STEPS}"
        )
    return dict(
        contract=contract,
        window=window,
        batch=batch,
        steps=steps,
        accept=accept,
        delta_dtype=delta,
        pool_dtype=pool,
        estimated_host_bytes=need,
    )


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
                f"is {jax.default_backend()})"
            ) from None
    if device.platform not in ("cpu", "gpu", "cuda"):
        raise UsageError(
            f"--backend {backend}: the op runs on cpu and CUDA GPUs, JAX's device "
            f"here is {device.platform}"
        )
    return device


def op_supports(name: str) -> bool:
    """Whether the installed JAX op takes the keyword ``name`` (k_norm_weight, k_scale)."""
    import inspect

    import jax_dflash

    return name in inspect.signature(jax_dflash.target_kv_cache_update).parameters


def check_runtime(args, settings, preset, device) -> bool:
    """The checks that need JAX: FP8 support, the fused norm, GPU-sized presets on a CPU.
    Returns whether the norm is fused."""
    import jax
    import jax.numpy as jnp

    from jax_dflash.cli.presets import FP8_NAMES, human_bytes

    pool = settings["pool_dtype"]
    if pool in FP8_NAMES:
        if not hasattr(jnp, pool):
            raise UsageError(
                f"--kv-dtype {args.kv_dtype}: this JAX ({jax.__version__}) has no "
                f"jnp.{pool}; FP8 pools need a JAX with FP8 dtypes"
            )
        if not op_supports("k_scale"):
            raise UsageError(
                f"--kv-dtype {args.kv_dtype}: the installed jax_dflash op takes no "
                f"k_scale/v_scale (FP8 pools need them)"
            )
    supported = op_supports("k_norm_weight")
    fused = supported if args.fused_norm is None else args.fused_norm
    if fused and not supported:
        raise UsageError(
            "--fused-norm: the installed jax_dflash op takes no k_norm_weight; use --no-fused-norm"
        )
    if preset.gpu_sized and device.platform == "cpu" and not args.force:
        tokens = settings["batch"] * preset.block_size
        flops = (
            2
            * tokens
            * preset.hidden_size
            * (preset.feature_size + 2 * preset.num_layers * preset.num_kv_heads * preset.head_dim)
        )
        pool_bytes = preset.pool_bytes(pool)
        raise UsageError(
            f"preset {preset.name} is GPU-sized (pool {human_bytes(pool_bytes)}, "
            f"{flops / 1e9:.0f} GFLOP per step): on a CPU it would take minutes; pass --force "
            f"to run it anyway"
        )
    return fused


# ---- run ----------------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from jax_dflash.cli.presets import PRESETS

    preset = PRESETS[args.preset]
    settings = validate_run(args, preset)
    device = select_device(args.backend)
    fused = check_runtime(args, settings, preset, device)

    from jax_dflash.cli.workload import Workload

    to_stdout_json = args.json == "-"
    out = sys.stderr if to_stdout_json else sys.stdout
    workload = Workload(
        preset,
        batch=settings["batch"],
        steps=settings["steps"],
        seed=args.seed,
        accept=settings["accept"],
        device=device,
        dtype=settings["delta_dtype"],
        kv_dtype=settings["pool_dtype"],
        contract=settings["contract"],
        window=settings["window"],
        fused_norm=fused,
    )
    print(_run_header(workload, device), file=out, flush=True)

    results = [
        workload.run("kernel", check=args.check, check_readback=args.check, progress=args.progress)
    ]
    if args.compare:
        seconds, per_step = workload.estimate_seconds("baseline")
        print(
            f"jnp baseline: about {seconds:.0f} s to run ({per_step * 1e3:.2f} ms per step, "
            f"from a few timed steps; compilation included)",
            file=out,
            flush=True,
        )
        results.append(
            workload.run(
                "baseline", check=args.check, check_readback=args.check, progress=args.progress
            )
        )
    print(file=out)
    print(_results_table(results, workload), file=out)
    for r in results:
        if r.readback is not None:
            rb = r.readback
            verdict = "passed" if rb.passed else f"FAILED: {rb.failure}"
            print(
                f"read-back ({r.label}): {rb.sequences} sequences, {rb.tokens} tokens, "
                f"{rb.queries} queries; worst score / output difference "
                f"{rb.worst_score_ratio:.3g} / {rb.worst_output_ratio:.3g} of the rounding "
                f"bound: {verdict}",
                file=out,
            )
    failed = [r for r in results if r.failed]
    for r in failed:
        if r.check == "differs" and r.bit_exact_required:
            print(
                f"{PROG}: check FAILED: the kernel's pools differ from the NumPy reference in "
                f"{r.mismatched_elements} of {r.checked_elements} elements",
                file=sys.stderr,
            )
        if r.readback is not None and not r.readback.passed:
            print(
                f"{PROG}: check FAILED: read-back ({r.label}): {r.readback.failure}",
                file=sys.stderr,
            )

    if args.json is not None:
        text = json.dumps(_run_summary(workload, device, results), indent=2)
        if to_stdout_json:
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def _pool_memory(w) -> dict[str, int]:
    """The pool's bytes in every pool dtype (the run's first)."""
    from jax_dflash.cli.presets import KV_DTYPES, dtype_from_name

    sizes = {w.pool_dtype_name: w.pool_bytes()}
    for name in KV_DTYPES.values():
        sizes.setdefault(name, w.pool_bytes(dtype_from_name(name)))
    return sizes


def _run_header(w, device) -> str:
    from jax_dflash.cli.presets import KV_DTYPES, human_bytes

    p = w.preset
    short = {v: k for k, v in KV_DTYPES.items()}
    memory = _pool_memory(w)
    others = ", ".join(f"{short[n]} {human_bytes(b)}" for n, b in list(memory.items())[1:])
    lines = [
        f"{PROG} run: preset {p.name} ({p.summary})",
        f"  device {device.platform}:{device.id} ({device.device_kind}); deltas "
        f"{w.delta_dtype_name}, pool {w.pool_dtype_name}"
        + (" (per-head scales calibrated once)" if w.fp8 else "")
        + f"; k-norm {'fused into the op' if w.fused_norm else 'in jnp, then the op'}",
        f"  {p.num_layers} draft layers, pool [layers, 2, numPages, P, H, D] = "
        f"{list(w.pool_shape)}: {human_bytes(w.pool_bytes())} ({others}), block "
        f"{p.block_size}",
    ]
    if w.plan is None:
        s = w.schedule
        active = int(np.count_nonzero(s.lengths))
        mean = w.accepted_tokens / active if active else 0.0
        lines.append(
            f"  slot contract: batch {w.batch} of {p.num_slots} slots of {p.slot_capacity} "
            f"tokens, {w.steps} steps, accept {w.accept.describe()}: {w.accepted_tokens} tokens "
            f"accepted (mean {mean:.2f} per sequence and step), {s.stopped} of {w.batch} "
            f"sequences reached the slot capacity and stopped"
        )
    else:
        plan = w.plan
        window = (
            f", window {w.window} tokens in {plan.table_pages} ring pages"
            if plan.ring
            else f", table of {plan.table_pages} pages"
        )
        lines.append(
            f"  paged contract: {w.batch} sequences in flight{window}; {len(plan.prompts)} "
            f"prompts prefilled into shared pages ({w.prefill_steps} untimed steps)"
        )
        lines.append(
            f"  {w.steps} steps, accept {w.accept.describe()}: {plan.accepted_tokens} tokens "
            f"accepted, {w.written_tokens} written; {plan.sequences_started} sequences started, "
            f"{plan.sequences_finished} finished; {plan.shared_page_references} shared prompt "
            f"page references, peak {plan.peak_pages_in_use} of {plan.num_pages} pages in use"
            + (f", {plan.ring_page_reuses} ring pages overwritten" if plan.ring else "")
        )
    return "\n".join(lines)


def _fmt(value, spec, missing="n/a"):
    return missing if value is None else format(value, spec)


def _check_text(r) -> str:
    if r.check == "skipped":
        return "skipped"
    if r.check == "bit-exact":
        return "bit-exact vs reference"
    prefix = "FAILED: " if (r.check == "differs" and r.bit_exact_required) else ""
    return (
        f"{prefix}{r.mismatched_elements} of {r.checked_elements} elements differ "
        f"(max {r.max_ulp} ulp)"
    )


def _results_table(results, w) -> str:
    header = (
        "implementation",
        "steps/s",
        "accepted tok/s",
        "step ms",
        "update ms",
        "update share",
        "update GB/s",
        "compile s",
        "check",
    )
    rows = [header]
    for r in results:
        share = r.update_share
        rows.append(
            (
                r.label,
                f"{r.steps_per_s:.1f}",
                f"{r.accepted_tokens_per_s:.0f}",
                f"{r.timing.step_seconds * 1e3:.3f}",
                _fmt(r.update_seconds_per_step and r.update_seconds_per_step * 1e3, ".3f"),
                _fmt(share and share * 100, ".1f") + ("%" if share is not None else ""),
                _fmt(r.update_gb_per_s, ".3f"),
                f"{r.timing.compile_seconds:.2f}",
                _check_text(r),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(widths[i]) for i, c in enumerate(row[1:-1], start=1)]
        cells.append(row[-1])
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    lines.append(
        f"(update: the best step time minus the best time of the same jitted step "
        f"without the update, over the run and replays of both; it moves "
        f"{w.update_bytes / 1e6:.2f} MB per run)"
    )
    return "\n".join(lines)


def _run_summary(w, device, results) -> dict:
    import jax

    p = w.preset
    summary = {
        "command": "run",
        "preset": p.name,
        "preset_source": p.source,
        "backend": device.platform,
        "device": f"{device.platform}:{device.id} ({device.device_kind})",
        "jax_version": jax.__version__,
        "contract": w.contract,
        "window": w.window,
        "fused_norm": w.fused_norm,
        "shape": {
            "layers": p.num_layers,
            "num_kv_heads": p.num_kv_heads,
            "head_dim": p.head_dim,
            "rotary_dim": p.rope_dim,
            "hidden_size": p.hidden_size,
            "feature_size": p.feature_size,
            "block_size": p.block_size,
            "page_size": p.page_size,
            "pages_per_slot": p.pages_per_slot,
            "slots": p.num_slots,
            "slot_capacity": p.slot_capacity,
            "pool_shape": list(w.pool_shape),
            "pool_bytes": w.pool_bytes(),
            "dtype": w.dtype_name,
            "delta_dtype": w.delta_dtype_name,
            "pool_dtype": w.pool_dtype_name,
        },
        "pool_bytes_by_dtype": _pool_memory(w),
        "batch": w.batch,
        "steps": w.steps,
        "seed": w.seed,
        "accept": w.accept.describe(),
        "accepted_tokens": w.accepted_tokens,
        "written_tokens": w.written_tokens,
        "results": [r.as_dict() for r in results],
        "check_passed": (
            None
            if all(r.check == "skipped" for r in results)
            else not any(r.failed for r in results)
        ),
    }
    if w.plan is None:
        s = w.schedule
        active = int(np.count_nonzero(s.lengths))
        summary.update(
            capacity_policy="stop",
            mean_accepted_length=w.accepted_tokens / active if active else 0.0,
            sequences_stopped=s.stopped,
        )
    else:
        plan = w.plan
        summary["paged"] = {
            "num_pages": plan.num_pages,
            "table_pages": plan.table_pages,
            "ring": plan.ring,
            "prompts": len(plan.prompts),
            "prefill_steps": w.prefill_steps,
            "sequences_started": plan.sequences_started,
            "sequences_finished": plan.sequences_finished,
            "shared_page_references": plan.shared_page_references,
            "peak_pages_in_use": plan.peak_pages_in_use,
            "ring_page_reuses": plan.ring_page_reuses,
        }
    return summary


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
            errors.append(f"{name}: {type(e).__name__}" if not isinstance(e, ImportError) else None)
    if runtime_module is None:
        extra = "; ".join(e for e in errors if e)
        return (
            library,
            "not installed (none of tensorrt, tensorrt_lean, tensorrt_lean_bindings imports"
            + (f"; {extra})" if extra else ")"),
        )
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
        return library, (
            f"{runtime} loaded the plugin library; creator DFlashTargetKVCacheUpdate v1 {found}"
        )
    except Exception as e:  # noqa: BLE001
        return library, f"{runtime} could not load it: {type(e).__name__}: {e}"


def parity_cases(rng: np.random.Generator, dtype: np.dtype) -> list[tuple[str, str, tuple, dict]]:
    """``(name, contract, operands, keywords)``: small shapes with hostile positions, both
    contracts, FP8 pools and the fused norms."""
    from jax_dflash import testing

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
    cases.append(
        (
            "slot: unbatched, hostile positions",
            "slot",
            (
                normal(b, length, h, d),
                normal(b, length, h, d),
                normal(2, 7 * pps, page, h, d),
                rope(1, 9, 8),
                i32([-2, 9, int32_max - 2, 3, int32_min, 0]),
                i32([5, 9, 4, 0, 5, -1]),
            ),
            {"pages_per_slot": pps},
        )
    )
    # Layer-batched with per-layer positions and per-sequence RoPE.
    layers, b, length, h, d, page, pps = 3, 2, 4, 3, 8, 2, 4  # capacity 8
    cases.append(
        (
            "slot: layer-batched, per-layer positions, per-sequence RoPE",
            "slot",
            (
                normal(layers, b, length, h, d),
                normal(layers, b, length, h, d),
                normal(layers, 2, b * pps, page, h, d),
                rope(b, page * pps, d),
                rng.integers(-3, 11, (layers, b)).astype(np.int32),
                rng.integers(-1, length + 3, (layers, b)).astype(np.int32),
            ),
            {"pages_per_slot": pps},
        )
    )
    # Odd head dim, no rotation, one token per page; the second sequence runs off its slot.
    b, length, h, d, page, pps = 2, 3, 1, 7, 1, 5
    cases.append(
        (
            "slot: odd head dim, no RoPE, page size 1",
            "slot",
            (
                normal(b, length, h, d),
                normal(b, length, h, d),
                normal(2, b * pps, page, h, d),
                rope(1, 5, 0),
                i32([0, 3]),
                i32([3, 3]),
            ),
            {"pages_per_slot": pps},
        )
    )
    slot = testing.make_problem(
        rng,
        batch=3,
        delta_len=4,
        heads=2,
        head_dim=16,
        page_size=4,
        pages_per_slot=3,
        dtype=dtype,
        layers=2,
        pool_dtype="float8_e5m2",
        k_norm=True,
        scale_shape=(2, 2),
    )
    cases.append(
        ("slot: layer-batched, FP8 e5m2 pool, fused k-norm", "slot", slot.args(), slot.kwargs())
    )
    paged = testing.make_paged_problem(
        rng,
        tokens=12,
        batch=3,
        heads=2,
        head_dim=16,
        rotary_dim=8,
        num_pages=10,
        page_size=4,
        table_pages=3,
        dtype=dtype,
        layers=2,
        ring=True,
    )
    cases.append(
        (
            "paged: layer-batched, ring, hostile tokens and table",
            "paged",
            paged.args(),
            paged.kwargs(),
        )
    )
    paged = testing.make_paged_problem(
        rng,
        tokens=10,
        batch=2,
        heads=2,
        head_dim=16,
        num_pages=6,
        page_size=4,
        table_pages=3,
        dtype=dtype,
        pool_dtype="float8_e4m3fn",
        k_norm=True,
        v_norm=True,
    )
    cases.append(
        ("paged: FP8 e4m3 pool, fused k- and v-norm", "paged", paged.args(), paged.kwargs())
    )
    return cases


_STATIC = ("pages_per_slot", "ring", "norm_eps", "v_norm")


@functools.cache
def _jitted_op(contract: str):
    import jax

    import jax_dflash

    op = (
        jax_dflash.target_kv_cache_update
        if contract == "slot"
        else jax_dflash.target_kv_cache_update_paged
    )
    static = [n for n in _STATIC if n != ("ring" if contract == "slot" else "pages_per_slot")]
    return jax.jit(op, static_argnames=static)


def run_parity(backend: str, dtype: np.dtype, seed: int) -> tuple[int, list[str]]:
    """Runs every parity case on ``backend``: (cases passed, one line per failure)."""
    import jax

    from jax_dflash import reference
    from jax_dflash.cli.workload import compare_bits

    device = jax.devices(backend)[0]
    rng = np.random.default_rng(seed)
    passed, failures = 0, []
    for name, contract, operands, keywords in parity_cases(rng, dtype):
        ref = (
            reference.target_kv_cache_update
            if contract == "slot"
            else reference.target_kv_cache_update_paged
        )
        expected = ref(*operands, **keywords)
        try:
            args = [jax.device_put(x, device) for x in operands]
            kw = {
                k: (v if k in _STATIC else jax.device_put(v, device)) for k, v in keywords.items()
            }
            actual = np.asarray(_jitted_op(contract)(*args, **kw))
        except Exception as e:  # noqa: BLE001 - reported as a failed case
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        mismatches, max_ulp = compare_bits(actual, expected)
        if mismatches:
            failures.append(
                f"{name}: {mismatches} of {expected.size} elements differ (max {max_ulp} ulp)"
            )
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
