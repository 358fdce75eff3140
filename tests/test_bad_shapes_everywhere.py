"""One table of bad shapes and dtypes for both contracts, sent through every checker:

(a) the Python checks (``jax_dflash._shapes``) and the JAX op itself, called eagerly;
(b) the FFI handler, through a hand-written ``ffi_call`` that bypasses the Python checks (in a
    child process, so a crash fails the row instead of the run);
(c) the TensorRT plugin's own checks, through its contract harness's ``--check-shapes`` mode.

Every row must be rejected by each path it applies to, each message naming the row's operand;
the valid rows must be accepted by all of them. Rows that only one runtime's contract rules out
say so (``paths``), and are then accepted by the others.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers.children import run_in_children

ALL_PATHS = ("python", "op", "ffi", "plugin")
I64 = 2**63
DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "int32": np.int32,
    "int64": np.int64,
}

SLOT_NAMES = (
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_start_positions",
    "delta_lengths",
)
PAGED_NAMES = (
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_positions",
    "delta_token_to_sequence",
    "kv_page_table",
)
EXTRAS = ("k_scale", "v_scale", "k_norm_weight")


def slot_specs(B=2, L=4, H=2, D=64, N=4, P=128, S=128, R=64, Rb=1, delta="float16", pool="float16"):
    """The slot operands (name -> (dtype, dims)) at TensorRT's page size: valid as given."""
    return {
        "k_delta": (delta, (B, L, H, D)),
        "v_delta": (delta, (B, L, H, D)),
        "past_key_value": (pool, (2, N, P, H, D)),
        "rope_cos_sin": ("float32", (Rb, S, R)),
        "delta_start_positions": ("int32", (B,)),
        "delta_lengths": ("int32", (B,)),
    }


def paged_specs(T=8, H=2, D=64, N=8, P=128, B=3, M=4, R=64, delta="float16", pool="float16"):
    """The paged operands at TensorRT's page size: valid as given."""
    return {
        "k_delta": (delta, (T, H, D)),
        "v_delta": (delta, (T, H, D)),
        "past_key_value": (pool, (2, N, P, H, D)),
        "rope_cos_sin": ("float32", (T, R)),
        "delta_positions": ("int32", (T,)),
        "delta_token_to_sequence": ("int32", (T,)),
        "kv_page_table": ("int32", (B, 2, M)),
    }


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    contract: str
    specs: dict  # name -> (dtype, dims), base operands then the extras present
    names: str | None  # the operand every rejection must name; None: a valid row
    pages_per_slot: int = 2
    paths: tuple = ALL_PATHS  # where the row is rejected; accepted everywhere else
    note: str = ""

    @property
    def id(self):
        return f"{self.contract}-{self.name}"


def _with(specs, **changes):
    out = dict(specs)
    out.update(changes)
    return out


def _fp8_scales(n=2):
    return {"k_scale": ("float32", (n,)), "v_scale": ("float32", (n,))}


