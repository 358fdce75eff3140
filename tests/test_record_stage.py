"""The record stage of the CUDA FFI targets (XLA's FFI record API, jaxlib 0.11 and later): the
build says whether it has one (build_info.json, ``ffi_record_stage()``), registers it with jax when
it does, ``jax-dflash check`` says which JAX path is in use, and on a GPU the record stage writes
the same bits as the CPU op (bench/record_pdl_probe.py --bits, in a child with XLA's command
buffers enabled for custom calls)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jax_dflash
from helpers.ops import cuda_extension
from jax_dflash import _ext
from jax_dflash.cli import check
from jax_dflash.testing import gpu_devices

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "bench" / "record_pdl_probe.py"
NO_GPU = "no GPU backend in this JAX: the record stage runs on the H200"
CHILD_TIMEOUT_S = 300


def _build_info() -> dict:
    for root in jax_dflash.__path__:
        path = Path(root) / "build_info.json"
        if path.is_file():
            return json.loads(path.read_text())
    pytest.skip("no jax_dflash/build_info.json in this install (built without the build summary)")


def test_build_info_reports_the_record_stage():
    """build_info.json has an ffi_record_stage entry, built or not with a reason, and it is what
    the extension says."""
    entry = _build_info()["ffi_record_stage"]
    assert isinstance(entry["built"], bool) and entry["reason"], entry
    if not entry["built"]:
        reasons = ("record_api.h", "DFLASH_ENABLE_FFI_RECORD=OFF", "9.0", "needs the CUDA build")
        assert any(r in entry["reason"] for r in reasons), entry
    cuda = cuda_extension()
    assert cuda.ffi_record_stage() is entry["built"], entry


def test_no_record_stage_against_a_jaxlib_without_the_record_api():
    """Built against this jax's own FFI headers, which lack record_api.h (jaxlib before 0.11),
    the extension has no record stage."""
    import jax

    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "record_api.h"
    if header.is_file():
        pytest.skip(f"this jaxlib ({jax.__version__}) has the record API: {header}")
    cuda = cuda_extension()
    assert cuda.ffi_record_stage() is False
    assert _ext.record_stage_registered() is False


def test_registrations_give_the_record_stage_only_where_built():
    cuda = cuda_extension()
    execute_only = cuda.registrations(record=False)
    staged = cuda.registrations()
    assert set(execute_only) == set(staged) and execute_only
    for name, handler in execute_only.items():
        assert not isinstance(handler, dict), name
    for name, handler in staged.items():
        if cuda.ffi_record_stage():
            assert isinstance(handler, dict) and set(handler) == {"execute", "record"}, name
        else:
            assert not isinstance(handler, dict), name


def test_record_stage_counts_start_at_zero_without_a_gpu():
    cuda = cuda_extension()
    counts = cuda.record_stage_counts()
    assert set(counts) == {"created", "updated", "captured"}
    assert all(isinstance(v, int) and v >= 0 for v in counts.values()), counts
    if not gpu_devices():
        assert counts == {"created": 0, "updated": 0, "captured": 0}, counts


def test_stub_declares_the_record_functions():
    stub = (Path(jax_dflash.__file__).parent / "_dflash_cuda.pyi").read_text()
    for declaration in (
        "def ffi_record_stage() -> bool:",
        "def record_pdl_enabled() -> bool:",
        "def record_stage_counts() -> dict[str, int]:",
        "def record_stage_last_capture() -> str:",
        "def registrations(record: bool = True) -> dict[str, Any]:",
    ):
        assert declaration in stub, declaration


@pytest.mark.parametrize(("switch", "record_pdl"), [(None, True), ("1", True), ("0", False)])
def test_record_pdl_follows_dflash_pdl_on_by_default(switch, record_pdl):
    """DFLASH_PDL, read once per process (so a child each): the record stage asks for PDL unless
    it is "0"; launches on a stream only where it is "1" (and the device has 9.0)."""
    cuda_extension()
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_PDL"}
    if switch is not None:
        env["DFLASH_PDL"] = switch
    code = (
        "import json, jax_dflash._dflash_cuda as c; "
        "print(json.dumps([c.record_pdl_enabled(), c.pdl_enabled()]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    recorded, streamed = json.loads(done.stdout.strip().splitlines()[-1])
    assert recorded is record_pdl
    if switch != "1":
        assert streamed is False


def test_check_prints_the_jax_path(capsys):
    backends = check._report_environment()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("JAX path on CUDA: ")]
    assert len(lines) == 1, out
    line = lines[0]
    if not _ext.cuda_extension_available():
        assert "no CUDA extension" in line, line
    elif not _ext.extension("cuda").ffi_record_stage():
        assert "execute stage" in line and "no record stage" in line, line
    elif "gpu" in backends and _ext.record_stage_registered():
        assert "record stage with" in line, line


@pytest.mark.parametrize(
    ("built", "record_env", "pdl", "backends", "words"),
    [
        (False, None, True, ["cpu", "gpu"], ("execute stage", "no record stage", "before 0.11")),
        (True, "0", True, ["cpu", "gpu"], ("execute stage", "DFLASH_RECORD_STAGE='0'")),
        (True, None, True, ["cpu", "gpu"], ("execute stage", "DFLASH_RECORD_STAGE=1 only")),
        (True, "1", True, ["cpu", "gpu"], ("record stage with PDL", "DFLASH_PDL=0 turns PDL off")),
        (True, "1", False, ["cpu", "gpu"], ("record stage without PDL (DFLASH_PDL=0",)),
        (True, "1", True, ["cpu"], ("record stage built", "no GPU")),
    ],
)
def test_check_jax_path_wording(monkeypatch, built, record_env, pdl, backends, words):
    class Extension:
        @staticmethod
        def ffi_record_stage():
            return built

        @staticmethod
        def record_pdl_enabled():
            return pdl

    monkeypatch.setattr(_ext, "extension", lambda name: Extension)
    if record_env is None:
        monkeypatch.delenv(_ext.RECORD_STAGE_SWITCH, raising=False)
    else:
        monkeypatch.setenv(_ext.RECORD_STAGE_SWITCH, record_env)
    line = check._jax_path_report(True, backends)
    for word in words:
        assert word in line, line
    assert check._jax_path_report(False, backends).endswith("(no CUDA extension)")


def test_record_stage_writes_the_cpu_ops_bits():
    """bench/record_pdl_probe.py --bits in a child (XLA's command buffers for custom calls, pool
    donated): every case bit for bit against the CPU op; with a record stage registered, the
    covered cases were recorded as launches and the dynamic-scale one captured; without, nothing
    was recorded."""
    cuda = cuda_extension()
    if not gpu_devices():
        pytest.skip(NO_GPU)
    env = {
        **os.environ,
        "XLA_FLAGS": (
            "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
            "--xla_gpu_graph_min_graph_size=1"
        ),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("JAX_PLATFORMS", None)
    env.pop("DFLASH_PDL", None)
    env["DFLASH_RECORD_STAGE"] = "1"
    done = subprocess.run(
        [sys.executable, str(PROBE), "--bits"],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    for name, case in report["cases"].items():
        assert case["bit_exact"], (name, case)
    recorded = report["path"]["record_stage_registered"]
    assert recorded is bool(cuda.ffi_record_stage())
    if recorded and all(
        c["counts"] == {"created": 0, "updated": 0, "captured": 0} for c in report["cases"].values()
    ):
        pytest.skip(
            f"blocked: XLA (jaxlib {jax.lib.__version__}) never called the registered record "
            "stage, so no launch of it ran; the bits above are the execute stage's"
        )
    for name, case in report["cases"].items():
        counts = case["counts"]
        if not recorded:
            assert counts == {"created": 0, "updated": 0, "captured": 0}, (name, counts)
        elif "captured" in name:
            assert counts["captured"] >= 1 and counts["created"] == 0, (name, counts)
        else:
            assert counts["created"] >= 1 and counts["captured"] == 0, (name, counts)
