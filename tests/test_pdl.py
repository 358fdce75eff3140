"""Programmatic dependent launch (PDL) of the CUDA update kernel: the extension says whether its
launches use it, ``jax-dflash check`` reports it, and the pools written with it on and off
(``DFLASH_PDL``, read once per process, so one child process each) are the same bits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jax_dflash
from helpers.ops import cuda_extension
from jax_dflash import _ext
from jax_dflash.cli import check
from jax_dflash.testing import gpu_devices

NO_GPU = "no GPU backend in this JAX: the CUDA suite runs on the H200"
CHILD_TIMEOUT_S = 420


def _build_architectures() -> list[int] | None:
    """The CUDA architectures the installed extension was built for (build_info.json), or None
    where the file does not say."""
    for root in jax_dflash.__path__:
        path = Path(root) / "build_info.json"
        if path.is_file():
            reason = json.loads(path.read_text())["cuda_extension"].get("reason", "")
            found = re.search(r"architectures ([0-9;, a-z-]+)", reason)
            if found:
                return [int(a) for a in re.findall(r"\d+", found.group(1))]
    return None


def _expected_pdl(switch: str | None) -> bool | None:
    """Whether launches on GPU 0 should use PDL under DFLASH_PDL=switch; None where the build's
    architectures are unknown."""
    archs = _build_architectures()
    if archs is None:
        return None
    capability = float(gpu_devices()[0].compute_capability)
    return switch == "1" and capability >= 9.0 and min(archs) >= 90


def test_cuda_module_exposes_pdl_enabled():
    cuda = cuda_extension()
    # The stub lies beside the package's sources (an editable install keeps the module elsewhere).
    stub = Path(jax_dflash.__file__).parent / "_dflash_cuda.pyi"
    assert "def pdl_enabled() -> bool:" in stub.read_text()
    enabled = cuda.pdl_enabled()
    assert isinstance(enabled, bool)
    assert cuda.pdl_enabled() is enabled  # the switch and the device's answer are kept
    if not gpu_devices():
        assert enabled is False, "no CUDA device is visible, yet pdl_enabled() is True"
        return
    expected = _expected_pdl(os.environ.get("DFLASH_PDL"))
    if expected is not None:
        assert enabled is expected


def test_check_reports_programmatic_dependent_launch(capsys):
    """check's environment lines say whether the CUDA launches use PDL; without a GPU (or a
    CUDA extension) that the CUDA path is not present."""
    backends = check._report_environment()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "programmatic dependent launch" in line]
    assert len(lines) == 1, out
    line = lines[0]
    if "gpu" not in backends or not _ext.cuda_extension_available():
        assert "the CUDA path is not present" in line, line
    else:
        assert ("on (DFLASH_PDL=1)" in line) or ("off" in line and "DFLASH_PDL=1" in line), line


@pytest.mark.parametrize(
    ("enabled", "switch", "words"),
    [
        (True, "1", ("on (DFLASH_PDL=1)", "unset it to turn it off")),
        (False, None, ("off (the default; DFLASH_PDL=1 turns it on)",)),
        (False, "0", ("off (the default; DFLASH_PDL=1 turns it on)",)),
        (False, "yes", ("off (the default", "'yes' is not 0 or 1")),
        (False, "1", ("off although DFLASH_PDL=1", "below 9.0")),
    ],
)
def test_check_pdl_line_says_how_to_switch_it(monkeypatch, enabled, switch, words):
    """The line's wording for each answer of the extension and value of the switch."""

    class Extension:
        @staticmethod
        def pdl_enabled():
            return enabled

    monkeypatch.setattr(_ext, "extension", lambda name: Extension)
    if switch is None:
        monkeypatch.delenv("DFLASH_PDL", raising=False)
    else:
        monkeypatch.setenv("DFLASH_PDL", switch)
    line = check._pdl_report(True, ["cpu", "gpu"])
    for word in words:
        assert word in line, line
    assert check._pdl_report(False, ["cpu", "gpu"]).endswith("(no CUDA extension)")
    assert check._pdl_report(True, ["cpu"]).endswith("(no GPU)")


