"""The raw entries write only into a pool that the caller owns and that may be written.

A jax.Array is immutable: however its memory reaches the raw entries as the pool (the array, its
DLPack capsule, an object whose ``__dlpack__`` returns that capsule, a NumPy array made from it),
the entry refuses it, naming ``past_key_value``, and the array keeps its value. So does a pool
whose export says read-only (DLPack 1.0's read-only flag, NumPy's writeable flag). A bare DLPack
capsule is refused as the pool whoever made it: it says neither who owns its memory nor (before
DLPack 1.0) whether it may be written. Inputs other than the pool are only read, and may be any
of these.
"""

from __future__ import annotations

import ctypes

import jax
import numpy as np
import pytest

from jax_dflash.testing import assert_bits_equal
from test_raw_entries import (
    ARRAY_LIBRARIES,
    _cpu,
    _cuda_module,
    _cuda_reason,
    _on_device,
    bits,
    build,
    expected_pool,
    raw_call,
)

CONTRACTS = ("slot", "paged")


class DLPackWrapper:
    """Not a jax.Array, but exports one: its ``__dlpack__`` hands over the wrapped array's."""

    def __init__(self, array, forward_keywords=False):
        self.array = array
        self.forward_keywords = forward_keywords

    def __dlpack__(self, **keywords):
        return self.array.__dlpack__(**(keywords if self.forward_keywords else {}))

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def _force_writeable(array):
    """Sets NumPy's WRITEABLE flag in the array's C struct, which ``array.flags.writeable = True``
    refuses: what np.from_dlpack gives for a producer whose DLPack 1.x export does not say it is
    read-only. Skips (saying why) where the struct has another layout."""
    base_offset, flags_offset = 16 + 4 * 8, 16 + 6 * 8  # PyArrayObject_fields' base and flags
    if ctypes.c_void_p.from_address(id(array) + base_offset).value != id(array.base):
        pytest.skip("this NumPy's PyArrayObject has another layout: cannot set WRITEABLE")
    flags = ctypes.c_int.from_address(id(array) + flags_offset)
    if bool(flags.value & 0x400) != array.flags.writeable:
        pytest.skip("this NumPy's PyArrayObject has another layout: cannot set WRITEABLE")
    flags.value |= 0x400  # NPY_ARRAY_WRITEABLE
    assert array.flags.writeable
    return array


def _cpu_jax_pool(problem):
    return jax.device_put(problem.past_key_value, jax.devices("cpu")[0])


def _refused(call, module, error, words):
    with pytest.raises(error) as err:
        call.run(module)
    for word in words:
        assert word in str(err.value), str(err.value)
    return err.value


# Each route by which a CPU jax.Array's memory can be handed over as the pool.
JAX_ROUTES = {
    "jax_array": (lambda a: a, ValueError, ("past_key_value", "jax.Array")),
    "its_dlpack_capsule": (lambda a: a.__dlpack__(), TypeError, ("past_key_value", "capsule")),
    "an_object_exporting_it": (
        lambda a: DLPackWrapper(a),
        ValueError,
        ("past_key_value", "jax.Array"),
    ),
    "np_from_dlpack": (lambda a: np.from_dlpack(a), ValueError, ("past_key_value",)),
    "np_from_dlpack_made_writeable": (
        lambda a: _force_writeable(np.from_dlpack(DLPackWrapper(a))),
        ValueError,
        ("past_key_value", "jax.Array"),
    ),
    "np_asarray": (lambda a: np.asarray(a), ValueError, ("past_key_value", "writable")),
}


@pytest.mark.parametrize("route", list(JAX_ROUTES))
@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_jax_memory_as_the_pool_is_refused_and_kept(contract, route):
    make, error, words = JAX_ROUTES[route]
    problem = build(contract, 51)
    jax_pool = _cpu_jax_pool(problem)
    call = raw_call(contract, problem, problem.past_key_value.copy())
    call.args[2] = make(jax_pool)
    _refused(call, _cpu(), error, words)
    assert_bits_equal(np.asarray(jax_pool), problem.past_key_value)


