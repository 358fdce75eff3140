"""The ``run`` command: the DFlash draft-cache workload (:mod:`jax_dflash.cli.workload`), timed
and checked. Its flags are checked (:mod:`~jax_dflash.cli.run_settings`), the ``--json`` file
opened (:mod:`~jax_dflash.cli.json_output`) and the host memory estimated
(:mod:`~jax_dflash.cli.memory`) before anything runs."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from jax_dflash.cli.common import (
    EXIT_CHECK_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    PROG,
    HelpFormatter,
    named,
    positive_int,
    seed,
)
from jax_dflash.cli.run_settings import BACKENDS, CONTRACTS, DEFAULT_ACCEPT, MAX_STEPS

NAME = "run"
SUMMARY = "simulate the draft side of DFlash decoding and check the result"
HELP = "simulate DFlash draft-cache updates and check them against the NumPy reference"
DESCRIPTION = textwrap.dedent("""\
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
    A draft whose layer_types mix sliding_attention and full_attention layers keeps
    the window in its sliding layers' rings and all of each sequence in its full
    layers' growing pages: a page table per layer, one launch with a ring per layer
    (paged contract only); the header prints its pool against every layer full.

    Checks: the final pools against the NumPy reference (jax_dflash.reference), bit for
    bit, replayed on the host; and a read-back check: attention of draft queries over
    the pool equals attention over keys and values recomputed from the features
    without a cache, within the pool dtype's rounding (a windowed layer's queries
    see their window, a full layer's attend causally).

    Summary: pool memory; steps/s (decode steps over the seconds until the device
    finished them) and accepted tokens/s: the median of interleaved, repeated replays
    of each implementation's decode steps, nothing collected, with their spread (the
    checked pass, which collects the deltas for the check, is reported apart); the
    update's time in the step: device time from a profiler trace where there is a
    device (the op's kernels), else the step's time minus the same jitted step's
    without the update, with the resolution of that difference (a share below it
    prints as "< x%"); update GB/s = bytes the update must move / the update's time.
    Timings exclude compilation, prefill, warm-up steps and the check's fetches; on a busy CPU they are noisy.""")


def add_parser(commands) -> None:
    from jax_dflash.cli.presets import presets_help

    parser = commands.add_parser(
        NAME,
        formatter_class=HelpFormatter,
        help=HELP,
        description=DESCRIPTION,
        epilog=presets_help(),
    )
    _add_shape_flags(parser)
    _add_workload_flags(parser)
    _add_output_flags(parser)
    parser.set_defaults(execute=execute)


def _add_shape_flags(parser) -> None:
    from jax_dflash.cli.presets import DEFAULT_PRESET, PRESET_ALIASES, PRESETS

    draft = parser.add_mutually_exclusive_group()
    draft.add_argument(
        "--preset",
        type=named("preset", tuple(PRESETS), PRESET_ALIASES),
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"draft shape: {', '.join(PRESETS)} (default: {DEFAULT_PRESET}; list below)",
    )
    draft.add_argument(
        "--draft-config",
        metavar="PATH",
        help="your draft's config.json (z-lab's / Hugging Face's form: hidden_size, "
        "num_key_value_heads, head_dim, num_hidden_layers, rope_theta or rope_parameters, "
        "layer_types, sliding_window, block_size, target_layer_ids) instead of a preset; the "
        "pool as the GPU presets' (pages of 128 tokens) unless its 'jax_dflash' object says "
        "otherwise (the presets' files in jax_dflash/cli/configs/ show it)",
    )
    parser.add_argument(
        "--contract",
        type=named("contract", CONTRACTS),
        metavar="{slot,paged}",
        help="slot (Edge-LLM 0.10) or paged (0.11) addressing (default: the "
        "preset's, slot for all but the sliding-window ones; a draft mixing "
        "sliding-window and full layers runs paged only)",
    )
    parser.add_argument(
        "--window",
        type=positive_int,
        metavar="N",
        help="sliding window, in tokens, of every draft layer, or of a mixed draft's "
        "sliding_attention layers (a multiple of the page size; paged contract; "
        "default: the preset's)",
    )
    parser.add_argument(
        "--backend",
        type=named("backend", BACKENDS),
        metavar="{default,cpu,gpu}",
        default="default",
        help="JAX backend to run on (default: JAX's default backend)",
    )


def _add_workload_flags(parser) -> None:
    from jax_dflash.cli.accept import ACCEPT_HELP
    from jax_dflash.cli.presets import DTYPE_ALIASES, DTYPE_NAMES, POOL_DTYPE_NAMES

    parser.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help=f"decoding steps, at most {MAX_STEPS} (default: the preset's)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        metavar="B",
        help="sequences in flight, at most the preset's slots (default: the preset's)",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        default=0,
        metavar="S",
        help="seed of every random draw, 0 <= S < 2**63 (default: 0)",
    )
    parser.add_argument(
        "--accept",
        default=DEFAULT_ACCEPT,
        metavar="DIST",
        help=f"accepted lengths per step: {ACCEPT_HELP} (default: {DEFAULT_ACCEPT})",
    )
    parser.add_argument(
        "--dtype",
        type=named("dtype", DTYPE_NAMES, _aliases_of(DTYPE_ALIASES, DTYPE_NAMES)),
        metavar="NAME",
        help="delta (compute) dtype, and the pool's unless --kv-dtype: float16, bfloat16, "
        "float32 (or fp16, bf16, fp32; default: the preset's)",
    )
    parser.add_argument(
        "--kv-dtype",
        type=named("kv-dtype", POOL_DTYPE_NAMES, DTYPE_ALIASES),
        metavar="NAME",
        help="pool format: float16, bfloat16, float32; float8_e4m3fn, float8_e5m2, int8 with "
        "per-head k/v scales calibrated once; int8-dynamic, float8_e4m3fn-dynamic, "
        "float8_e5m2-dynamic with a float32 scale per token, head and plane; int4 (two "
        "elements per byte) with such scales only, on the CPU backend until the op's CUDA "
        "handler writes it (or fp16, bf16, fp32, e4m3, e5m2, e4m3-dynamic, e5m2-dynamic, "
        "int4-dynamic; default: the delta dtype)",
    )
    parser.add_argument(
        "--fused-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the op applies the k-norm (default: on when the op supports it); "
        "--no-fused-norm runs a jnp RMSNorm, then the op",
    )


