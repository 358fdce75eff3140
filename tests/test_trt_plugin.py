"""The TensorRT plugin library, proven by the contract harness that plays TensorRT's calls.

CPU (wherever the plugin was built): the harness runs the builder's and the runtime's call
sequence for both contracts (slot: Edge-LLM 0.10, paged: 0.11), every pool dtype, FP8 pools and the
fused norms, and every bad-input path; it writes one JSON entry per check (``--report``), which
this file reads. ``--check-shapes`` gives the plugin's own verdict on cases written here.
GPU (the H200): the harness also enqueues on device buffers and dumps inputs and pools; every pool
the plugin produced equals the JAX op's on the GPU and the NumPy reference's, bit for bit.

The harness is the one in the editable build's tree (``build/<tag>/trt_plugin/``; it is not
installed with the package);
``DFLASH_TRT_HARNESS=/path/to/dflash_trt_contract_harness`` runs another build instead (e.g. a
build directory's ``trt_plugin/dflash_trt_contract_harness``).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers.ops import FORM_OPS
from helpers.trt_harness import (  # noqa: F401
    DELTA_TYPED,
    DTYPES,
    HARNESS_OVERRIDE,
    POOL_TYPED,
    REPO,
    _built,
    _harness_path,
    _load_case,
    _load_dump,
    _load_scale_output,
    _op_arguments,
    _run_harness,
    jax_mode,
)
from jax_dflash import _shapes
from jax_dflash.interop import trt
from jax_dflash.testing import assert_bits_equal, gpu_devices

# Groups of checks each mode must report (the harness lists them in "required_groups" too).
CPU_GROUPS = {
    "slot_contract",
    "paged_contract",
    "slot_mapping_contract",
    "quantized_contract",
    "fields",
    "slot_bad_inputs",
    "paged_bad_inputs",
    "overflow",
    "quantized_bad_inputs",
    "registration",
}
GPU_GROUPS = CPU_GROUPS | {"gpu_slot", "gpu_paged", "gpu_slot_mapping"}


@pytest.fixture(scope="module")
def plugin_library():
    return _built(trt.trt_plugin_library_path)


@pytest.fixture(scope="module")
def harness():
    return _built(_harness_path)


def _assert_groups(report, groups):
    assert groups <= set(report["required_groups"]), report["required_groups"]
    counts = {g: sum(c["group"] == g for c in report["checks"]) for g in report["required_groups"]}
    empty = [g for g, n in counts.items() if n == 0]
    assert not empty, f"required groups without any check: {empty} ({counts})"


def test_library_path_is_inside_the_package(plugin_library, monkeypatch):
    path = Path(plugin_library)
    assert path.is_absolute() and path.name == "libdflash_trt_plugin.so"
    if os.environ.get("DFLASH_TRT_PLUGIN_LIBRARY"):
        monkeypatch.delenv("DFLASH_TRT_PLUGIN_LIBRARY")
        path = Path(_built(trt.trt_plugin_library_path))
    assert path.parent.name == "lib" and path.parent.parent.name == "jax_dflash"
    import jax_dflash

    assert jax_dflash.trt_plugin_library_path() == str(path)


def test_library_path_override_and_missing_file(monkeypatch, tmp_path):
    fake = tmp_path / "libcustom.so"
    fake.write_bytes(b"")
    monkeypatch.setenv("DFLASH_TRT_PLUGIN_LIBRARY", str(fake))
    assert trt.trt_plugin_library_path() == str(fake.resolve())
    monkeypatch.setenv("DFLASH_TRT_PLUGIN_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="DFLASH_TRT_PLUGIN_LIBRARY"):
        trt.trt_plugin_library_path()


def test_contract_harness_cpu(harness, tmp_path):
    report = _run_harness(harness, report=tmp_path / "report.json")
    assert report["mode"] == "cpu"
    _assert_groups(report, CPU_GROUPS)
    assert report["dumps"] == []
    for check in report["checks"]:
        assert set(check) == {"group", "name", "passed", "detail"}, check
    # Bad input is most of it: every rejection is a check of its own.
    rejected = [c for c in report["checks"] if c["group"].endswith("_bad_inputs")]
    assert len(rejected) >= 200, len(rejected)


def test_harness_usage_errors(harness, tmp_path):
    for args in (
        ["--dump", str(tmp_path)],
        ["--bogus"],
        ["--check-shapes", str(tmp_path / "none")],
    ):
        result = subprocess.run([harness, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (args, result.stdout[-500:], result.stderr[-500:])
        assert result.stderr.strip(), args


# ---- --check-shapes: the plugin's own verdict ------------------------------------------------


def _tensor(dtype, *dims):
    return f"{dtype}:{','.join(str(d) for d in dims)}"


def _slot_line(
    name,
    *,
    fields="pages_per_slot=2",
    B=2,
    L=4,
    H=2,
    D=64,
    N=4,
    S=128,
    R=64,
    pool="float16",
    extra=(),
):
    tensors = [
        _tensor("float16", B, L, H, D),
        _tensor("float16", B, L, H, D),
        _tensor(pool, 2, N, 128, H, D),
        _tensor("float32", 1, S, R),
        _tensor("int32", B),
        _tensor("int32", B),
        *extra,
    ]
    return f"{name}|{fields}|{';'.join(tensors)}"


def _paged_line(
    name,
    *,
    fields="",
    T=8,
    H=2,
    D=64,
    N=8,
    B=3,
    M=4,
    R=64,
    pool="float16",
    table="int32",
    rope_rows=None,
    extra=(),
):
    tensors = [
        _tensor("float16", T, H, D),
        _tensor("float16", T, H, D),
        _tensor(pool, 2, N, 128, H, D),
        _tensor("float32", T if rope_rows is None else rope_rows, R),
        _tensor("int32", T),
        _tensor("int32", T),
        _tensor(table, B, 2, M),
        *extra,
    ]
    return f"{name}|{fields}|{';'.join(tensors)}"


class _Spec:
    """A shape and dtype, for jax_dflash._shapes (which needs nothing else)."""

    def __init__(self, text):
        dtype, dims = text.split(":")
        self.dtype = np.dtype(DTYPES.get(dtype, dtype))
        self.shape = tuple(int(d) for d in dims.split(",")) if dims else ()


def _python_verdict(line):
    """Whether jax_dflash._shapes accepts the line's operands (the JAX op's trace-time checks)."""
    _, fields, tensors = line.split("|")
    specs = [_Spec(t) for t in tensors.split(";")]
    options = dict(f.split("=") for f in fields.split(",") if f)
    # The form: the field's where given (the core's descriptors), else k_delta's rank.
    form = options.get("form", "slot" if len(specs[0].shape) == 4 else "paged")
    if form not in _shapes.FORMS:
        return False
    base = len(_shapes.FORMS[form]["operands"])
    extras = specs[base:]
    kwargs = {}
    if options.get("k_norm") == "1":
        kwargs["k_norm_weight"] = extras.pop()
    if len(extras) not in (0, 2):
        return False  # not this form's operand count
    if extras:
        kwargs["k_scale"], kwargs["v_scale"] = extras
    try:
        if form == "slot":
            _shapes.check_update(*specs[:6], int(options["pages_per_slot"]), **kwargs)
        elif form == "slot_mapping":
            _shapes.check_update_slots(*specs[:5], **kwargs, tensorrt=True)
        else:
            _shapes.check_update_paged(*specs[:7], **kwargs)
    except (ValueError, TypeError):
        return False
    return True


# Long: a table of shape cases, one entry each, then one harness run.
def test_check_shapes_verdicts(harness, tmp_path):
    fp8_scales = (_tensor("float32", 2), _tensor("float32", 2))
    cases = {  # name -> (line, accepted, an operand or field the rejection must name)
        "slot_ok": (_slot_line("slot_ok"), True, None),
        "slot_fp8_k_norm_ok": (
            _slot_line(
                "slot_fp8_k_norm_ok",
                fields="pages_per_slot=2,k_norm=1,v_norm=1,norm_eps=1e-5",
                pool="float8_e4m3fn",
                extra=(*fp8_scales, _tensor("float16", 64)),
            ),
            True,
            None,
        ),
        "slot_B_past_slots": (_slot_line("slot_B_past_slots", B=3), False, "k_delta"),
        "slot_S_past_cap": (_slot_line("slot_S_past_cap", S=257), False, "rope_cos_sin"),
        "slot_scales_on_fp16_pool": (
            _slot_line("slot_scales_on_fp16_pool", extra=fp8_scales),
            False,
            "past_key_value",
        ),
        "slot_weight_wrong_length": (
            _slot_line(
                "slot_weight_wrong_length",
                fields="pages_per_slot=2,k_norm=1",
                extra=(_tensor("float16", 63),),
            ),
            False,
            "k_norm_weight",
        ),
        "paged_fieldless_ok": (_paged_line("paged_fieldless_ok"), True, None),
        # The form field names the addressing form; k_delta's rank must then be that form's.
        "paged_form_field_ok": (
            _paged_line("paged_form_field_ok", fields="form=paged"),
            True,
            None,
        ),
        "slot_form_on_paged_inputs": (
            _paged_line("slot_form_on_paged_inputs", fields="form=slot,pages_per_slot=2"),
            False,
            "k_delta: expected rank 4 [B, L, H, D] (field 'form' = 'slot')",
        ),
        # The slot-mapping form has no inputs of its own to tell it by: the field names it.
        "slot_mapping_form_ok": (
            "slot_mapping_form_ok|form=slot_mapping|"
            + ";".join(
                [
                    _tensor("float16", 8, 2, 64),
                    _tensor("float16", 8, 2, 64),
                    _tensor("float16", 2, 8, 128, 2, 64),
                    _tensor("float32", 8, 64),
                    _tensor("int64", 8),
                ]
            ),
            True,
            None,
        ),
        "slot_mapping_without_its_field": (
            "slot_mapping_without_its_field||"
            + ";".join(
                [
                    _tensor("float16", 8, 2, 64),
                    _tensor("float16", 8, 2, 64),
                    _tensor("float16", 2, 8, 128, 2, 64),
                    _tensor("float32", 8, 64),
                    _tensor("int32", 8),
                ]
            ),
            False,
            "kv_page_table",
        ),
        "unknown_form": (
            _paged_line("unknown_form", fields="form=vllm"),
            False,
            "field 'form': expected an addressing form, one of 'slot', 'paged', 'slot_mapping', got 'vllm'",
        ),
        "paged_fp8_ring_ok": (
            _paged_line(
                "paged_fp8_ring_ok", fields="ring=1", pool="float8_e4m3fn", extra=fp8_scales
            ),
            True,
            None,
        ),
        "paged_M_past_N": (_paged_line("paged_M_past_N", M=9), False, "kv_page_table"),
        "paged_table_int64": (
            _paged_line("paged_table_int64", table="int64"),
            False,
            "kv_page_table",
        ),
        "paged_rope_rows": (_paged_line("paged_rope_rows", rope_rows=9), False, "rope_cos_sin"),
        "paged_fp8_without_scales": (
            _paged_line("paged_fp8_without_scales", pool="float8_e4m3fn"),
            False,
            "past_key_value",
        ),
    }
    plugin_only = {  # rules of TensorRT's contract, or fields: not the JAX op's business
        "paged_T_2_62": (_paged_line("paged_T_2_62", T=2**62), False, "k_delta"),
        "paged_with_pages_per_slot": (
            _paged_line("paged_with_pages_per_slot", fields="pages_per_slot=2"),
            False,
            "pages_per_slot",
        ),
        "slot_without_pages_per_slot": (
            _slot_line("slot_without_pages_per_slot", fields=""),
            False,
            "pages_per_slot",
        ),
        "slot_pages_per_slot_twice": (
            _slot_line("slot_pages_per_slot_twice", fields="pages_per_slot=2,pages_per_slot=2"),
            False,
            "pages_per_slot",
        ),
        "slot_ring": (_slot_line("slot_ring", fields="pages_per_slot=2,ring=1"), False, "ring"),
        "paged_page_size_64": (
            _paged_line("paged_page_size_64").replace(",128,", ",64,", 1),
            False,
            "past_key_value",
        ),
        # k_delta's rank tells the contract; a wrong count is then named by the inputs missing
        # or unexpected for that contract with these fields and this pool.
        "paged_k_norm_without_weight": (
            _paged_line("paged_k_norm_without_weight", fields="k_norm=1"),
            False,
            "k_norm_weight is missing: the paged contract (Edge-LLM 0.11, k_delta [T, H, D]) "
            "with k_norm=1 and a kHALF pool takes 8 inputs",
        ),
        "slot_k_norm_without_weight": (
            _slot_line("slot_k_norm_without_weight", fields="pages_per_slot=2,k_norm=1"),
            False,
            "k_norm_weight is missing: the slot contract (Edge-LLM 0.10, k_delta [B, L, H, D]) "
            "with k_norm=1 and a kHALF pool takes 7 inputs",
        ),
        "paged_weight_without_k_norm": (
            _paged_line("paged_weight_without_k_norm", extra=(_tensor("float16", 64),)),
            False,
            (
                "input 7 (kHALF [64]) is unexpected: the paged contract",
                "k_norm_weight only with the field k_norm=1, or k_scale and v_scale only with "
                "a kFP8 or kINT8 pool",
            ),
        ),
        "slot_weight_without_k_norm": (
            _slot_line("slot_weight_without_k_norm", extra=(_tensor("float16", 64),)),
            False,
            ("input 6 (kHALF [64]) is unexpected: the slot contract", "k_norm_weight only with"),
        ),
        # TensorRT's per-tensor scale is [1]; [] is the JAX op's only.
        "paged_scales_of_rank_0": (
            _paged_line(
                "paged_scales_of_rank_0",
                pool="float8_e4m3fn",
                extra=(_tensor("float32"), _tensor("float32")),
            ),
            False,
            "k_scale: expected shape [1] or [H] = [2], got []",
        ),
        "slot_v_scale_of_rank_0": (
            _slot_line(
                "slot_v_scale_of_rank_0",
                pool="float8_e4m3fn",
                extra=(_tensor("float32", 2), _tensor("float32")),
            ),
            False,
            "v_scale: expected shape [1] or [H] = [2], got []",
        ),
        # A misspelt field is refused, not ignored (rnig=1 would silently be no ring); the
        # attributes that pick the creator, which the ONNX parser may pass on, are ignored.
        "paged_misspelt_ring": (
            _paged_line("paged_misspelt_ring", fields="rnig=1"),
            False,
            "field 'rnig': unknown: expected one of 'pages_per_slot', 'ring', 'k_norm', 'v_norm', "
            "'norm_eps'",
        ),
        "paged_parser_attributes": (
            _paged_line("paged_parser_attributes", fields="plugin_version=1,plugin_namespace=0"),
            True,
            None,
        ),
    }
    everything = {**cases, **plugin_only}
    path = tmp_path / "cases.txt"
    path.write_text(
        "# name|fields|inputs\n\n" + "\n".join(v[0] for v in everything.values()) + "\n"
    )
    report = _run_harness(harness, "--check-shapes", str(path), report=tmp_path / "report.json")
    assert report["mode"] == "check-shapes"
    verdicts = {c["name"]: c for c in report["shape_cases"]}
    assert set(verdicts) == set(everything)
    for name, (_line, accepted, named) in everything.items():
        v = verdicts[name]
        assert v["accepted"] is accepted, (name, v)
        assert v["configure"]["accepted"] is v["on_shape_change"]["accepted"] is accepted, v
        if accepted:
            assert v["message"] == "", v
        else:
            assert v["message"].startswith("DFlashTargetKVCacheUpdate"), v
            for part in named if isinstance(named, tuple) else (named,):
                assert part in v["message"], (name, part, v["message"])
    misspelt = verdicts["paged_misspelt_ring"]
    assert misspelt["stage"] == "createPlugin", misspelt
    for name, (line, accepted, _) in cases.items():
        assert _python_verdict(line) is accepted, (
            f"{name}: jax_dflash._shapes disagrees with the plugin"
        )


def test_check_shapes_rejects_a_malformed_file(harness, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("only|two\n")
    result = subprocess.run(
        [harness, "--check-shapes", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "bad.txt:1" in result.stderr, result.stderr


# ---- the library itself --------------------------------------------------------------------------


def test_exports_the_loadlibrary_entry_points(plugin_library):
    library = ctypes.CDLL(plugin_library)
    library.getCreators.restype = ctypes.POINTER(ctypes.c_void_p)
    library.getCreators.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    count = ctypes.c_int32(-1)
    creators = library.getCreators(ctypes.byref(count))
    assert count.value == 1 and creators and creators[0]
    for name in (
        "setLoggerFinder",
        "initDFlashPlugin",
        "initDFlashPluginWithRegistry",
        "setDFlashPluginLogger",
        "getDFlashPluginTensorRTVersion",
    ):
        assert hasattr(library, name), name
    maps = Path("/proc/self/maps").read_text()
    if "libnvinfer" not in maps:  # no TensorRT in this process: the lookup must fail, not crash
        library.initDFlashPlugin.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        library.initDFlashPlugin.restype = ctypes.c_bool
        assert library.initDFlashPlugin(None, b"dflash_test") is False

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: the dynamic symbol table was not inspected")
    symbols = subprocess.run(
        [nm, "-D", "--defined-only", plugin_library], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    assert {"getCreators", "setLoggerFinder", "initDFlashPlugin"} <= exported
    # The plugin classes (dflash::trt) are exported on purpose; the core, the kernel and cudart
    # are not, and there is no test hook.
    leaked = sorted(
        s
        for s in exported
        if s.startswith(("cuda", "__cuda"))
        or (s.startswith("_ZN6dflash") and not s.startswith("_ZN6dflash3trt"))
    )
    assert not leaked, f"the static CUDA runtime / core symbols must stay private: {leaked[:10]}"


def test_depends_on_no_tensorrt_library(plugin_library):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed: the NEEDED entries were not inspected")
    dynamic = subprocess.run(
        [readelf, "-d", plugin_library], capture_output=True, text=True, check=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed, dynamic
    assert not [n for n in needed if "nvinfer" in n or "nvonnxparser" in n], needed
    assert not [n for n in needed if n.startswith("libcudart")], (
        f"cudart is linked statically: {needed}"
    )


# ---- GPU: the plugin's pools equal the JAX op's and the reference's ------------------------------


def _gpu_or_skip():
    if not gpu_devices():
        pytest.skip("no GPU backend in this JAX: the plugin's GPU parity runs on the H200")


def test_gpu_enqueue_matches_the_jax_op_and_the_reference_bit_for_bit(harness, tmp_path):
    _gpu_or_skip()
    import jax

    report = _run_harness(
        harness,
        "--gpu",
        "--dump",
        str(tmp_path / "dump"),
        report=tmp_path / "report.json",
        timeout=600,
    )
    assert report["mode"] == "gpu"
    _assert_groups(report, GPU_GROUPS)
    dumps = report["dumps"]
    # What the dumps cover, read from the index.
    forms = ("slot", "paged", "slot_mapping")
    assert {d["contract"] for d in dumps} == set(forms)
    # int4 (uint8 bytes) is dumped where contract.h's row says a CUDA kernel stores it.
    int4_on_cuda = _shapes.POOL_FORMATS["uint8"]["cuda"]
    for contract in forms:
        mine = [d for d in dumps if d["contract"] == contract]
        wanted = set(DTYPES) if int4_on_cuda else set(DTYPES) - {"uint8"}
        assert {d["pool_dtype"] for d in mine} == wanted, contract
        assert any(d["k_norm"] for d in mine) and any(d["v_norm"] for d in mine), contract
        for dtype in ("float8_e4m3fn", "int8"):
            static = [d for d in mine if d["pool_dtype"] == dtype and "scale_heads" in d]
            assert {d["scale_heads"] == 1 for d in static} == {True, False}, (contract, dtype)
        dynamic = {d["pool_format"] for d in mine if "scale_output" in d}
        assert dynamic == {"int8", "float8_e4m3fn", *(["int4"] if int4_on_cuda else [])}, contract
    assert any(d["ring"] for d in dumps if d["contract"] == "paged")
    slot_dtypes = {d["slot_dtype"] for d in dumps if d["contract"] == "slot_mapping"}
    assert slot_dtypes == {"int32", "int64"}

    gpu = gpu_devices()[0]
    for entry in dumps:
        arrays, plugin_pool = _load_dump(entry)
        args, kwargs = _op_arguments(entry, arrays)
        op, ref = FORM_OPS[entry["contract"]]
        on_gpu = {
            k: jax.device_put(v, gpu) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
        }
        with jax_mode(entry):
            expected = op(*[jax.device_put(a, gpu) for a in args], **on_gpu)
        wanted = ref(*args, **kwargs)
        plugin_scales = _load_scale_output(entry)
        try:
            if plugin_scales is None:
                assert_bits_equal(plugin_pool, np.asarray(expected))
                assert_bits_equal(plugin_pool, wanted)
            else:  # (pool, scale pool), both compared
                for got, jax_result, ref_result in zip(
                    (plugin_pool, plugin_scales), expected, wanted
                ):
                    assert_bits_equal(got, np.asarray(jax_result))
                    assert_bits_equal(got, ref_result)
        except AssertionError as e:
            raise AssertionError(f"case {entry['name']}: {e}") from None
        assert not np.array_equal(
            plugin_pool.view(np.uint8), arrays["past_key_value"].view(np.uint8)
        ), entry["name"]


# ---- TensorRT itself, where installed -----------------------------------------------------------


def test_build_engine_with_tensorrt(plugin_library):
    tensorrt = pytest.importorskip(
        "tensorrt", reason="the 'tensorrt' package (builder) cannot be imported here"
    )
    _gpu_or_skip()
    from jax_dflash.interop.onnx import make_update_model

    model = make_update_model(
        num_kv_heads=2,
        head_dim=64,
        num_pages=8,
        pages_per_slot=2,
        rotary_dim=64,
        rope_seq_len=256,
        dtype="float16",
    )
    shapes = {
        "k_delta": ((1, 1, 2, 64), (2, 8, 2, 64), (4, 16, 2, 64)),
        "v_delta": ((1, 1, 2, 64), (2, 8, 2, 64), (4, 16, 2, 64)),
        "delta_start_positions": ((1,), (2,), (4,)),
        "delta_lengths": ((1,), (2,), (4,)),
    }
    engine = trt.build_engine(model, input_shapes=shapes)
    assert isinstance(engine, bytes) and len(engine) > 0
    runtime = tensorrt.Runtime(tensorrt.Logger(tensorrt.Logger.WARNING))
    assert runtime.deserialize_cuda_engine(engine) is not None