def test_cpu_refused_capsule_is_not_consumed():
    """The entry refuses a capsule before importing it: it is still the producer's to use."""
    problem = build("slot", 52)
    capsule = _cpu_jax_pool(problem).__dlpack__()
    call = raw_call("slot", problem, problem.past_key_value.copy())
    call.args[2] = capsule
    _refused(call, _cpu(), TypeError, ("past_key_value", "capsule"))
    assert '"dltensor' in repr(capsule), repr(capsule)  # not renamed "used_dltensor"


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_any_bare_capsule_is_refused_as_the_pool(contract):
    """A capsule of a writable torch tensor is refused too: the tensor itself is the pool."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    problem = build(contract, 53)
    tensor = torch.from_numpy(problem.past_key_value.copy())
    call = raw_call(contract, problem, problem.past_key_value.copy())
    call.args[2] = tensor.__dlpack__()
    _refused(call, _cpu(), TypeError, ("past_key_value", "capsule", "pass the array itself"))
    assert_bits_equal(tensor.numpy(), problem.past_key_value)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_read_only_dlpack_export_is_refused(contract):
    """An object whose DLPack 1.0 export carries the read-only flag (a read-only NumPy array's)."""
    problem = build(contract, 54)
    pool = problem.past_key_value.copy()
    pool.flags.writeable = False
    call = raw_call(contract, problem, problem.past_key_value.copy())
    call.args[2] = DLPackWrapper(pool, forward_keywords=True)
    _refused(call, _cpu(), ValueError, ("past_key_value", "read-only"))
    assert_bits_equal(pool, problem.past_key_value)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_pool_whose_export_raises_names_it(contract):
    class Broken:
        def __dlpack__(self, **keywords):
            raise BufferError("no export today")

        def __dlpack_device__(self):
            return (1, 0)

    problem = build(contract, 55)
    call = raw_call(contract, problem, problem.past_key_value.copy())
    call.args[2] = Broken()
    _refused(call, _cpu(), ValueError, ("past_key_value", "Broken", "BufferError: no export today"))


def _torch_routes(torch):
    return {
        "torch_tensor": lambda pool: (torch.from_numpy(pool), pool),
        "np_from_dlpack_of_torch": lambda pool: (np.from_dlpack(torch.from_numpy(pool)), pool),
        "an_object_exporting_torch": lambda pool: (
            DLPackWrapper(torch.from_numpy(pool), True),
            pool,
        ),
    }


@pytest.mark.parametrize(
    "route", ["torch_tensor", "np_from_dlpack_of_torch", "an_object_exporting_torch"]
)
@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_caller_owned_pools_are_updated(contract, route):
    """Writable memory the caller owns is a pool however it arrives (not a capsule)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    problem = build(contract, 56)
    given, host = _torch_routes(torch)[route](problem.past_key_value.copy())
    call = raw_call(contract, problem, problem.past_key_value.copy())
    call.args[2] = given
    call.run(_cpu())
    assert_bits_equal(host, expected_pool(contract, problem))


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_jax_inputs_other_than_the_pool_are_read(contract):
    """Only the pool is written: the other operands may be jax arrays, their capsules or
    read-only NumPy views of them."""
    problem = build(contract, 57, k_norm=True)
    pool = problem.past_key_value.copy()
    call = raw_call(contract, problem, pool)
    cpu = jax.devices("cpu")[0]
    forms = [
        lambda x: jax.device_put(x, cpu),
        lambda x: jax.device_put(x, cpu).__dlpack__(),
        lambda x: np.asarray(jax.device_put(x, cpu)),
    ]
    for i, x in enumerate(call.args):
        if i != 2 and isinstance(x, np.ndarray):
            call.args[i] = forms[i % len(forms)](x)
    call.run(_cpu())
    assert_bits_equal(pool, expected_pool(contract, problem))


# ---- CUDA: the same routes for a jax.Array on the GPU ------------------------------------------

CUDA_JAX_ROUTES = {
    "jax_array": (lambda a: a, ValueError, ("past_key_value", "jax.Array")),
    "its_dlpack_capsule": (lambda a: a.__dlpack__(), TypeError, ("past_key_value", "capsule")),
    "an_object_exporting_it": (
        lambda a: DLPackWrapper(a),
        ValueError,
        ("past_key_value", "jax.Array"),
    ),
    "an_object_exporting_it_versioned": (
        lambda a: DLPackWrapper(a, forward_keywords=True),
        ValueError,
        ("past_key_value", "jax.Array"),
    ),
}


@pytest.mark.parametrize("route", list(CUDA_JAX_ROUTES))
@pytest.mark.parametrize("contract", CONTRACTS)
def test_cuda_jax_memory_as_the_pool_is_refused_and_kept(contract, route):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    make, error, words = CUDA_JAX_ROUTES[route]
    lib = ARRAY_LIBRARIES["jax"]()
    problem = build(contract, 58)
    call = _on_device(lib, raw_call(contract, problem, bits(problem.past_key_value.copy())[0]))
    jax_pool = call.args[2]
    call.args[2] = make(jax_pool)
    _refused(call, _cuda_module(), error, words)
    lib.synchronize()
    assert_bits_equal(
        np.asarray(jax_pool).view(problem.past_key_value.dtype), problem.past_key_value
    )


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_cuda_bare_capsule_is_refused_as_the_pool(library, contract):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES[library]()
    problem = build(contract, 59)
    call = _on_device(lib, raw_call(contract, problem, bits(problem.past_key_value.copy())[0]))
    device_pool = call.args[2]
    call.args[2] = device_pool.__dlpack__()
    _refused(call, _cuda_module(), TypeError, ("past_key_value", "capsule"))
    lib.synchronize()
    assert_bits_equal(
        lib.to_host(device_pool).view(problem.past_key_value.dtype), problem.past_key_value
    )


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cuda_jax_inputs_with_an_object_exporting_torch_pool(contract):
    """A pool handed over by an object that exports a torch tensor is the caller's: updated."""
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES["torch"]()
    problem = build(contract, 60)
    call = _on_device(lib, raw_call(contract, problem, bits(problem.past_key_value.copy())[0]))
    device_pool = call.args[2]
    call.args[2] = DLPackWrapper(device_pool, forward_keywords=True)
    call.run(_cuda_module())
    lib.synchronize()
    assert_bits_equal(
        lib.to_host(device_pool).view(problem.past_key_value.dtype),
        expected_pool(contract, problem),
    )
