"""What ``run`` prints: the header before the run, the results table, the read-back lines and
the failures after it, and the ``--json`` summary."""

from __future__ import annotations

import numpy as np

from jax_dflash.cli.common import PROG


def pool_memory(w) -> dict[str, int]:
    """The pool's bytes in every pool format, a dynamic one's scales included (the run's
    first)."""
    from jax_dflash.cli.presets import POOL_DTYPE_NAMES

    sizes = {w.pool_dtype_name: w.pool_bytes()}
    for name in POOL_DTYPE_NAMES:
        sizes.setdefault(name, w.pool_bytes(name))
    return sizes


def bytes_per_token(w, name: str | None = None) -> float:
    """Pool bytes one token takes in every layer (keys and values; a dynamic format's float32
    scale per head and plane included)."""
    from jax_dflash.cli.formats import bytes_per_element

    p = w.preset
    return (
        2
        * p.num_layers
        * p.num_kv_heads
        * p.head_dim
        * bytes_per_element(name or w.pool_dtype_name, p.head_dim)
    )


def run_header(w, device) -> str:
    from jax_dflash.cli.formats import elements_per_byte
    from jax_dflash.cli.presets import human_bytes

    p = w.preset
    memory = pool_memory(w)
    others = ", ".join(f"{n} {human_bytes(b)}" for n, b in list(memory.items())[1:])
    packed = elements_per_byte(w.pool_dtype_name) > 1
    lines = [
        f"{PROG} run: {p.origin}" + ("" if p.config_path else f" ({p.summary})"),
        f"  device {device.platform}:{device.id} ({device.device_kind}); deltas "
        f"{w.delta_dtype_name}, pool {w.pool_dtype_name}"
        + (" (per-head scales calibrated once)" if w.fp8 else "")
        + (" (a float32 scale per token, head and plane)" if w.dynamic else "")
        + f"; k-norm {'fused into the op' if w.fused_norm else 'in jnp, then the op'}",
        f"  {p.num_layers} draft layers, pool [layers, 2, numPages, P, H, "
        + ("D/2] uint8 (two int4 elements per byte) = " if packed else "D] = ")
        + f"{list(w.pool_shape)}: {human_bytes(w.pool_bytes())} ({others}), block "
        f"{p.block_size}",
        "  pool bytes per token (all layers, K and V, scales included): "
        + ", ".join(f"{n} {bytes_per_token(w, n):g}" for n in memory),
    ]
    lines += _layer_kind_lines(w)
    lines += _slot_lines(w) if w.plan is None else _paged_lines(w)
    return "\n".join(lines)


def _layer_kind_lines(w) -> list[str]:
    """With sliding-window layers: the pool by layer kind against every layer full."""
    from jax_dflash.cli.presets import human_bytes

    kinds = w.pool_by_layer_kind()
    if kinds is None:
        return []
    plan, layers = w.plan, w.preset.num_layers
    windowed = len(kinds["window_layers"])
    parts = []
    for kind in plan.kinds:
        count = windowed if kind.ring else layers - windowed
        what = (
            f"{kind.sequence_pages} ring pages per sequence"
            if kind.ring
            else f"up to {kind.sequence_pages} pages per sequence"
        )
        parts.append(
            f"{count} {'window' if kind.ring else 'full'} layer{'s' * (count != 1)} x "
            f"{kind.num_pages} pages ({what})"
        )
    lines = [
        f"  pool by layer kind: {' + '.join(parts)} = {human_bytes(kinds['bytes'])}, against "
        f"{human_bytes(kinds['all_full_bytes'])} with every layer full ({layers} x "
        f"{kinds['all_full_pages_per_layer']} pages): {kinds['ratio']:.2f}x"
    ]
    if plan.mixed:
        lines.append(
            f"  (this run's pool is one layer-batched array, one launch for every layer: each "
            f"layer has the full layers' {plan.num_pages} pages, "
            f"{human_bytes(kinds['layer_batched_bytes'])}; the windowed layers use "
            f"{plan.kinds[0].num_pages} of them)"
        )
    return lines