def _add_output_flags(parser) -> None:
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run the unfused pipeline a JAX user writes (jnp RMSNorm, jnp "
        "RoPE, .at[].set per layer, FP8 by astype after a jnp saturation) "
        "and print both; only the kernel must be bit-exact. Says how long "
        "it will take before starting it",
    )
    parser.add_argument(
        "--compare-formats",
        nargs="?",
        const="",
        metavar="PNG",
        help="write the same workload into every pool format (16-bit, e4m3, e5m2, int8, "
        "int8-dynamic, e4m3-dynamic, e5m2-dynamic, int4), check each, and print pool bytes per "
        "token and in total against the read-back attention error relative to a float32 "
        "recompute; with PNG, plot memory against error there (needs matplotlib: "
        'pip install -e ".[plot]"). On a GPU a format the op\'s CUDA handler does not write '
        "would be skipped, saying so",
    )
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the checks (reference and read-back)",
    )
    parser.add_argument(
        "--force", action="store_true", help="run a GPU-sized preset on a CPU anyway"
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write a machine-readable summary to PATH (checked before the run), "
        "or to stdout with no PATH or '-' (the table then goes to stderr)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )


def _aliases_of(aliases: dict[str, str], names) -> dict[str, str]:
    return {alias: name for alias, name in aliases.items() if name in names}


def execute(args) -> int:
    """Checks the flags, opens the --json file, picks the device and bounds the host memory,
    all before the run; then runs, prints and writes the summary."""
    from jax_dflash.cli import json_output, memory, run_settings
    from jax_dflash.cli.presets import PRESETS, read_draft_config

    preset = (
        PRESETS[args.preset] if args.draft_config is None else read_draft_config(args.draft_config)
    )
    settings = run_settings.validate(args, preset)
    if args.compare_formats is not None:
        _check_compare_formats(args)
    destination = json_output.open_summary(args.json)
    try:
        device = run_settings.select_device(args.backend)
        fused = run_settings.check_runtime(args, settings, preset, device)
        estimate = memory.check_host_memory(
            preset, settings, device, check=args.check, compare=args.compare
        )
        if args.compare_formats is not None:
            summary, failed = _compare_formats(args, preset, settings, device, fused)
        else:
            summary, failed = _run(args, preset, settings, device, fused)
        status = EXIT_CHECK_FAILED if failed else EXIT_OK
        if destination is not None:
            summary["host_memory"] = {
                **estimate.as_dict(),
                "measured_peak_bytes": memory.peak_rss(),
            }
            if not _write_summary(destination, json.dumps(summary, indent=2)):
                status = EXIT_INTERNAL
    finally:
        if destination is not None:
            destination.close()
    return status


def _workload(args, preset, settings, device, fused: bool, kv_dtype: str):
    """The run's workload with its pool in ``kv_dtype``."""
    from jax_dflash.cli import workload

    return workload.Workload(
        preset,
        batch=settings.batch,
        steps=settings.steps,
        seed=args.seed,
        accept=settings.accept,
        device=device,
        dtype=settings.delta_dtype,
        kv_dtype=kv_dtype,
        contract=settings.contract,
        window=settings.window,
        window_layers=settings.window_layers,
        fused_norm=fused,
    )


def _run(args, preset, settings, device, fused: bool) -> tuple[dict, bool]:
    """Builds and runs the workload, prints the tables: (the --json summary, whether a check
    failed)."""
    from jax_dflash.cli import report

    out = sys.stderr if args.json == "-" else sys.stdout
    w = _workload(args, preset, settings, device, fused, settings.pool_dtype)
    print(report.run_header(w, device), file=out, flush=True)
    checks = dict(check=args.check, check_readback=args.check, progress=args.progress)
    results = [w.run("kernel", **checks)]
    if args.compare:
        seconds, per_step = w.estimate_seconds("baseline")
        print(
            f"jnp baseline: about {seconds:.0f} s to run ({per_step * 1e3:.2f} ms per step, "
            f"from a few timed steps; compilation included)",
            file=out,
            flush=True,
        )
        results.append(w.run("baseline", **checks))
    w.measure(results, progress=args.progress)
    print(file=out)
    print(report.results_table(results, w), file=out)
    for line in report.difference_lines(results, w) + report.readback_lines(results):
        print(line, file=out)
    for line in report.failure_lines(results):
        print(line, file=sys.stderr)
    summary = report.run_summary(w, device, results) if args.json is not None else {}
    return summary, any(r.failed for r in results)


def _check_compare_formats(args) -> None:
    """Before the run: --compare-formats runs every format, checked, without the replays."""
    from jax_dflash.cli import compare_formats
    from jax_dflash.cli.common import UsageError

    for flag, given in (("--kv-dtype", args.kv_dtype), ("--compare", args.compare)):
        if given:
            raise UsageError(
                f"--compare-formats writes every pool format with the kernel; expected no "
                f"{flag}, got {flag}" + (f" {given}" if isinstance(given, str) else "")
            )
    if not args.check:
        raise UsageError(
            "--compare-formats measures each format's read-back error; expected no --no-check"
        )
    compare_formats.check_plot_destination(args.compare_formats or None)


def _compare_formats(args, preset, settings, device, fused: bool) -> tuple[dict, bool]:
    """Every pool format's checked pass of one workload: the table, the plot, the summary."""
    from jax_dflash.cli import compare_formats, report

    out = sys.stderr if args.json == "-" else sys.stdout

    def make_workload(kv_dtype: str):
        return _workload(args, preset, settings, device, fused, kv_dtype)

    formats = compare_formats.compared_formats(settings.delta_dtype)
    first = make_workload(formats[0])
    print(report.run_header(first, device), file=out)
    print(f"comparing pool formats: {', '.join(formats)}", file=out, flush=True)
    rows = compare_formats.run_formats(make_workload, formats, device, out=out)
    print(file=out)
    print(compare_formats.table(rows), file=out)
    if args.compare_formats:
        title = f"{preset.name}: pool memory against read-back error ({settings.contract})"
        compare_formats.plot(rows, args.compare_formats, title)
        print(f"plot: {args.compare_formats}", file=out)
    failed = any(r.failed for r in rows)
    for r in rows:
        if r.failed:
            print(
                f"{PROG}: check FAILED: pool format {r.name}: kernel {r.check}, read-back "
                + ("passed" if r.readback_passed else "failed"),
                file=sys.stderr,
            )
    summary = {}
    if args.json is not None:
        summary = report.run_summary(first, device, [])
        summary["formats"] = [r.as_dict() for r in rows]
        summary["formats_plot"] = args.compare_formats or None
        summary["check_passed"] = not failed
    return summary, failed


def _write_summary(destination, text: str) -> bool:
    """Writes the --json summary; whether it was written. A file that fails now (it took a
    write before the run: the disk filled up meanwhile, say) gets one line on stderr, and the
    summary goes to stdout, so the run's work is not lost."""
    from jax_dflash.cli.json_output import SummaryNotWritten

    try:
        destination.write(text)
    except SummaryNotWritten as e:
        print(text)
        print(f"{PROG}: error: {e} (the summary is on stdout)", file=sys.stderr)
        return False
    return True