# Long: a table of cases, one entry each.
def _rows():
    s, p = slot_specs(), paged_specs()
    s_fp8, p_fp8 = slot_specs(pool="float8_e4m3fn"), paged_specs(pool="float8_e4m3fn")
    weight = {"k_norm_weight": ("float16", (64,))}
    rows = [
        # Valid rows: every path accepts them (so a path that rejects everything cannot pass).
        Row("valid", "slot", s, None),
        Row("valid_fp8_k_norm", "slot", {**s_fp8, **_fp8_scales(), **weight}, None),
        Row("valid", "paged", p, None),
        Row("valid_fp8_k_norm", "paged", {**p_fp8, **_fp8_scales(), **weight}, None),
        # Ranks.
        Row(
            "k_delta_rank_5",
            "slot",
            _with(s, k_delta=("float16", (1, 2, 4, 2, 64)), v_delta=("float16", (1, 2, 4, 2, 64))),
            "k_delta",
        ),
        Row(
            "k_delta_rank_4",
            "paged",
            _with(p, k_delta=("float16", (1, 8, 2, 64)), v_delta=("float16", (1, 8, 2, 64))),
            "k_delta",
        ),
        Row(
            "pool_rank_4",
            "slot",
            _with(s, past_key_value=("float16", (8, 128, 2, 64))),
            "past_key_value",
        ),
        Row(
            "pool_rank_4",
            "paged",
            _with(p, past_key_value=("float16", (16, 128, 2, 64))),
            "past_key_value",
        ),
        Row("rope_rank_2", "slot", _with(s, rope_cos_sin=("float32", (128, 64))), "rope_cos_sin"),
        Row("rope_rank_3", "paged", _with(p, rope_cos_sin=("float32", (1, 8, 64))), "rope_cos_sin"),
        Row(
            "starts_rank_2",
            "slot",
            _with(s, delta_start_positions=("int32", (1, 2)), delta_lengths=("int32", (1, 2))),
            "delta_start_positions",
        ),
        Row("table_rank_2", "paged", _with(p, kv_page_table=("int32", (3, 8))), "kv_page_table"),
        # H / D of the deltas against the pool's.
        Row(
            "heads_mismatch",
            "slot",
            _with(s, k_delta=("float16", (2, 4, 3, 64)), v_delta=("float16", (2, 4, 3, 64))),
            "k_delta",
        ),
        Row(
            "head_dim_mismatch",
            "paged",
            _with(p, k_delta=("float16", (8, 2, 32)), v_delta=("float16", (8, 2, 32))),
            "k_delta",
        ),
        Row(
            "heads_mismatch",
            "paged",
            _with(p, k_delta=("float16", (8, 1, 64)), v_delta=("float16", (8, 1, 64))),
            "k_delta",
        ),
        # The page size: TensorRT's contracts fix P = 128; the JAX op takes any P > 0.
        Row(
            "page_size_64",
            "slot",
            slot_specs(P=64),
            "past_key_value",
            paths=("plugin",),
            note="plugin only: P = 128 is TensorRT's contract, the JAX op accepts any P > 0",
        ),
        Row(
            "page_size_64",
            "paged",
            paged_specs(P=64),
            "past_key_value",
            paths=("plugin",),
            note="plugin only: P = 128 is TensorRT's contract, the JAX op accepts any P > 0",
        ),
        # The rotary dim.
        Row("rotary_dim_odd", "slot", slot_specs(R=63), "rope_cos_sin"),
        Row("rotary_dim_odd", "paged", paged_specs(R=63), "rope_cos_sin"),
        Row("rotary_dim_past_head_dim", "slot", slot_specs(R=66), "rope_cos_sin"),
        Row("rotary_dim_past_head_dim", "paged", paged_specs(R=66), "rope_cos_sin"),
        # The slot contract's equalities.
        Row("rope_batch_not_1_or_B", "slot", slot_specs(Rb=3), "rope_cos_sin"),
        Row("rope_length_past_slot_capacity", "slot", slot_specs(S=257), "rope_cos_sin"),
        Row("batch_past_slots", "slot", slot_specs(B=3), "k_delta"),
        Row("pages_not_divisible_by_pages_per_slot", "slot", slot_specs(N=5), "past_key_value"),
        # The paged contract's.
        Row("table_pages_past_pool_pages", "paged", paged_specs(M=9), "kv_page_table"),
        Row(
            "table_dim_1_is_3",
            "paged",
            _with(p, kv_page_table=("int32", (3, 3, 4))),
            "kv_page_table",
        ),
        Row(
            "rope_rows_not_tokens",
            "paged",
            _with(p, rope_cos_sin=("float32", (9, 64))),
            "rope_cos_sin",
        ),
        # Index dtypes.
        Row(
            "starts_int64",
            "slot",
            _with(s, delta_start_positions=("int64", (2,))),
            "delta_start_positions",
        ),
        Row("lengths_int64", "slot", _with(s, delta_lengths=("int64", (2,))), "delta_lengths"),
        Row(
            "positions_int64", "paged", _with(p, delta_positions=("int64", (8,))), "delta_positions"
        ),
        Row(
            "owners_int64",
            "paged",
            _with(p, delta_token_to_sequence=("int64", (8,))),
            "delta_token_to_sequence",
        ),
        Row("table_int64", "paged", _with(p, kv_page_table=("int64", (3, 2, 4))), "kv_page_table"),
        # Delta dtypes.
        Row("v_dtype_not_k_dtype", "slot", _with(s, v_delta=("float32", (2, 4, 2, 64))), "v_delta"),
        Row("v_dtype_not_k_dtype", "paged", _with(p, v_delta=("bfloat16", (8, 2, 64))), "v_delta"),
        # The extras.
        Row("scales_on_a_float16_pool", "slot", {**s, **_fp8_scales()}, "k_scale"),
        Row("scales_on_a_float16_pool", "paged", {**p, **_fp8_scales()}, "k_scale"),
        Row("fp8_pool_without_scales", "slot", s_fp8, "k_scale"),
        Row("fp8_pool_without_scales", "paged", p_fp8, "k_scale"),
        Row("scale_of_three_heads", "slot", {**s_fp8, **_fp8_scales(3)}, "k_scale"),
        Row("scale_of_three_heads", "paged", {**p_fp8, **_fp8_scales(3)}, "k_scale"),
        Row("weight_of_63", "slot", {**s, "k_norm_weight": ("float16", (63,))}, "k_norm_weight"),
        Row("weight_of_65", "paged", {**p, "k_norm_weight": ("float16", (65,))}, "k_norm_weight"),
        # A pool of 2^61 float32 elements: the count fits int64, its bytes (2^63) do not.
        Row(
            "pool_bytes_overflow_int64",
            "slot",
            slot_specs(N=2**46, pool="float32"),
            "past_key_value",
            paths=("python", "plugin"),
            note="no FFI or op call: such a pool cannot be allocated",
        ),
        Row(
            "pool_bytes_overflow_int64",
            "paged",
            paged_specs(N=2**46, pool="float32"),
            "past_key_value",
            paths=("python", "plugin"),
            note="no FFI or op call: such a pool cannot be allocated",
        ),
    ]
    return rows