def mean_accepted_length(w) -> float:
    """Slot contract: tokens accepted per sequence and step, over the steps that accepted any."""
    active = int(np.count_nonzero(w.schedule.lengths))
    return w.accepted_tokens / active if active else 0.0


def _slot_lines(w) -> list[str]:
    p, s = w.preset, w.schedule
    return [
        f"  slot contract: batch {w.batch} of {p.num_slots} slots of {p.slot_capacity} "
        f"tokens, {w.steps} steps, accept {w.accept.describe()}: {w.accepted_tokens} tokens "
        f"accepted (mean {mean_accepted_length(w):.2f} per sequence and step), {s.stopped} of "
        f"{w.batch} sequences reached the slot capacity and stopped"
    ]


def _paged_lines(w) -> list[str]:
    plan = w.plan
    if plan.mixed:
        ring, full = plan.kinds
        window = (
            f", a table of {plan.table_pages} pages per layer: window {w.window} tokens in "
            f"{ring.sequence_pages} ring pages (repeated across it), full layers up to "
            f"{full.sequence_pages}"
        )
        peak = (
            f"peak {ring.peak_pages_in_use} of {ring.num_pages} window-layer and "
            f"{full.peak_pages_in_use} of {full.num_pages} full-layer pages in use, at most "
            f"{ring.most_pages_per_sequence} and {full.most_pages_per_sequence} per sequence"
        )
    else:
        window = (
            f", window {w.window} tokens in {plan.table_pages} ring pages"
            if plan.ring
            else f", table of {plan.table_pages} pages"
        )
        peak = f"peak {plan.peak_pages_in_use} of {plan.num_pages} pages in use"
    return [
        f"  paged contract: {w.batch} sequences in flight{window}; {len(plan.prompts)} "
        f"prompts prefilled into shared pages ({w.prefill_steps} untimed steps)",
        f"  {w.steps} steps, accept {w.accept.describe()}: {plan.accepted_tokens} tokens "
        f"accepted, {w.written_tokens} written; {plan.sequences_started} sequences started, "
        f"{plan.sequences_finished} finished; {plan.shared_page_references} shared prompt "
        f"page references, {peak}"
        + (f", {plan.ring_page_reuses} ring pages overwritten" if plan.ring else ""),
    ]


def _format(value, spec, missing="n/a"):
    return missing if value is None else format(value, spec)


def significant(x: float) -> str:
    """Three significant digits: a small time or share keeps its digits (never "0.000")."""
    return f"{x:.3g}"


def _update_cells(r) -> tuple[str, str, str]:
    """(update ms, update share, update GB/s) cells: a wall-clock time with its resolution, and
    below the resolution as ``< resolution``."""
    u = r.update
    if u is None:
        return "n/a", "n/a", "n/a"
    if u.below_resolution:
        return (
            f"< {significant(u.resolution * 1e3)}",
            f"< {significant(r.update_share_resolution * 100)}%",
            "n/a",
        )
    ms, share = significant(u.seconds * 1e3), f"{significant(r.update_share * 100)}%"
    if u.resolution is not None:
        ms += f" ± {significant(u.resolution * 1e3)}"
        share += f" ± {significant(r.update_share_resolution * 100)}%"
    return ms, share, _format(r.update_gb_per_s, ".1f")


def _check_text(r) -> str:
    if r.check == "skipped":
        return "skipped"
    if r.check == "bit-exact":
        return "bit-exact vs reference"
    prefix = "FAILED: " if (r.check == "differs" and r.bit_exact_required) else ""
    return (
        f"{prefix}{r.mismatched_elements} of {r.checked_elements} {r.checked_unit} differ"
        + (f" (max {r.max_ulp} ulp)" if r.checked_unit == "elements" else "")
        + (f", {r.mismatched_scales} dynamic scales" if r.mismatched_scales else "")
    )


TABLE_HEADER = (
    "implementation",
    "steps/s",
    "spread",
    "accepted tok/s",
    "step ms",
    "update ms",
    "update share",
    "update GB/s",
    "compile s",
    "check",
)


