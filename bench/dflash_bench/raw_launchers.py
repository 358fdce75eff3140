"""This project's kernel without JAX: the CUDA extension's raw launchers over torch tensors
(``chain`` launches captured in a CUDA graph) and, on the CPU, the NumPy entries. A pool with
dynamic scales goes through the by-name entries (``launch_form`` / ``update``), which take the
scale pool, updated in place like the pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_bench.check import check_scales, compare_sample, sample_array
from dflash_bench.contracts import CONTRACTS, delta_shape
from dflash_bench.dtypes import host_view
from dflash_bench.problem import Problem, host_pool, host_scale_pool
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


def by_form(entry, form: str):
    """``call(**operands)``: the extension's by-name entry (``launch_form`` or ``update``) for
    ``form``, its base operands picked by name in the form's order (the pool as ``pool``)."""
    from jax_dflash._shapes import BASE_NAMES

    names = ["pool" if n == "past_key_value" else n for n in BASE_NAMES[form]]

    def call(**kw) -> None:
        entry(form, [kw.pop(n) for n in names], **kw)

    return call


def cuda_launcher(problem: Problem, torch, inputs: TorchInputs, contract: str, scale_pool=None):
    """``launch(pool, j, **deltas)``: the contract's raw CUDA entry on input set j (DLPack
    arrays); ``deltas`` (``k_delta``, ``v_delta``) replace the set's own. With ``scale_pool``
    (a CUDA tensor; dynamic scales) the by-name entry, updating it in place."""
    from jax_dflash import _ext

    try:
        cuda = _ext.extension("cuda")
    except ImportError as e:
        raise Skip(str(e)) from e
    c, s = CONTRACTS[contract], problem.shape
    entry, statics = c.cuda_entry(cuda), c.statics(s)
    scales = dict(inputs.scales)
    if scale_pool is not None:
        entry, scales = by_form(cuda.launch_form, c.name), {"scale_pool": scale_pool}
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
            **scales,
            **statics,
            **dtypes,
            stream=torch.cuda.current_stream().cuda_stream,
        )

    return launch


def torch_scale_pool(torch, problem: Problem, contract: str):
    """The known scale pool (problem.host_scale_pool) as a CUDA tensor; None without dynamic
    scales."""
    host = host_scale_pool(problem, contract)
    return None if host is None else torch.from_numpy(host).cuda()


def prepare_raw_gpu(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """The raw launcher of ``spec.contract``: its sample against the reference, bit for bit; a
    contract other than the slot one also its whole pool, gathered in slot order, against the
    slot launcher's."""
    torch = import_torch()
    inputs = torch_inputs(torch, problem, ctx)
    contract = spec.contract
    scale_pool = torch_scale_pool(torch, problem, contract)
    launch = cuda_launcher(problem, torch, inputs, contract, scale_pool)
    pool = torch_pool(torch, problem, contract)
    launch(pool, 0)
    torch.cuda.synchronize()
    check = compare_sample(
        sample_array(pool, problem, contract), problem.expected(contract), exact_required=True
    )
    if scale_pool is not None:
        check = check_scales(check, scale_pool.cpu().numpy(), problem, contract)
    sets = len(inputs.ks)
    if contract != "slot":
        twin = ctx.get("warm_slot_pool")
        if twin is None:
            twin = torch_pool(torch, problem, "slot")
            twin_scales = torch_scale_pool(torch, problem, "slot")
            cuda_launcher(problem, torch, inputs, "slot", twin_scales)(twin, 0)
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
    scale_pool = host_scale_pool(problem, spec.contract)
    if scale_pool is not None:
        scales, named = {"scale_pool": scale_pool}, by_form(cpu.update, c.name)

        def entry(k_delta, v_delta, pool, **operands) -> None:
            named(k_delta=k_delta, v_delta=v_delta, pool=pool, **operands)

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
    if scale_pool is not None:
        check = check_scales(check, scale_pool, problem, spec.contract)
    return host_loop(lambda i: update(i % len(sets)), settings.chain, {"check": check})
