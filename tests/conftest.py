"""Shared fixtures: backends; the problem builders and bitwise checks are jax_dflash.testing's."""

from __future__ import annotations

import jax
import pytest

from _install_check import (  # noqa: F401  (first: tests the installed jax_dflash, if built)
    pytest_configure,
    pytest_report_header,
)
from jax_dflash.testing import (  # noqa: F401  (re-exported for the test modules)
    DELTA_DTYPES,
    FP8_DTYPES,
    POOL_DTYPES,
    PagedProblem,
    Problem,
    assert_bits_equal,
    compare_bits,
    gpu_devices,
    make_paged_problem,
    make_problem,
)

DTYPES = DELTA_DTYPES


def _backend_param(name):
    if name == "gpu":
        reason = "no GPU backend in this JAX: the CUDA suite runs on the H200"
        return pytest.param(name, marks=pytest.mark.skipif(not gpu_devices(), reason=reason))
    return name


BACKENDS = [_backend_param("cpu"), _backend_param("gpu")]


@pytest.fixture(params=BACKENDS)
def backend(request):  # a plain string: safe to share across hypothesis examples
    return request.param


def device_of(backend):
    return jax.devices(backend)[0]