def _row(r) -> tuple[str, ...]:
    slowest, fastest = r.times.steps_per_s_range if r.times else (None, None)
    spread = "n/a" if slowest is None else f"{slowest:.1f}-{fastest:.1f}"
    return (
        r.label,
        _format(r.steps_per_s, ".1f"),
        spread,
        _format(r.accepted_tokens_per_s, ".0f"),
        "n/a" if r.times is None else significant(r.times.median * 1e3),
        *_update_cells(r),
        f"{r.checked.compile_seconds:.2f}",
        _check_text(r),
    )


def results_table(results, w) -> str:
    rows = [TABLE_HEADER] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(widths[i]) for i, c in enumerate(row[1:-1], start=1)]
        cells.append(row[-1])
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    return "\n".join(lines + table_notes(results, w))


def table_notes(results, w) -> list[str]:
    """What the table's numbers are: the headline's replays, the checked pass, the update."""
    measured = [r for r in results if r.times is not None]
    notes = []
    if measured:
        notes.append(
            f"(steps/s: decode steps over the seconds until the device finished them, here, in "
            f"--json and in the progress bars; the median of {len(measured[0].times.samples)} "
            f"interleaved replays of each implementation, nothing collected; spread: the "
            f"slowest and the fastest replay)"
        )
    passes = ", ".join(f"{r.label} {r.checked.steps_per_s:.1f} steps/s" for r in results)
    notes.append(f"(checked pass, collecting every step's deltas for the check: {passes})")
    notes += _update_notes(measured)
    notes.append(f"(the update moves {w.update_bytes / 1e6:.2f} MB per run)")
    return notes


def _update_notes(results) -> list[str]:
    """One line per way the update was timed, naming the implementations timed that way."""
    ways: dict = {}
    for r in results:
        u = r.update
        ways.setdefault((u.method, u.basis, u.note), []).append(r.label)
    notes = []
    for (method, basis, note), labels in ways.items():
        who = ", ".join(labels)
        if method == "device":
            notes.append(
                f"(update, {who}: device time per step of {basis}, from a profiler trace of the "
                f"jitted step; share: of the median step)"
            )
            continue
        why = f"; no device time: {note}" if note else ""
        notes.append(
            f"(update, {who}: the median over the rounds of the step's time minus the same "
            f"jitted step's without the update, replayed in turn; ± its resolution, two standard "
            f"errors of that median; a share below it prints as < resolution{why})"
        )
    return notes


def difference_lines(results, w) -> list[str]:
    """For a result that differs from the reference without having to match it (the jnp
    pipeline), one line: which elements differ, by how much, and why that is expected."""
    lines = []
    for r in results:
        d = r.differences
        if d is None or r.bit_exact_required:
            continue
        lines.append(
            f'{r.label}, "max {d.max_ulp} ulp": {d.keys} keys and {d.values} values differ from '
            f"the reference, by at most {d.max_ulp} ulp (units in the last place) of "
            f"{w.pool_dtype_name} (there the stored value is {d.magnitude_at_max_ulp:.3g}; the "
            f"largest absolute difference is {d.max_abs:.3g}). Expected: the jnp pipeline "
            f"rounds as XLA does, not as the contract fixes (its RMSNorm sums in XLA's order, "
            f"and XLA may contract RoPE's multiply and add into one FMA), and where RoPE "
            f"cancels a key to near zero one rounding step is many of its tiny ulps; only the "
            f"kernel must be bit-exact"
        )
    return lines


