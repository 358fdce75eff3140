"""``run --compare-formats [PNG]``: the same workload written into every pool format, each
checked (the kernel against the NumPy reference, bit for bit, and the read-back), and what each
costs and loses: pool bytes per token and in total (a dynamic format's scales included), and the
read-back attention's error relative to attention over keys and values recomputed in float32
(:attr:`jax_dflash.cli.readback.ReadbackResult.output_error`). Optionally a PNG plot: memory on
x, error on y, one labelled point per format (matplotlib, the ``[plot]`` extra).

Every format runs the run's plan (the seed draws the same schedule, weights and features for
each: only the pool's format differs); the timing replays are left out, as the comparison is
about memory and error. A format the op's CUDA handler does not write (its contract row's
``cuda`` field) is skipped on a GPU with the reason printed.
"""

from __future__ import annotations

import dataclasses
import os

from jax_dflash.cli.common import UsageError
from jax_dflash.cli.formats import FP8_NAMES, INT4_NAMES, INT8_NAMES, is_dynamic

PLOT_INSTALL = 'pip install -e ".[plot]"'


def compared_formats(delta_dtype: str) -> tuple[str, ...]:
    """The 16-bit pool of the run's deltas (float16 for float32 deltas), FP8 and int8 with
    static scales, and the dynamic formats (int4 last)."""
    sixteen = "float16" if delta_dtype == "float32" else delta_dtype
    return (
        sixteen,
        *FP8_NAMES,
        *INT8_NAMES,
        "int8-dynamic",
        "float8_e4m3fn-dynamic",
        "float8_e5m2-dynamic",
        *INT4_NAMES,
    )


@dataclasses.dataclass
class FormatRow:
    name: str
    bytes_per_token: float | None = None  # all layers, K and V, scales included
    pool_bytes: int | None = None
    output_error: float | None = None
    check: str | None = None  # the kernel against the reference
    readback_passed: bool | None = None
    skipped: str | None = None  # why the format did not run

    @property
    def failed(self) -> bool:
        return self.check == "differs" or self.readback_passed is False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_plot_destination(path: str | None) -> None:
    """Before the run: matplotlib is importable and the PNG's folder exists; UsageError naming
    ``--compare-formats`` otherwise."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            f"--compare-formats {path}: the plot needs matplotlib, the [plot] extra "
            f"({PLOT_INSTALL}); or pass --compare-formats without a PNG path for the table only"
        ) from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(
            f"--compare-formats {path}: folder {folder} does not exist (expected a PNG path in "
            "an existing folder)"
        )
    if os.path.isdir(path):
        raise UsageError(f"--compare-formats {path}: is a folder (expected a PNG file path)")


def run_formats(make_workload, formats, device, *, out) -> list[FormatRow]:
    """Each format's checked pass (no replays): ``make_workload(kv_dtype)`` builds the plan."""
    from jax_dflash.cli import report
    from jax_dflash.cli.run_settings import format_runs_on

    rows = []
    for name in formats:
        row = FormatRow(name)
        rows.append(row)
        if not format_runs_on(name, device):
            row.skipped = (
                f"the op's CUDA handler does not write {name} pools yet: rerun with "
                "--backend cpu to compare it"
            )
            print(f"  {name}: skipped ({row.skipped})", file=out, flush=True)
            continue
        w = make_workload(name)
        result = w.run("kernel", check=True, check_readback=True, progress=False)
        row.bytes_per_token = report.bytes_per_token(w)
        row.pool_bytes = w.pool_bytes()
        row.output_error = result.readback.output_error
        row.check = result.check
        row.readback_passed = result.readback.passed
        print(f"  {name}: done", file=out, flush=True)
    return rows


def table(rows: list[FormatRow]) -> str:
    from jax_dflash.cli.presets import human_bytes

    header = ("pool format", "bytes/token", "pool", "read-back error", "check", "read-back")
    lines = []
    for r in rows:
        if r.skipped is not None:
            lines.append((r.name, "-", "-", "-", "skipped", "skipped"))
            continue
        lines.append(
            (
                r.name,
                f"{r.bytes_per_token:g}",
                human_bytes(r.pool_bytes),
                f"{r.output_error:.3g}",
                "bit-exact vs reference" if r.check == "bit-exact" else r.check,
                "passed" if r.readback_passed else "FAILED",
            )
        )
    widths = [max(len(str(x[i])) for x in (header, *lines)) for i in range(len(header))]

    def fmt(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [fmt(header), fmt(["-" * w for w in widths]), *(fmt(x) for x in lines)]
    out.append(
        "(bytes/token: every layer's key and value of one token, a dynamic format's float32 "
        "scale per head and plane included, int4 two elements per byte; read-back error"
        ": the largest difference of "
        "attention outputs over the pool from those over keys and values recomputed in "
        "float32, relative to the largest output)"
    )
    for r in rows:
        if r.skipped is not None:
            out.append(f"{r.name}: skipped: {r.skipped}")
    return "\n".join(out)


def plot(rows: list[FormatRow], path: str, title: str) -> None:
    """Memory per token on x, the read-back error on y (log), one labelled point per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.skipped is None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ran:
        error = max(r.output_error, 1e-12)  # a log axis has no zero
        marker = "s" if is_dynamic(r.name) else "o"
        ax.scatter([r.bytes_per_token], [error], marker=marker)
        ax.annotate(r.name, (r.bytes_per_token, error), textcoords="offset points", xytext=(5, 5))
    ax.set_yscale("log")
    ax.set_xlabel("pool bytes per token (all layers, K and V, scales included)")
    ax.set_ylabel("read-back attention error (relative)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
