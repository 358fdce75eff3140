"""Running the TensorRT plugin's contract harness and reading what it writes (its JSON report,
its GPU dumps): shared by the plugin tests and the cross-runtime tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jax_dflash import _shapes

REPO = Path(__file__).resolve().parents[2]
HARNESS_OVERRIDE = "DFLASH_TRT_HARNESS"
HARNESS_NAME = "dflash_trt_contract_harness"
DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),  # int4: two elements per byte
}
DELTA_TYPED = ("k_delta", "v_delta", "k_norm_weight")  # stored in the delta dtype
POOL_TYPED = ("past_key_value", "present_key_value")  # stored in the pool dtype


def _cuda_toolkit_present() -> bool:
    return bool(
        shutil.which("nvcc")
        or os.environ.get("CUDACXX")
        or Path("/usr/local/cuda/bin/nvcc").exists()
    )


def _trt_headers_present() -> bool:
    return bool(
        os.environ.get("TENSORRT_ROOT")
        or (REPO / ".deps/tensorrt/include/NvInferRuntime.h").exists()
    )


def _built(path_function):
    try:
        return path_function()
    except FileNotFoundError as e:
        if _cuda_toolkit_present() and _trt_headers_present():
            pytest.fail(
                f"the TensorRT plugin should have been built (CUDA and TensorRT headers "
                f"are present): {e}"
            )
        pytest.skip(
            f"the TensorRT plugin was not built here (needs a CUDA toolkit and TensorRT "
            f"headers): {e}"
        )


def _harness_path() -> str:
    override = os.environ.get(HARNESS_OVERRIDE)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{HARNESS_OVERRIDE}={override!r}: expected a file, found none")
        return str(Path(override).resolve())
    # The harness is a test tool, built beside the plugin but not installed with the package:
    # the newest of the editable builds' (make build: build/<wheel tag>/trt_plugin/).
    root = REPO
    built = sorted(root.glob(f"build/*/trt_plugin/{HARNESS_NAME}"), key=lambda p: p.stat().st_mtime)
    if not built:
        raise FileNotFoundError(
            f"{HARNESS_NAME} was not built in {root / 'build'} (make build builds it with the "
            f"TensorRT plugin); {HARNESS_OVERRIDE} names another build's"
        )
    return str(built[-1])


def _run_harness(harness, *args, timeout=300, report=None):
    """Runs the harness with ``--report`` and returns the report (a dict); fails on any failed
    check, naming each with its detail."""
    report = (
        Path(report)
        if report is not None
        else Path(os.environ.get("TMPDIR", "/tmp"))
        / f"dflash_trt_report_{os.getpid()}_{id(args)}.json"
    )
    result = subprocess.run(
        [harness, "--report", str(report), *args], capture_output=True, text=True, timeout=timeout
    )
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError) as e:
        pytest.fail(
            f"harness exited {result.returncode} without a readable report ({e}); "
            f"stdout tail:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        )
    finally:
        report.unlink(missing_ok=True)
    failed = [c for c in data["checks"] if not c["passed"]]
    assert result.returncode == 0 and not failed and data["summary"]["failed"] == 0, (
        f"harness exited {result.returncode}; failed checks:\n"
        + "\n".join(f"  [{c['group']}] {c['name']}: {c['detail']}" for c in failed[:40])
        + f"\nstderr:\n{result.stderr[-3000:]}"
    )
    assert data["summary"]["passed"] == len(data["checks"]) > 0
    return data


def _load_dump(entry, directory=None):
    """The dumped inputs (by name) and the plugin's pool, in their real dtypes."""
    directory = Path(entry["dir"] if directory is None else directory)

    def load(name):
        array = np.load(directory / f"{name}.npy")
        if name in DELTA_TYPED:
            return array.view(DTYPES[entry["delta_dtype"]])
        if name in POOL_TYPED:
            return array.view(DTYPES[entry["pool_dtype"]])
        return array

    return {name: load(name) for name in entry["inputs"]}, load(entry["output"])


def _load_scale_output(entry, directory=None):
    """The scale pool the plugin produced (``present_scale_pool``), or None for a dump of a
    call without one."""
    name = entry.get("scale_output")
    if name is None:
        return None
    return np.load(Path(entry["dir"] if directory is None else directory) / f"{name}.npy")


def _load_case(directory: Path):
    """(meta, arrays by name) of one dump directory, as ``_load_dump`` reads it."""
    meta = json.loads((Path(directory) / "meta.json").read_text())
    arrays, pool = _load_dump(meta, directory)
    return meta, {**arrays, meta["output"]: pool}


def _op_arguments(entry, arrays):
    names = entry["inputs"]
    base = len(_shapes.FORMS[entry["contract"]]["operands"])
    args = [arrays[n] for n in names[:base]]
    kwargs = {"norm_eps": entry["norm_eps"], "v_norm": entry["v_norm"]}
    if entry["contract"] == "slot":
        kwargs["pages_per_slot"] = entry["pages_per_slot"]
    elif entry["contract"] == "paged":
        kwargs["ring"] = entry["ring"]
    if "k_scale" in arrays:
        # TensorRT's per-tensor scale is [1]; the JAX op's is [].
        for name in ("k_scale", "v_scale"):
            scale = arrays[name]
            kwargs[name] = scale.reshape(()) if entry["scale_heads"] == 1 else scale
    if "scale_pool" in arrays:
        kwargs["scale_pool"] = arrays["scale_pool"]
    if entry["k_norm"]:
        kwargs["k_norm_weight"] = arrays["k_norm_weight"]
    return args, kwargs


def jax_mode(entry):
    """The JAX mode a dump's op call needs: 64-bit types on for int64 slots (JAX refuses to narrow
    them, and the harness's slots past 2^31 must stay as they are)."""
    if entry.get("slot_dtype") == "int64":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()
