"""The run's plot: time per update against bytes moved, log-log."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_bench.contenders import CONTENDERS, GEMM_CONTENDERS
from dflash_bench.runner import measured_us as us
from dflash_bench.shapes import EDGE_LLM_0_11_US


def plot(results: dict, path: Path) -> str | None:
    """Time per update against bytes moved, log-log, one series per contender (and the quoted
    Edge-LLM numbers)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return (
            f"no plot: matplotlib is not importable ({e}); the [plot] extra installs it: "
            f'pip install -e ".[plot]" from the checkout'
        )
    fig, ax = plt.subplots(figsize=(9, 6))
    markers = dict(zip(CONTENDERS, "o^sv<>*Dph"))
    for name in (n for n in results["contenders"] if n not in GEMM_CONTENDERS):
        points = sorted(
            (e["bytes"]["total"], us(e, name)) for e in results["shapes"] if us(e, name) is not None
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=markers.get(name, "x"), linestyle="none", label=name, alpha=0.8)
    if results["backend"] == "gpu":
        points = sorted(
            (e["bytes"]["total"], EDGE_LLM_0_11_US[e["name"]])
            for e in results["shapes"]
            if e["name"] in EDGE_LLM_0_11_US
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(
                xs, ys, marker="X", color="black", linestyle="none", label="Edge-LLM 0.11 (quoted)"
            )
    peak = results.get("peak_copy_bandwidth", {}).get("bytes_per_s")
    sizes = [e["bytes"]["total"] for e in results["shapes"]]
    if peak and sizes:
        xs = np.geomspace(min(sizes), max(sizes), 50)
        ax.plot(
            xs,
            xs / peak * 1e6,
            "k--",
            linewidth=0.8,
            label=f"peak copy bandwidth ({peak / 1e12:.2f} TB/s)",
        )
    for e in results["shapes"]:
        t = us(e, "paged_jax") or us(e, "ours_jax")
        if t is not None:
            ax.annotate(
                e["name"],
                (e["bytes"]["total"], t),
                fontsize=7,
                xytext=(4, -10),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per update (K/V read + pool write + cos/sin read)")
    ax.set_ylabel("time per update (us)")
    ax.set_title(f"DFlash target KV-cache update, {results['device']}")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