def run_summary(w, device, results) -> dict:
    import jax

    p = w.preset
    summary = {
        "command": "run",
        "preset": p.name,
        "preset_source": p.source,
        "draft_config": p.config_path,
        "backend": device.platform,
        "device": f"{device.platform}:{device.id} ({device.device_kind})",
        "jax_version": jax.__version__,
        "contract": w.contract,
        "window": w.window,
        "window_layers": None if w.window_layers is None else list(w.window_layers),
        "fused_norm": w.fused_norm,
        "shape": _shape(w),
        "pool_bytes_by_dtype": pool_memory(w),
        "pool_by_layer_kind": w.pool_by_layer_kind(),
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
        summary.update(
            capacity_policy="stop",
            mean_accepted_length=mean_accepted_length(w),
            sequences_stopped=w.schedule.stopped,
        )
    else:
        summary["paged"] = _paged_summary(w)
    return summary


def readback_lines(results) -> list[str]:
    lines = []
    for r in results:
        if r.readback is None:
            continue
        rb = r.readback
        verdict = "passed" if rb.passed else f"FAILED: {rb.failure}"
        lines.append(
            f"read-back ({r.label}): {rb.sequences} sequences, {rb.tokens} tokens, "
            f"{rb.queries} queries; worst score / output difference "
            f"{rb.worst_score_ratio:.3g} / {rb.worst_output_ratio:.3g} of the rounding "
            f"bound (output error {rb.output_error:.3g} of the largest output): {verdict}"
        )
    return lines


def failure_lines(results) -> list[str]:
    """One line per failed check (for stderr)."""
    lines = []
    for r in results:
        if r.check == "differs" and r.bit_exact_required:
            layers = [str(n) for n, count in enumerate(r.mismatched_by_layer or ()) if count]
            lines.append(
                f"{PROG}: check FAILED: the kernel's pools differ from the NumPy reference in "
                f"{r.mismatched_elements} of {r.checked_elements} {r.checked_unit}"
                + (
                    f" and {r.mismatched_scales} of {r.checked_scales} dynamic scales"
                    if r.mismatched_scales
                    else ""
                )
                + (f" (layers {', '.join(layers)})" if layers else "")
            )
        if r.readback is not None and not r.readback.passed:
            lines.append(f"{PROG}: check FAILED: read-back ({r.label}): {r.readback.failure}")
    return lines


# The summary's "shape": its keys and the Preset attributes they hold.
_PRESET_SHAPE = {
    "layers": "num_layers",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rotary_dim": "rope_dim",
    "hidden_size": "hidden_size",
    "feature_size": "feature_size",
    "block_size": "block_size",
    "target_layers": "target_layers",
    "rope_theta": "rope_theta",
    "norm_eps": "norm_eps",
    "page_size": "page_size",
    "pages_per_slot": "pages_per_slot",
    "slots": "num_slots",
    "slot_capacity": "slot_capacity",
}
# The paged plan's counts in the summary, after its prompts and prefill steps.
_PAGED_COUNTS = (
    "sequences_started",
    "sequences_finished",
    "shared_page_references",
    "peak_pages_in_use",
    "ring_page_reuses",
)


def _shape(w) -> dict:
    shape = {key: getattr(w.preset, name) for key, name in _PRESET_SHAPE.items()}
    scaling = w.preset.rope_scaling
    shape.update(
        rope_scaling=None if scaling is None else dict(scaling),
        pool_shape=list(w.pool_shape),
        pool_bytes=w.pool_bytes(),
        dtype=w.dtype_name,
        delta_dtype=w.delta_dtype_name,
        pool_dtype=w.pool_dtype_name,
    )
    return shape


def _paged_summary(w) -> dict:
    plan = w.plan
    ring = list(plan.ring) if plan.mixed else plan.ring
    summary = dict(num_pages=plan.num_pages, table_pages=plan.table_pages, ring=ring)
    summary.update(prompts=len(plan.prompts), prefill_steps=w.prefill_steps)
    summary.update({name: getattr(plan, name) for name in _PAGED_COUNTS})
    summary["page_kinds"] = [
        dict(
            ring=k.ring,
            layers=list(range(w.preset.num_layers)) if k.layers is None else list(k.layers),
            sequence_pages=k.sequence_pages,
            num_pages=k.num_pages,
            peak_pages_in_use=k.peak_pages_in_use,
            most_pages_per_sequence=k.most_pages_per_sequence,
            ring_page_reuses=k.ring_page_reuses,
        )
        for k in plan.kinds
    ]
    return summary
