"""The compiled modules can be imported before jax, and share nothing with the libraries loaded
after them.

Each extension module is imported first in a fresh process, then jax (jaxlib and, on a GPU
machine, its CUDA plugin) is imported, its devices listed and the op run on a small problem: the
process must exit 0 (a crash while jaxlib loads was the defect). Each module must export its
``PyInit_`` function and nothing else (no kernel, nanobind or C++ library symbol another library
could bind to, no STB_GNU_UNIQUE symbol, which the loader shares across libraries even under
RTLD_LOCAL), link the CUDA runtime statically and carry no RPATH.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jax_dflash.testing import gpu_devices

EXTENSIONS = ("_dflash_cpu", "_dflash_cuda")
# What a module may link dynamically: the C and C++ runtimes (the CUDA runtime is static).
SYSTEM_LIBRARIES = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libgcc_s.so.1",
    "libstdc++.so.6",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


def _module_file(name: str) -> str | None:
    spec = importlib.util.find_spec(f"jax_dflash.{name}")
    return None if spec is None else spec.origin


def _require_built(name: str) -> str:
    path = _module_file(name)
    if path is None:
        pytest.skip(
            f"jax_dflash.{name} was not built (the CUDA module needs a CUDA toolkit at build time)"
        )
    return path


# ---- the exports, read from the ELF file -------------------------------------------------------

STB_NAMES = {0: "LOCAL", 1: "GLOBAL", 2: "WEAK", 10: "UNIQUE"}
SHT_DYNSYM, SHT_DYNAMIC = 11, 6
DT_NEEDED, DT_RPATH, DT_RUNPATH = 1, 15, 29


def _elf_sections(data: bytes):
    if data[:4] != b"\x7fELF":
        pytest.skip("not an ELF shared object: the export checks are for Linux")
    if data[4] != 2 or data[5] != 1:
        pytest.skip("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, align, entsize
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


def _string(data: bytes, table, offset: int) -> str:
    start = table[4] + offset
    return data[start : data.index(b"\0", start)].decode()


def dynamic_symbols(path: str) -> dict[str, str]:
    """The symbols ``path`` defines in its dynamic symbol table: name -> binding."""
    data = Path(path).read_bytes()
    sections = _elf_sections(data)
    out = {}
    for section in sections:
        if section[1] != SHT_DYNSYM:
            continue
        strings = sections[section[6]]
        for offset in range(section[4], section[4] + section[5], 24):
            name, info, _, shndx = struct.unpack_from("<IBBH", data, offset)
            binding = info >> 4
            if shndx != 0 and binding != 0:  # defined here, and visible
                out[_string(data, strings, name)] = STB_NAMES.get(binding, str(binding))
    return out


def dynamic_entries(path: str) -> list[tuple[int, str]]:
    """``(tag, string)`` of the NEEDED, RPATH and RUNPATH entries of ``path``."""
    data = Path(path).read_bytes()
    sections = _elf_sections(data)
    out = []
    for section in sections:
        if section[1] != SHT_DYNAMIC:
            continue
        strings = sections[section[6]]
        for offset in range(section[4], section[4] + section[5], 16):
            tag, value = struct.unpack_from("<qQ", data, offset)
            if tag in (DT_NEEDED, DT_RPATH, DT_RUNPATH):
                out.append((tag, _string(data, strings, value)))
    return out


@pytest.mark.parametrize("name", EXTENSIONS)
def test_module_exports_only_its_init_function(name):
    path = _require_built(name)
    exported = dynamic_symbols(path)
    assert exported == {f"PyInit_{name}": "GLOBAL"}, f"{path} exports more: {sorted(exported)[:40]}"


@pytest.mark.parametrize("name", EXTENSIONS)
def test_module_links_only_the_system_runtimes(name):
    path = _require_built(name)
    entries = dynamic_entries(path)
    needed = {value for tag, value in entries if tag == DT_NEEDED}
    assert needed <= SYSTEM_LIBRARIES, f"{path} needs {sorted(needed - SYSTEM_LIBRARIES)}"
    assert not [value for tag, value in entries if tag != DT_NEEDED], (
        f"{path}: RPATH/RUNPATH {entries}"
    )


# ---- import order, in fresh processes ----------------------------------------------------------

CHILD = r"""
import importlib, sys

module_name, platform, order = sys.argv[1:4]
if order == "extension_first":
    module = importlib.import_module(module_name)
import jax
print("devices", jax.devices(), flush=True)
if order == "jax_first":
    module = importlib.import_module(module_name)
print("module", module.__file__, flush=True)

import numpy as np

import jax_dflash
from jax_dflash import reference
from jax_dflash.testing import make_problem

problem = make_problem(np.random.default_rng(0))
device = jax.devices(platform)[0]
with jax.default_device(device):
    out = jax_dflash.target_kv_cache_update(
        *[jax.device_put(a, device) for a in problem.args()], **problem.kwargs()
    )
expected = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())
assert out.devices() == {device}, out.devices()
assert np.array_equal(np.asarray(out).view(np.uint8), expected.view(np.uint8)), "not the reference"
print("ok", flush=True)
"""


def _cases():
    # (module, platform the op runs on): the CPU module with the CPU op; the CUDA module with the
    # GPU op where there is a GPU, and with the CPU op everywhere it is built (its loading, static
    # initialisation and exports are what an import order can break).
    return [
        ("_dflash_cpu", "cpu"),
        ("_dflash_cuda", "cpu"),
        ("_dflash_cuda", "gpu"),
    ]


@pytest.mark.parametrize("order", ["extension_first", "jax_first"])
@pytest.mark.parametrize("name, platform", _cases(), ids=lambda v: v)
def test_import_order(name, platform, order, tmp_path):
    path = _require_built(name)
    if platform == "gpu" and not gpu_devices():
        pytest.skip("no GPU backend in this JAX: the CUDA module's GPU op runs on the H200")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # Two processes share the GPU here: the child allocates what it uses, no more.
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CHILD, f"jax_dflash.{name}", platform, order],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,  # not the checkout: its source folder holds no compiled module
    )
    report = (
        f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    )
    assert done.returncode == 0, report
    assert f"module {path}" in done.stdout, report  # the module under test, not another build
    assert done.stdout.rstrip().endswith("ok"), report