# A child: the op on GPU 0 over fixed inputs, each update's deltas made by an XLA kernel just
# before it on the stream (the producer a PDL launch overlaps), the pools saved to argv[1] and
# checked against the NumPy reference; prints whether the launches used PDL.
CHILD = r"""
import functools, json, sys
import numpy as np, jax, jax.numpy as jnp
import jax_dflash
from jax_dflash import _ext, reference
from jax_dflash.testing import assert_bits_equal, make_paged_problem, make_problem

gpu = jax.devices("gpu")[0]
pools = {}

# The slot contract, a decode loop: each step's update reads the pool the step before wrote.
rng = np.random.default_rng(11)
p = make_problem(rng, batch=3, delta_len=4, heads=4, head_dim=128, page_size=16,
                 pages_per_slot=4, hostile=False)
steps = 6
ks = np.stack([p.k_delta + i for i in range(steps)]).astype(p.k_delta.dtype)
vs = (ks - 1).astype(ks.dtype)
op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=p.pages_per_slot)

def body(pool, xs):
    k, v, step = xs
    starts = p.delta_start_positions + 4 * step
    return op(k * 2, v * 2, pool, p.rope_cos_sin, starts, p.delta_lengths), None

def loop(pool, ks, vs):
    return jax.lax.scan(body, pool, (ks, vs, jnp.arange(steps, dtype=jnp.int32)))[0]

out = jax.jit(loop)(*(jax.device_put(a, gpu) for a in (p.past_key_value, ks, vs)))
want = p.past_key_value
for i in range(steps):
    want = reference.target_kv_cache_update(ks[i] * 2, vs[i] * 2, want, p.rope_cos_sin,
                                            p.delta_start_positions + 4 * i, p.delta_lengths,
                                            pages_per_slot=p.pages_per_slot)
assert_bits_equal(out, want)
pools["slot"] = np.asarray(out)

# The paged contract, three layers in one launch, hostile tokens, an FP8 pool with the fused
# norms (the butterfly kernel).
rng = np.random.default_rng(12)
q = make_paged_problem(rng, tokens=24, batch=3, heads=4, head_dim=128, num_pages=16,
                       page_size=8, table_pages=4, dtype=np.float16,
                       pool_dtype=jnp.float8_e4m3fn, layers=3, k_norm=True, v_norm=True)
args = list(q.args())

def paged(k, v, *rest):
    return jax_dflash.target_kv_cache_update_paged(k * 2, v * 2, *rest, **q.kwargs())

out = jax.jit(paged)(*(jax.device_put(a, gpu) for a in args))
args[0], args[1] = args[0] * 2, args[1] * 2
assert_bits_equal(out, reference.target_kv_cache_update_paged(*args, **q.kwargs()))
pools["paged"] = np.asarray(out).view(np.uint8)

np.savez(sys.argv[1], **pools)
print(json.dumps({"pdl": _ext.extension("cuda").pdl_enabled()}))
"""


def _run_child(switch: str, out: Path) -> bool:
    env = {
        **os.environ,
        "DFLASH_PDL": switch,
        "PYTHONUNBUFFERED": "1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    env.pop("JAX_PLATFORMS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(out)],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, f"DFLASH_PDL={switch}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])["pdl"]


def test_pools_are_the_same_bits_with_and_without_pdl(tmp_path):
    cuda_extension()
    if not gpu_devices():
        pytest.skip(NO_GPU)
    used = {switch: _run_child(switch, tmp_path / f"pdl{switch}.npz") for switch in ("0", "1")}
    assert used["0"] is False, "DFLASH_PDL=0 left programmatic dependent launch on"
    expected = _expected_pdl("1")
    if expected is not None:
        assert used["1"] is expected, used
    off, on = np.load(tmp_path / "pdl0.npz"), np.load(tmp_path / "pdl1.npz")
    assert sorted(off.files) == sorted(on.files) == ["paged", "slot"]
    for name in off.files:
        assert off[name].tobytes() == on[name].tobytes(), f"{name}: the pools differ"
