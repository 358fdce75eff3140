"""What a run reports: the results' header, the tables and findings printed, the JSON (and the
plot) written."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import numpy as np

from dflash_bench.contenders import GEMM_CHAINS, GEMM_CONTENDERS, OURS
from dflash_bench.plot import plot
from dflash_bench.shapes import EDGE_LLM_0_11_US
from dflash_bench.timing import Settings


def _versions() -> dict:
    import jax
    import jaxlib

    out = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
    }
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def device_name(backend: str) -> str:
    if backend == "gpu":
        import jax

        return jax.devices("gpu")[0].device_kind
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def new_results(
    settings: Settings, device: str, argv, quick: bool, contenders: list, peak: dict
) -> dict:
    """The results' header: what ran where, with which settings; ``shapes`` still empty."""
    backend = settings.backend
    return {
        "backend": backend,
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "arguments": list(sys.argv[1:] if argv is None else argv),
        "versions": _versions(),
        "env": {
            k: os.environ[k]
            for k in (
                "XLA_FLAGS",
                "XLA_PYTHON_CLIENT_PREALLOCATE",
                "CUDA_VISIBLE_DEVICES",
                "DFLASH_PDL",
            )
            if k in os.environ
        },
        "settings": dataclasses.asdict(settings),
        "quick": quick,
        "contenders": contenders,
        "peak_copy_bandwidth": peak,
        "edge_llm_0_11_quoted_us": EDGE_LLM_0_11_US if backend == "gpu" else {},
        "shapes": [],
    }


def _fmt_us(entry: dict, name: str) -> str:
    c = entry["contenders"].get(name, {})
    if c.get("status") == "ok":
        return f"{c['us']:.2f}" + (" (host-bound)" if c.get("host_bound") else "")
    if c.get("status") == "wrong":
        return f"WRONG {c['us']:.2f}"
    return {"skipped": "skip", "error": "error"}.get(c.get("status"), "-")


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def format_table(results: dict) -> str:
    """Times per update, then (second table) the fractions of the floor and of copy bandwidth,
    then (when one ran) the GEMM chains'."""
    names = [n for n in results["contenders"] if n not in GEMM_CONTENDERS]
    peer = results["backend"] == "gpu"
    head = ["shape", "bytes"] + [f"{n} (us)" for n in names]
    head += ["Edge-LLM 0.11, quoted (us)"] if peer else []
    rows = []
    for e in results["shapes"]:
        row = [e["description"], _fmt_bytes(e["bytes"]["total"])] + [_fmt_us(e, n) for n in names]
        if peer:
            row.append(f"{EDGE_LLM_0_11_US[e['name']]}" if e["name"] in EDGE_LLM_0_11_US else "-")
        rows.append(row)
    ours = [n for n in OURS if n in names]
    fractions_head = ["shape"] + [f"% of floor ({n})" for n in ours]
    fractions_head += [f"% of copy BW ({n})" for n in ours]
    fractions = []
    for e in results["shapes"]:
        d = e["derived"]

        def pct(key, d=d):
            return f"{100 * d[key]:.0f}%" if key in d else "-"

        fractions.append(
            [e["description"]]
            + [pct(f"floor_over_{n}") for n in ours]
            + [pct(f"{n}_fraction_of_peak_copy_bw") for n in ours]
        )
    tables = _table(head, rows) + [""] + _table(fractions_head, fractions)
    gemm_rows = gemm_chain_rows(results)
    if gemm_rows:
        tables += ["", "GEMM chain: the update right after the k/v GEMM producing its deltas"]
        tables += _table(GEMM_HEAD, gemm_rows)
    return "\n".join(tables)


GEMM_HEAD = [
    "shape",
    "chain",
    "GEMM + split alone (us)",
    "GEMM + split + update (us)",
    "update added (us)",
    "update back to back (us)",
    "copy floor (us)",
    "added / floor",
]


def gemm_chain_rows(results: dict) -> list[list[str]]:
    """One row per shape and GEMM chain that ran: the chain alone and with the update per step,
    the update's added time, its back-to-back time and the copy floor."""
    rows = []
    for e in results["shapes"]:
        d = e.get("derived", {})
        for name, (alone, back_to_back) in GEMM_CHAINS.items():
            if f"{name}_added_us" not in d:
                continue
            over = d.get(f"{name}_added_over_floor")
            rows.append(
                [
                    e["description"],
                    name,
                    _fmt_us(e, alone),
                    _fmt_us(e, name),
                    f"{d[f'{name}_added_us']:.2f}",
                    _fmt_us(e, back_to_back),
                    _fmt_us(e, "copy"),
                    "-" if over is None else f"{over:.2f}x",
                ]
            )
    return rows


def _with_status(results: dict, status: str) -> list[tuple[str, str, dict]]:
    return [
        (e["name"], n, c)
        for e in results["shapes"]
        for n, c in e["contenders"].items()
        if c.get("status") == status
    ]


def print_findings(results: dict) -> list[tuple[str, str]]:
    """Prints the targets, the clocks, wrong results and contenders that did not run; returns
    the wrong ones, (shape, contender or "reference")."""
    for t in results["targets"]:
        limited = (
            " (this shape ran below the top SM clock: see clocks)" if "clock_limited" in t else ""
        )
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}{limited}")
    print(f"  clocks: {results['clock_sampling']}")
    for note in results["clock_notes"]:
        print(f"  clocks: {note}")
    wrong = [(shape, n) for shape, n, _ in _with_status(results, "wrong")]
    for e in results["shapes"]:
        if e.get("references_agree") is False:
            print(f"  WRONG REFERENCE: slot and paged references differ at {e['name']}")
            wrong.append((e["name"], "reference"))
        for n, c in e["contenders"].items():
            if c.get("status") == "wrong":
                print(f"  WRONG RESULT: {n} at {e['name']}: {c['check']}")
    for e in results["shapes"]:
        for n, c in e["contenders"].items():
            if c.get("status") in ("skipped", "error"):
                print(f"  {c['status']}: {n} at {e['name']}: {c['reason']}")
    return wrong


def errors(results: dict) -> list[tuple[str, str]]:
    """(shape, contender) of every contender that failed with an error."""
    return [(shape, n) for shape, n, _ in _with_status(results, "error")]


def write_outputs(results: dict, out: Path) -> None:
    """``kv_update_<backend>.json`` and, when matplotlib is importable, the ``.png`` plot."""
    json_path = out / f"kv_update_{results['backend']}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {json_path}")
    png_path = out / f"kv_update_{results['backend']}.png"
    message = plot(results, png_path)
    print(message or f"wrote {png_path}")
