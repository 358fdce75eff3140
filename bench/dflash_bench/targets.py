"""The targets the measurements are held to: met or missed, with the numbers behind each."""

from __future__ import annotations

from dflash_bench.contenders import CONTENDERS, GEMM_CHAINS
from dflash_bench.dtypes import DTYPES
from dflash_bench.runner import gemm_added_us
from dflash_bench.runner import measured_us as us
from dflash_bench.shapes import EDGE_LLM_0_11_US

SLOT_AND_PAGED = ("ours_jax", "ours_raw", "paged_jax", "paged_raw")
# This project's op through JAX, every contract and the fused k-norm: what runs with a scale
# pool (the raw entries take none).
OURS_JAX = tuple(n for n, c in CONTENDERS.items() if c.ours and c.kind == "jax")
# Fraction of the measured copy bandwidth the update's bytes (scales included) must reach.
BANDWIDTH_TARGETS = (
    ("prefill_b8_l2048", 0.90),
    ("prefill_b8_l2048_fp8", 0.90),
    ("prefill_b8_l2048_int8", 0.90),
    ("prefill_b8_l2048_int8_dynamic", 0.85),
    ("prefill_b8_l2048_fp8_dynamic", 0.85),
    ("prefill_b8_l2048_int4", 0.85),
)
# Dynamic scales over the same format with static ones, at the same update: at most this.
DYNAMIC_OVER_STATIC = 1.10
# What makes two shapes' updates the same but for the pool format.
_SAME_UPDATE = (
    "batch",
    "delta_len",
    "dtype",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "rotary_dim",
    "page_size",
    "pages_per_slot",
)


def norm_kernels_us(kernels: dict[str, float]) -> float:
    """The unfused pair's kernels other than this project's update kernel: the RMSNorm's."""
    return sum(t for name, t in kernels.items() if "update_kernel" not in name)


class _Targets:
    def __init__(self, results: dict):
        self.entries = results["shapes"]
        self.shapes = {e["name"]: e for e in self.entries}
        self.peak = results.get("peak_copy_bandwidth", {}).get("bytes_per_s")
        self.rows: list[dict] = []

    def add(self, text: str, ok, measured: str) -> None:
        self.rows.append({"target": text, "met": bool(ok), "measured": measured})

    def bandwidth(self, e: dict, who: str) -> float | None:
        t = us(e, who)
        return None if t is None or not self.peak else e["bytes"]["total"] / (t * 1e-6) / self.peak

    def ratio(self, e: dict, who: str, other: str, limit: float, text: str) -> None:
        a, b = us(e, who), us(e, other)
        if a is not None and b is not None:
            self.add(
                f"{e['name']}: {text}",
                a <= limit * b,
                f"{a:.2f} vs {b:.2f} us ({100 * (a / b - 1):+.1f}%)",
            )


def _cpu(t: _Targets) -> None:
    for e in t.entries:
        ours, base = us(e, "ours_jax"), us(e, "jax_baseline")
        if ours and base:
            t.add(
                f"{e['name']}: CPU kernel >= 2x the straightforward JAX version",
                base / ours >= 2.0,
                f"{base / ours:.2f}x ({ours:.1f} vs {base:.1f} us)",
            )


def _absolute_and_bandwidth(t: _Targets) -> None:
    for name, limit in (("prefill_b8_l2048", 37.0), ("decode_b64", 3.5), ("decode_b1", 2.2)):
        for who in ("ours_jax", "ours_raw") if name in t.shapes else ():
            time_us = us(t.shapes[name], who)
            if time_us is not None:
                t.add(f"{name}: {who} <= {limit} us", time_us <= limit, f"{time_us:.2f} us")
    for name, want in BANDWIDTH_TARGETS:
        e = t.shapes.get(name)
        for who in SLOT_AND_PAGED if e else ():
            frac = t.bandwidth(e, who)
            if frac is not None:
                t.add(
                    f"{name}: {who} >= {100 * want:.0f}% of measured copy bandwidth (its bytes)",
                    frac >= want,
                    f"{100 * frac:.1f}%",
                )
    one, stacked = t.shapes.get("decode_b64"), t.shapes.get("decode_b64_5layers")
    for who in ("ours_jax", "ours_raw") if one and stacked else ():
        a, b = us(one, who), us(stacked, who)
        if a and b:
            t.add(
                f"5 stacked layers at B=64 L=16: {who} <= 1.6x one layer",
                b <= 1.6 * a,
                f"{b / a:.2f}x",
            )


def _per_shape(t: _Targets, e: dict) -> None:
    """Against FlashInfer, between the paths and contracts, and the fused norm's gain."""
    fi = us(e, "flashinfer")
    for who in ("ours_jax", "ours_raw"):
        mine = us(e, who)
        if fi is not None and mine is not None:
            t.add(
                f"{e['name']}: {who} faster than FlashInfer rope + append",
                mine < fi,
                f"{mine:.2f} vs {fi:.2f} us",
            )
    t.ratio(e, "ours_jax", "ours_raw", 1.10, "JAX path within 10% of the raw launcher")
    t.ratio(e, "paged_jax", "paged_raw", 1.05, "paged JAX path within 5% of the paged raw launcher")
    t.ratio(e, "paged_jax", "ours_jax", 1.10, "paged op within 10% of the slot op (JAX)")
    t.ratio(e, "paged_raw", "ours_raw", 1.10, "paged launcher within 10% of the slot launcher")
    t.ratio(e, "slots_jax", "paged_jax", 1.10, "slot-mapping op within 10% of the paged op (JAX)")
    t.ratio(e, "slots_raw", "paged_raw", 1.10, "slot-mapping launcher within 10% of the paged one")
    t.ratio(e, "knorm_jax", "paged_jax", 1.10, "fused k-norm at most +10% over the op without it")
    fused, pair, norm = (us(e, n) for n in ("knorm_jax", "unfused_jax", "rmsnorm_jax"))
    if None not in (fused, pair, norm):
        t.add(
            f"{e['name']}: fused k-norm faster than the unfused pair by at least the norm's "
            f"own time (the RMSNorm jitted alone, host-timed)",
            pair - fused >= norm,
            f"pair {pair:.2f} - fused {fused:.2f} = {pair - fused:.2f} us, norm {norm:.2f} us",
        )
    kernels = (e["contenders"].get("unfused_jax") or {}).get("kernels_us")
    if None not in (fused, pair) and kernels:
        norm = norm_kernels_us(kernels)
        t.add(
            f"{e['name']}: fused k-norm faster than the unfused pair by at least the norm's "
            f"own time (its kernels' device time in the pair)",
            pair - fused >= norm,
            f"pair {pair:.2f} - fused {fused:.2f} = {pair - fused:.2f} us, norm kernels "
            f"{norm:.2f} us",
        )