ROWS = _rows()
BY_ID = {r.id: r for r in ROWS}


def _materialisable(row):
    return all(int(np.prod(dims, dtype=np.float64)) < 2**26 for _, dims in row.specs.values())


def _applies(row, path):
    """Whether ``path`` sees the row: it rejects the rows in ``paths``, accepts the rest; rows
    too large to allocate only reach the shape-only checkers."""
    return path in ("python", "plugin") or _materialisable(row)


# ---- (a) the Python checks and the op ---------------------------------------------------------


class _Spec:
    def __init__(self, dtype, dims):
        self.dtype = np.dtype(DTYPES[dtype])
        self.shape = tuple(dims)


def _split(row, make):
    names = SLOT_NAMES if row.contract == "slot" else PAGED_NAMES
    base = [make(*row.specs[n]) for n in names]
    extras = {n: make(*row.specs[n]) for n in EXTRAS if n in row.specs}
    return base, extras


def python_verdict(row):
    """``None`` when jax_dflash._shapes accepts the row, else its error message."""
    from jax_dflash import _shapes

    base, extras = _split(row, _Spec)
    try:
        if row.contract == "slot":
            _shapes.check_update(*base, row.pages_per_slot, **extras)
        else:
            _shapes.check_update_paged(*base, **extras)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _array(dtype, dims):
    fill = 1 if dtype == "float32" else 0  # scales of 1; everything else zeros
    return np.full(dims, fill, DTYPES[dtype])


def op_verdict(row):
    """``None`` when the JAX op (called eagerly on arrays of the row's specs) accepts the row."""
    import jax_dflash

    base, extras = _split(row, _array)
    try:
        if row.contract == "slot":
            jax_dflash.target_kv_cache_update(*base, pages_per_slot=row.pages_per_slot, **extras)
        else:
            jax_dflash.target_kv_cache_update_paged(*base, **extras)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


# ---- (b) the FFI handler, in a child process -----------------------------------------------------


def _ffi_run(row) -> dict:
    import jax

    base, extras = _split(row, _array)
    operands = base + [extras[n] for n in EXTRAS if n in extras]
    attrs = {}
    if row.contract == "slot":
        attrs["pages_per_slot"] = np.int64(row.pages_per_slot)
    if "k_norm_weight" in extras:
        attrs["k_norm"] = np.bool_(True)
    pool = base[2]
    target = (
        "dflash_target_kv_cache_update"
        if row.contract == "slot"
        else "dflash_target_kv_cache_update_paged"
    )
    fn = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={2: 0}
    )
    try:
        jax.block_until_ready(jax.jit(lambda *a: fn(*a, **attrs))(*operands))
    except Exception as e:  # noqa: BLE001  (the error is the verdict)
        return {"id": row.id, "status": "error", "message": str(e)}
    return {"id": row.id, "status": "ok"}


def _child(ids):
    import jax

    jax.config.update("jax_enable_x64", True)  # int64 operands must reach the handler
    from jax_dflash import _ext

    _ext.ensure_registered("cpu")
    for row_id in ids:
        print(json.dumps({"start": row_id}), flush=True)
        print(json.dumps(_ffi_run(BY_ID[row_id])), flush=True)


_ffi_cache: dict = {}


