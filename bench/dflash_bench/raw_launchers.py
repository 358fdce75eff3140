"""This project's kernel without JAX: the CUDA extension's raw launchers over torch tensors
(``chain`` launches captured in a CUDA graph) and, on the CPU, the NumPy entries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_bench.check import compare_sample, sample_array
from dflash_bench.contracts import CONTRACTS, delta_shape
from dflash_bench.dtypes import host_view
from dflash_bench.problem import Problem, host_pool
from dflash_bench.timing import Prepared, Settings, Skip, cuda_graph, host_loop, warm_up_calls
from dflash_bench.torch_side import (
    TorchInputs,
    import_torch,
    mismatches_in_slot_order,
    torch_inputs,
    torch_pool,
)

if TYPE_CHECKING:
    from dflash_bench.contenders import Contender


def no_scale_pool(problem: Problem) -> None:
    """Raises Skip for a pool with dynamic scales: the raw entries take no scale pool."""
    if problem.shape.dynamic_scales:
        raise Skip(
            f"{problem.shape.pool_format} pool: the raw entries take no scale pool "
            "(per-token-head scales are JAX-only)"
        )


def cuda_launcher(problem: Problem, torch, inputs: TorchInputs, contract: str):
    """``launch(pool, j, **deltas)``: the contract's raw CUDA entry on input set j (DLPack
    arrays); ``deltas`` (``k_delta``, ``v_delta``) replace the set's own."""
    from jax_dflash import _ext

    try:
        cuda = _ext.extension("cuda")
    except ImportError as e:
        raise Skip(str(e)) from e
    c, s = CONTRACTS[contract], problem.shape
    entry, statics = c.cuda_entry(cuda), c.statics(s)
    per_set, shared = inputs.operands(contract)
    spec = s.pool_spec
    # A format torch has no dtype for crosses as raw bits, with pool_dtype naming it.
    name = spec.storage_name
    dtypes = {"pool_dtype": name if spec.torch_name != name else ""}

    def launch(pool, j: int, **deltas) -> None:
        entry(
            pool=pool,
            **{**per_set[j], **deltas},
            **shared,
            **inputs.scales,
            **statics,
            **dtypes,
            stream=torch.cuda.current_stream().cuda_stream,
        )

    return launch


def prepare_raw_gpu(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """The raw launcher of ``spec.contract``: its sample against the reference, bit for bit; a
    contract other than the slot one also its whole pool, gathered in slot order, against the
    slot launcher's."""
    no_scale_pool(problem)
    torch = import_torch()
    inputs = torch_inputs(torch, problem, ctx)
    contract = spec.contract
    launch = cuda_launcher(problem, torch, inputs, contract)
    pool = torch_pool(torch, problem, contract)
    launch(pool, 0)
    torch.cuda.synchronize()
    check = compare_sample(
        sample_array(pool, problem, contract), problem.expected(contract), exact_required=True
    )
    sets = len(inputs.ks)
    if contract != "slot":
        twin = ctx.get("warm_slot_pool")
        if twin is None:
            twin = torch_pool(torch, problem, "slot")
            cuda_launcher(problem, torch, inputs, "slot")(twin, 0)
        else:
            # The slot launcher's pool after cuda_graph's warm-up calls: this pool gets the same
            # calls (each an overwrite, so the warm-up repeating them changes nothing).
            for i in warm_up_calls(settings.chain):
                launch(pool, i % sets)
            torch.cuda.synchronize()
        mismatches = mismatches_in_slot_order(torch, pool, twin, problem, contract)
        check["full_pool_bits_differing_vs_slot_op"] = mismatches
        check["ok"] = check["ok"] and mismatches == 0
        del twin
    info = {"check": check}
    prepared = cuda_graph(torch, lambda i: launch(pool, i % sets), settings.chain, info)
    if contract == "slot":
        # Until the timing starts, this pool is the slot launcher's after the warm-up: the other
        # contracts compare theirs with it rather than with a second slot pool, for which a
        # 5-layer shape had no room beside every contender's pool.
        torch.cuda.synchronize()
        ctx["warm_slot_pool"] = pool
    return prepared


def prepare_raw_cpu(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """The NumPy entry of ``spec.contract`` (the CPU kernel), checked bit for bit, then timed
    call by call from the host."""
    from jax_dflash import _ext

    no_scale_pool(problem)
    cpu = _ext.extension("cpu")
    c, s = CONTRACTS[spec.contract], problem.shape
    entry, statics, layout = c.cpu_call(cpu), c.statics(s), delta_shape(c, s)
    pool = host_pool(problem, spec.contract)
    raw_pool = host_view(pool)
    sets = [
        (host_view(k).reshape(layout), host_view(v).reshape(layout), c.per_set(problem, j))
        for j, (k, v) in enumerate(zip(problem.k_sets, problem.v_sets))
    ]
    shared, scales = c.shared(problem), problem.scales()
    dtypes = {"delta_dtype": s.dtype, "pool_dtype": s.pool_dtype_name}

    def update(j: int) -> None:
        k, v, operands = sets[j]
        entry(k, v, raw_pool, **operands, **shared, **scales, **statics, **dtypes)

    update(0)
    check = compare_sample(
        sample_array(pool, problem, spec.contract),
        problem.expected(spec.contract),
        exact_required=True,
    )
    return host_loop(lambda i: update(i % len(sets)), settings.chain, {"check": check})
