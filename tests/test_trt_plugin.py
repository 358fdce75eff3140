"""The TensorRT plugin library, proven by the contract harness that plays TensorRT's calls.

CPU (always, where the plugin was built): the harness runs the builder's and the runtime's call
sequence for every dtype, and every bad-input path (error codes and logged messages); the library
exports the loadLibrary entry points and depends on no TensorRT library.
GPU (the H200): the harness also runs enqueue on device buffers and dumps inputs and pools; the
pool the plugin produced equals the JAX op's output on the same inputs, bit for bit.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_bits_equal, gpu_devices
from jax_dflash import reference
from jax_dflash.interop import trt

REPO = Path(__file__).resolve().parent.parent
DTYPE_NAMES = ("float16", "bfloat16", "float32")
CONTRACT_ORDER = (  # the calls a TensorRT builder, then runtime, make, in this order
    "creator getFieldNames",
    "createPlugin(kBUILD)",
    "capability kCORE",
    "capability kBUILD",
    "capability kRUNTIME",
    "getOutputDataTypes",
    "getOutputShapes",
    "supportsFormatCombination accepts",
    "configurePlugin with min/opt/max",
    "getWorkspaceSize",
    "getAliasedInput(0) == 2",
    "getFieldsToSerialize",
    "createPlugin(kRUNTIME) from the serialized fields",
    "attachToContext",
    "onShapeChange",
    "enqueue",
)
BAD_INPUTS = (  # each must be rejected with an error code and a logged message
    "createPlugin(kRUNTIME) without pages_per_slot",
    "configurePlugin with pages_per_slot missing",
    "enqueue with pages_per_slot missing",
    "createPlugin with a null field collection",
    "pages_per_slot of type FLOAT32",
    "pages_per_slot = 0",
    "getOutputDataTypes with int8 tensors",
    "getOutputDataTypes with a pool dtype unlike k_delta's",
    "getOutputShapes: pool of rank 4",
    "getOutputShapes: pool page size 64",
    "getOutputShapes: numPages not divisible by pages_per_slot",
    "supportsFormatCombination pos 7",
    "supportsFormatCombination null inOut",
    "configurePlugin: B > slots in the max profile",
    "configurePlugin: S > cap",
    "configurePlugin: R odd",
    "configurePlugin: R > D",
    "configurePlugin: numPages % pages_per_slot != 0",
    "configurePlugin: pool in a non-linear format",
    "configurePlugin: v_delta in bf16/fp16 mismatch",
    "enqueue: B > slots",
    "enqueue: S > cap",
    "enqueue: R odd",
    "enqueue: R > D",
    "enqueue: numPages % pages_per_slot != 0",
    "enqueue: rope batch not 1 or B",
    "enqueue: page size 64",
    "enqueue: pool of rank 6",
    "enqueue: k_delta int32",
    "enqueue: rope format kCHW32",
    "enqueue: null input descriptors",
    "enqueue: null pointer arrays",
    "enqueue: null k_delta pointer",
    "enqueue: null present_key_value pointer",
    "onShapeChange: B > slots",
    "initDFlashPluginWithRegistry twice in one namespace",
    "initDFlashPlugin without TensorRT loaded",
)
NPY_NAMES = ("k_delta", "v_delta", "past_key_value", "rope_cos_sin", "delta_start_positions",
             "delta_lengths")


def _cuda_toolkit_present() -> bool:
    return bool(shutil.which("nvcc") or os.environ.get("CUDACXX")
                or Path("/usr/local/cuda/bin/nvcc").exists())


def _trt_headers_present() -> bool:
    return bool(os.environ.get("TENSORRT_ROOT")
                or (REPO / ".deps/tensorrt/include/NvInferRuntime.h").exists())


def _built(path_function):
    try:
        return path_function()
    except FileNotFoundError as e:
        if _cuda_toolkit_present() and _trt_headers_present():
            pytest.fail(f"the TensorRT plugin should have been built (CUDA and TensorRT headers "
                        f"are present): {e}")
        pytest.skip(f"the TensorRT plugin was not built here (needs a CUDA toolkit and TensorRT "
                    f"headers): {e}")


@pytest.fixture(scope="module")
def plugin_library():
    return _built(trt.trt_plugin_library_path)


@pytest.fixture(scope="module")
def harness():
    return _built(trt.contract_harness_path)


def _run_harness(harness, *args, timeout=300):
    result = subprocess.run([harness, *args], capture_output=True, text=True, timeout=timeout)
    lines = result.stdout.splitlines()
    failures = [line for line in lines if line.startswith("FAIL")]
    assert result.returncode == 0 and not failures, (
        f"harness exited {result.returncode}; failures:\n" + "\n".join(failures)
        + f"\nstderr:\n{result.stderr[-3000:]}")
    passed = [line[len("PASS "):] for line in lines if line.startswith("PASS ")]
    summary = [line for line in lines if line.startswith("SUMMARY")]
    assert summary and re.search(r"failed=0\b", summary[0]), summary
    return passed


def test_library_path_is_inside_the_package(plugin_library):
    path = Path(plugin_library)
    assert path.is_absolute() and path.name == "libdflash_trt_plugin.so"
    assert path.parent.name == "lib" and path.parent.parent.name == "jax_dflash"
    import jax_dflash
    assert jax_dflash.trt_plugin_library_path() == plugin_library


def test_library_path_override_and_missing_file(monkeypatch, tmp_path):
    fake = tmp_path / "libcustom.so"
    fake.write_bytes(b"")
    monkeypatch.setenv("DFLASH_TRT_PLUGIN_LIBRARY", str(fake))
    assert trt.trt_plugin_library_path() == str(fake.resolve())
    monkeypatch.setenv("DFLASH_TRT_PLUGIN_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="DFLASH_TRT_PLUGIN_LIBRARY"):
        trt.trt_plugin_library_path()


def test_contract_harness_cpu(harness):
    passed = _run_harness(harness)
    for dtype in DTYPE_NAMES:
        tag = f"[contract_{dtype}]"
        steps = [p for p in passed if p.endswith(tag)]
        positions = []
        for call in CONTRACT_ORDER:
            hits = [i for i, step in enumerate(steps) if step.startswith(call)]
            assert hits, f"{dtype}: the harness did not check {call!r}; checked {steps}"
            positions.append(hits[0])
        assert positions == sorted(positions), f"{dtype}: calls out of TensorRT's order: {steps}"
    rejected = {p for p in passed if p.startswith("bad input rejected: ")}
    for case in ("bad", "bad_fp32"):
        for what in BAD_INPUTS:
            name = f"bad input rejected: {what}"
            if what.startswith("initDFlashPlugin"):
                assert name in rejected, name
            else:
                assert f"{name} [{case}]" in rejected, f"{name} [{case}] not checked"
    assert len(rejected) >= 2 * len(BAD_INPUTS)
    for check in ("an attached plugin reports errors to the context's IErrorRecorder",
                  "setPagesPerSlot() then configurePlugin succeeds",
                  "setPagesPerSlot() value survives clone() and getFieldsToSerialize()",
                  "the registered creator is found under its namespace (as the ONNX parser looks it up)"):
        assert any(p.startswith(check) for p in passed), check


def test_exports_the_loadlibrary_entry_points(plugin_library):
    library = ctypes.CDLL(plugin_library)
    library.getCreators.restype = ctypes.POINTER(ctypes.c_void_p)
    library.getCreators.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    count = ctypes.c_int32(-1)
    creators = library.getCreators(ctypes.byref(count))
    assert count.value == 1 and creators and creators[0]
    for name in ("setLoggerFinder", "initDFlashPlugin", "initDFlashPluginWithRegistry",
                 "setDFlashPluginLogger"):
        assert hasattr(library, name), name
    maps = Path("/proc/self/maps").read_text()
    if "libnvinfer" not in maps:  # no TensorRT in this process: the lookup must fail, not crash
        library.initDFlashPlugin.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        library.initDFlashPlugin.restype = ctypes.c_bool
        assert library.initDFlashPlugin(None, b"dflash_test") is False

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: the dynamic symbol table was not inspected")
    symbols = subprocess.run([nm, "-D", "--defined-only", plugin_library], capture_output=True,
                             text=True, check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    assert {"getCreators", "setLoggerFinder", "initDFlashPlugin"} <= exported
    # The plugin classes (dflash::trt) are exported on purpose; the kernel and cudart are not.
    leaked = sorted(s for s in exported if s.startswith(("cuda", "__cuda"))
                    or (s.startswith("_ZN6dflash") and not s.startswith("_ZN6dflash3trt")))
    assert not leaked, f"the static CUDA runtime / kernel symbols must stay private: {leaked[:10]}"


def test_depends_on_no_tensorrt_library(plugin_library):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed: the NEEDED entries were not inspected")
    dynamic = subprocess.run([readelf, "-d", plugin_library], capture_output=True, text=True,
                             check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed, dynamic
    assert not [n for n in needed if "nvinfer" in n or "nvonnxparser" in n], needed
    assert not [n for n in needed if n.startswith("libcudart")], f"cudart is linked statically: {needed}"


# ---- GPU: the plugin's pool equals the JAX op's ------------------------------------------------

def _gpu_or_skip():
    if not gpu_devices():
        pytest.skip("no GPU backend in this JAX: the plugin's GPU parity runs on the H200")


def _load_case(directory: Path):
    import ml_dtypes

    meta = json.loads((directory / "meta.json").read_text())
    arrays = {name: np.load(directory / f"{name}.npy") for name in (*NPY_NAMES, "present_key_value")}
    if meta["dtype"] == "bfloat16":
        for name in ("k_delta", "v_delta", "past_key_value", "present_key_value"):
            arrays[name] = arrays[name].view(ml_dtypes.bfloat16)
    return meta, arrays


def test_gpu_enqueue_matches_the_jax_op_bit_for_bit(harness, tmp_path):
    _gpu_or_skip()
    import jax

    import jax_dflash

    passed = _run_harness(harness, "--gpu", "--dump", str(tmp_path), timeout=600)
    cases = sorted(p for p in tmp_path.iterdir() if (p / "meta.json").exists())
    assert len(cases) >= 15, [c.name for c in cases]
    assert {json.loads((c / "meta.json").read_text())["dtype"] for c in cases} == set(DTYPE_NAMES)
    for check in ("no write outside the pool", "aliased and separate outputs are identical",
                  "a rejected enqueue (B > slots) on device buffers leaves the pool as it was"):
        assert sum(p.startswith(check) for p in passed) == len(cases), check

    gpu = gpu_devices()[0]
    for case in cases:
        meta, arrays = _load_case(case)
        inputs = [arrays[name] for name in NPY_NAMES]
        expected = jax_dflash.target_kv_cache_update(
            *[jax.device_put(x, gpu) for x in inputs], pages_per_slot=meta["pages_per_slot"])
        try:
            assert_bits_equal(arrays["present_key_value"], np.asarray(expected))
            assert_bits_equal(
                arrays["present_key_value"],
                reference.target_kv_cache_update(*inputs, pages_per_slot=meta["pages_per_slot"]))
        except AssertionError as e:
            raise AssertionError(f"case {case.name}: {e}") from None
        assert not np.array_equal(arrays["present_key_value"].view(np.uint8),
                                  arrays["past_key_value"].view(np.uint8)), case.name


# ---- TensorRT itself, where installed -----------------------------------------------------------

def test_build_engine_with_tensorrt(plugin_library):
    tensorrt = pytest.importorskip(
        "tensorrt", reason="the 'tensorrt' package (builder) cannot be imported here")
    _gpu_or_skip()
    from jax_dflash.interop.onnx import make_update_model

    model = make_update_model(num_kv_heads=2, head_dim=64, num_pages=8, pages_per_slot=2,
                              rotary_dim=64, rope_seq_len=256, dtype="float16")
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