def _against_others(t: _Targets) -> None:
    """Against the quoted Edge-LLM kernel, the fp16 pool and the straightforward version."""
    for name in ("prefill_b8_l2048", "decode_b64"):
        e, peer = t.shapes.get(name), EDGE_LLM_0_11_US.get(name)
        for who in ("paged_jax", "paged_raw") if e else ():
            mine = us(e, who)
            if mine is not None:
                t.add(
                    f"{name}: {who} >= 2.5x faster than Edge-LLM 0.11 (quoted {peer} us)",
                    peer / mine >= 2.5,
                    f"{peer / mine:.2f}x ({mine:.2f} us)",
                )
    fp16 = t.shapes.get("decode_b64")
    for name in ("decode_b64_fp8", "decode_b64_int8"):
        quantized = t.shapes.get(name)
        for who in SLOT_AND_PAGED if quantized and fp16 else ():
            a, b = us(quantized, who), us(fp16, who)
            if a is not None and b is not None:
                t.add(
                    f"{name}: {who} within 10% of the fp16-pool time",
                    a <= 1.1 * b,
                    f"{a:.2f} vs {b:.2f} us ({100 * (a / b - 1):+.1f}%)",
                )
    e = t.shapes.get("prefill_b8_l2048")
    base = us(e, "jax_baseline") if e else None
    for who in ("ours_jax", "ours_raw") if e else ():
        mine = us(e, who)
        if base is not None and mine is not None:
            t.add(
                f"prefill_b8_l2048: {who} >= 5x faster than the straightforward JAX version",
                base / mine >= 5.0,
                f"{base / mine:.1f}x",
            )


def static_twin(t: _Targets, e: dict) -> dict | None:
    """The shape of the same update whose pool stores ``e``'s format with static scales (an
    ``x-dynamic`` format's ``x``), when ``e``'s has dynamic ones and that shape ran."""
    spec = DTYPES.get(e.get("pool_format", ""))
    static = DTYPES.get(spec.storage_name) if spec is not None and spec.dynamic else None
    if static is None or not static.quantized:
        return None
    key = [e.get(k) for k in _SAME_UPDATE]
    return next(
        (
            o
            for o in t.entries
            if o.get("pool_format") == static.name and [o.get(k) for k in _SAME_UPDATE] == key
        ),
        None,
    )


def _dynamic_scales(t: _Targets) -> None:
    """Per-token-head dynamic scales cost at most +10% over the same format's static scales, at
    every shape that has both, for each JAX contender of this project's op."""
    for e in t.entries:
        twin = static_twin(t, e)
        for who in OURS_JAX if twin else ():
            a, b = us(e, who), us(twin, who)
            if a is not None and b is not None:
                t.add(
                    f"{e['name']}: {who} dynamic scales at most "
                    f"+{100 * (DYNAMIC_OVER_STATIC - 1):.0f}% over static ({twin['name']})",
                    a <= DYNAMIC_OVER_STATIC * b,
                    f"{a:.2f} vs {b:.2f} us ({100 * (a / b - 1):+.1f}%)",
                )


def _gemm_chain(t: _Targets) -> None:
    """What the update adds right after the k/v GEMM that produces its deltas: at most 1.2x its
    copy floor at B=64 L=16, at most 0.8 µs at B=1 L=16."""
    for name, limit in (("decode_b64", None), ("decode_b1", 0.8)):
        e = t.shapes.get(name)
        for who in GEMM_CHAINS if e else ():
            added, alone = gemm_added_us(e, who), GEMM_CHAINS[who][0]
            if added is None:
                continue
            how = f"{added:.2f} us ({us(e, who):.2f} - {us(e, alone):.2f} of {alone})"
            if limit is not None:
                t.add(
                    f"{name}: in the GEMM chain the update adds at most {limit} us ({who})",
                    added <= limit,
                    how,
                )
                continue
            floor = us(e, "copy")
            if floor is not None:
                t.add(
                    f"{name}: in the GEMM chain the update adds at most 1.2x its copy floor ({who})",
                    added <= 1.2 * floor,
                    f"{how}, floor {floor:.2f} us ({added / floor:.2f}x)",
                )


def evaluate_targets(results: dict) -> list[dict]:
    t = _Targets(results)
    if results["backend"] == "cpu":
        _cpu(t)
        return t.rows
    _absolute_and_bandwidth(t)
    for e in t.entries:
        _per_shape(t, e)
    _against_others(t)
    _dynamic_scales(t)
    _gemm_chain(t)
    return t.rows