def ffi_verdict(row):
    if not _ffi_cache:
        ids = [r.id for r in ROWS if _applies(r, "ffi")]
        _ffi_cache.update(run_in_children("cpu", ids, Path(__file__)))
    result = _ffi_cache[row.id]
    if result["status"] == "crash":
        raise AssertionError(
            f"{row.id}: the FFI call crashed its process "
            f"(exit {result['returncode']}):\n{result['stderr']}"
        )
    return None if result["status"] == "ok" else result["message"]


# ---- (c) the plugin, through the contract harness ------------------------------------------------


def plugin_line(row) -> str:
    """The row as a --check-shapes line (trt_plugin/README.md, "Shape cases")."""
    fields = []
    if row.contract == "slot":
        fields.append(f"pages_per_slot={row.pages_per_slot}")
    if "k_norm_weight" in row.specs:
        fields.append("k_norm=1")
    names = (SLOT_NAMES if row.contract == "slot" else PAGED_NAMES) + tuple(
        n for n in EXTRAS if n in row.specs
    )
    tensors = [f"{row.specs[n][0]}:{','.join(str(d) for d in row.specs[n][1])}" for n in names]
    return f"{row.id}|{','.join(fields)}|{';'.join(tensors)}"


def _harness():
    from helpers.trt_harness import _harness_path

    try:
        return _harness_path()
    except FileNotFoundError as e:
        pytest.skip(f"the TensorRT contract harness is not built here: {e}")


_plugin_cache: dict = {}


def plugin_verdict(row, tmp_dir: Path):
    if not _plugin_cache:
        harness = _harness()
        cases = tmp_dir / "bad_shapes.txt"
        cases.write_text("\n".join(plugin_line(r) for r in ROWS) + "\n")
        report = tmp_dir / "report.json"
        done = subprocess.run(
            [harness, "--check-shapes", str(cases), "--report", str(report)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode in (0, 1) and report.is_file(), (
            f"harness exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
        for entry in json.loads(report.read_text())["shape_cases"]:
            _plugin_cache[entry["name"]] = entry
    entry = _plugin_cache[row.id]
    assert entry["configure"]["accepted"] == entry["on_shape_change"]["accepted"], entry
    return None if entry["accepted"] else entry["message"]


# ---- the tests ----------------------------------------------------------------------------------


def _check(row, path, verdict):
    rejected = row.names is not None and path in row.paths
    if not rejected:
        assert verdict is None, f"{row.id}: {path} rejected a row it must accept: {verdict}"
        return
    assert verdict is not None, (
        f"{row.id}: {path} accepted it (expected an error naming "
        f"{row.names}{'; ' + row.note if row.note else ''})"
    )
    assert row.names in verdict, f"{row.id}: {path}'s message does not name {row.names}: {verdict}"


def _params(path):
    return [pytest.param(r, id=r.id) for r in ROWS if _applies(r, path)]


@pytest.mark.parametrize("row", _params("python"))
def test_python_checks(row):
    _check(row, "python", python_verdict(row))


@pytest.mark.parametrize("row", _params("op"))
def test_jax_op(row):
    _check(row, "op", op_verdict(row))


@pytest.mark.parametrize("row", _params("ffi"))
def test_ffi_handler(row):
    _check(row, "ffi", ffi_verdict(row))


@pytest.mark.parametrize("row", _params("plugin"))
def test_plugin_checks(row, tmp_path_factory):
    _check(row, "plugin", plugin_verdict(row, tmp_path_factory.mktemp("harness")))


def test_the_table_covers_the_rules():
    """Every rule the table is meant to exercise has a row in each contract it exists in."""
    kinds = {r.name for r in ROWS}
    for wanted in (
        "valid",
        "pool_rank_4",
        "heads_mismatch",
        "page_size_64",
        "rotary_dim_odd",
        "rotary_dim_past_head_dim",
        "rope_batch_not_1_or_B",
        "rope_length_past_slot_capacity",
        "batch_past_slots",
        "pages_not_divisible_by_pages_per_slot",
        "table_pages_past_pool_pages",
        "table_dim_1_is_3",
        "rope_rows_not_tokens",
        "table_int64",
        "v_dtype_not_k_dtype",
        "scales_on_a_float16_pool",
        "fp8_pool_without_scales",
        "scale_of_three_heads",
        "pool_bytes_overflow_int64",
    ):
        assert wanted in kinds, wanted
    for row in ROWS:  # each row's line parses as the harness expects: 3 fields, one per input
        assert plugin_line(row).count("|") == 2


if __name__ == "__main__":
    _child(sys.argv[2:])
