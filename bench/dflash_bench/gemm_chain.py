"""The update where an engine runs it: right after the draft's k/v projection GEMM that produces
its deltas. Each step of a chain computes ``hidden [T, 4*H*D] @ W [4*H*D, 2*H*D]`` in the delta
dtype, splits the product into contiguous ``k_delta`` and ``v_delta`` and (with the update)
writes them into the pool. A chain without the update (the GEMM and its split alone) is timed
beside it; the update's added time per step is the difference (``added_us``).

The hidden size 4 * H * D is 4096 at the GPU shapes (H=8, D=128): the hidden size of z-lab's
Qwen3-8B DFlash draft. The product is the problem's own deltas bit for bit (``weight`` is the
identity on the first 2*H*D rows and zero below, ``hidden`` holds the deltas in its first
2*H*D columns and random values after them), so the chained update is checked against the
reference of its contract like every other contender; a dense GEMM does the same work whatever
its values are.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import numpy as np

from dflash_bench.check import compare_sample, sample_array
from dflash_bench.contracts import CONTRACTS, delta_shape
from dflash_bench.problem import Problem, rotated_sets
from dflash_bench.timing import Prepared, Settings, Skip, cuda_graph, host_timed

if TYPE_CHECKING:
    from dflash_bench.contenders import Contender

HIDDEN_PER_HEAD_DIM = 4  # hidden = 4 * H * D


def hidden_size(problem: Problem) -> int:
    s = problem.shape
    return HIDDEN_PER_HEAD_DIM * s.num_kv_heads * s.head_dim


def gemm_sets(problem: Problem, backend: str) -> int:
    """How many (hidden, weight) sets the chain rotates over: together twice the last-level
    cache, so that the weights stream from memory as an engine's do (one weight set is 16 MB at
    the GPU shapes, in a 60 MB L2); at most the problem's input sets, whose deltas they hold."""
    s = problem.shape
    hidden, width = hidden_size(problem), 2 * s.num_kv_heads * s.head_dim
    per_set = (s.tokens * hidden + hidden * width + s.tokens * width) * s.np_dtype.itemsize
    return min(problem.num_sets, rotated_sets(per_set, backend))


def host_gemm_operands(problem: Problem, num_sets: int) -> tuple[list, np.ndarray]:
    """(hidden of each set ``[T, hidden]``, the weight ``[hidden, 2*H*D]``): ``hidden[j] @
    weight`` is set j's deltas, ``[k | v]`` with each ``[T, H*D]`` in token order."""
    s = problem.shape
    heads = s.num_kv_heads * s.head_dim
    rng = np.random.default_rng(1)
    hidden = []
    for j in range(num_sets):
        k, v = (x.reshape(s.tokens, heads) for x in (problem.k_sets[j], problem.v_sets[j]))
        rest = rng.standard_normal((s.tokens, hidden_size(problem) - 2 * heads), np.float32)
        hidden.append(np.concatenate([k, v, rest.astype(s.np_dtype)], axis=1))
    weight = np.zeros((hidden_size(problem), 2 * heads), s.np_dtype)
    weight[np.arange(2 * heads), np.arange(2 * heads)] = 1
    return hidden, weight


def one_layer(problem: Problem) -> Problem:
    """The problem, when it is one layer's without a scale pool: the chain is one layer's
    projection and update of the pool alone."""
    if problem.shape.num_layers:
        raise Skip("one layer's GEMM: not timed at stacked layers")
    if problem.shape.dynamic_scales:
        raise Skip("dynamic scales: the GEMM chain carries no scale pool")
    return problem


def _gemm_info(problem: Problem, num_sets: int, check: dict, with_update: bool) -> dict:
    s = problem.shape
    return {
        "check": check,
        "gemm": f"[{s.tokens}, {hidden_size(problem)}] @ [{hidden_size(problem)}, "
        f"{2 * s.num_kv_heads * s.head_dim}] {s.dtype}",
        "gemm_sets": num_sets,
        "with_update": with_update,
    }


def _checked(problem: Problem, contract: str, pool) -> dict:
    return compare_sample(
        sample_array(pool, problem, contract), problem.expected(contract), exact_required=True
    )


def _unchecked() -> dict:
    return {"ok": True, "criterion": "none (the GEMM and its split alone)"}


def jax_gemm_chain(update, problem: Problem, num_sets: int, iterations: int):
    """``step((pool, hidden, deltas), weights, sets, shared) -> (pool, hidden, deltas)``, jitted
    with the carried state donated: ``iterations`` rounds of a ``lax.fori_loop``, each one
    step per set j: ``hidden[j] @ weights[j]``, split into ``deltas[j] = (k, v)``, then
    ``update(pool, (k, v, sets[j][2]), shared)`` (``update`` None: the GEMM and split alone,
    with no pool: ``pool`` None).

    The loop keeps every step's work: ``deltas`` is carried, so each split is written; and
    each step writes its key's first element back into ``hidden[j]`` (the value it already
    holds, which XLA cannot know), so no GEMM is invariant across rounds and none is hoisted
    out of the loop. Unrolled in Python the chain would keep only the last split of each set.
    """
    import jax

    s = problem.shape
    heads = s.num_kv_heads * s.head_dim

    def step(carried, weights, sets, shared):
        def one_round(_, carried):
            pool, hidden, deltas = carried
            hidden, deltas = list(hidden), list(deltas)
            for j in range(num_sets):
                kv = hidden[j] @ weights[j]
                k, v = kv[:, :heads], kv[:, heads:]
                hidden[j] = hidden[j].at[0, 0].set(k[0, 0])
                deltas[j] = (k, v)
                if update is not None:
                    pool = update(pool, (k, v, sets[j][2]), shared)
            return pool, tuple(hidden), tuple(deltas)

        return jax.lax.fori_loop(0, iterations, one_round, carried)

    return jax.jit(step, donate_argnums=0)


def rolled(step, carried, args, iterations: int):
    """``step`` compiled for these arguments, refused (RuntimeError) when XLA unrolled its loop
    of more than one round: unrolled, every round's carried split but the last would be dead
    and dropped from the chain without the update, and the difference would time it."""
    compiled = step.lower(carried, *args).compile()
    if iterations > 1 and not re.search(r"\bwhile\(", compiled.as_text()):
        raise RuntimeError(
            f"XLA unrolled the GEMM chain's loop of {iterations} rounds: its splits would not all "
            "be timed (a larger --iters gives more rounds)"
        )
    return compiled


def prepare_gemm_jax(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """The GEMM chain on the JAX path (``spec.contract``'s op after each GEMM, or the GEMM and
    its split alone when ``spec.gemm_alone``): one step checked against the reference, then
    ``ceil(chain / sets)`` rounds of ``sets`` steps per call."""
    import jax.numpy as jnp

    from dflash_bench.jax_contenders import dflash_update, jax_inputs, jax_pool

    s = one_layer(problem).shape
    inputs = jax_inputs(problem, settings, ctx)
    num_sets = gemm_sets(problem, settings.backend)
    hidden, weight = host_gemm_operands(problem, num_sets)
    weights = tuple(inputs.put(weight) for _ in range(num_sets))  # one buffer per set
    sets, shared = inputs.operands(spec.contract)
    sets = sets[:num_sets]
    update = None if spec.gemm_alone else dflash_update(spec.contract, s)
    iterations = math.ceil(settings.chain / num_sets)

    def state(n: int) -> tuple:
        """The carried state of a chain over the first n sets: the known pool (none without
        the update), their hidden states, a (k, v) buffer pair each."""
        heads = s.num_kv_heads * s.head_dim

        def zeros():
            return jnp.zeros((s.tokens, heads), s.np_dtype, device=inputs.device)

        return (
            None if update is None else jax_pool(problem, inputs.device, spec.contract),
            tuple(inputs.put(h) for h in hidden[:n]),
            tuple((zeros(), zeros()) for _ in range(n)),
        )

    check = _unchecked()
    if update is not None:  # one step from the known pool, against the reference
        pool = jax_gemm_chain(update, problem, 1, 1)(state(1), weights[:1], sets[:1], shared)[0]
        check = _checked(problem, spec.contract, pool)
        del pool
    carried, args = state(num_sets), (weights, sets, shared)
    step = rolled(jax_gemm_chain(update, problem, num_sets, iterations), carried, args, iterations)
    steps = iterations * num_sets
    prepared = host_timed(step, {"carried": carried}, args, steps, settings.backend)
    prepared.info.update(_gemm_info(problem, num_sets, check, update is not None))
    return prepared


def torch_gemm_chain(torch, problem: Problem, contract: str, num_sets: int, launch=None):
    """``enqueue(i)``: step i of the raw GEMM chain on the current stream, over set
    ``i % num_sets``: ``torch.mm`` into the set's product, one copy that splits it into
    contiguous k and v, then ``launch(j, k_delta=..., v_delta=...)`` with them in the contract's
    layout (``launch`` None: the GEMM and split alone)."""
    from dflash_bench.torch_side import to_torch

    s = problem.shape
    host_hidden, weight = host_gemm_operands(problem, num_sets)
    hidden = [to_torch(torch, h) for h in host_hidden]
    weights = [to_torch(torch, weight) for _ in range(num_sets)]  # one buffer per set
    heads, like = (
        s.num_kv_heads * s.head_dim,
        {"dtype": hidden[0].dtype, "device": hidden[0].device},
    )
    products = [torch.empty(s.tokens, 2 * heads, **like) for _ in hidden]
    split = [torch.empty(2, s.tokens, heads, **like) for _ in hidden]
    layout = delta_shape(CONTRACTS[contract], s)

    def enqueue(i: int) -> None:
        j = i % num_sets
        torch.mm(hidden[j], weights[j], out=products[j])
        split[j].copy_(products[j].view(s.tokens, 2, heads).transpose(0, 1))
        if launch is not None:
            launch(j, k_delta=split[j][0].view(layout), v_delta=split[j][1].view(layout))

    return enqueue


def prepare_gemm_raw(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """The GEMM chain on the raw path (``torch_gemm_chain``, on the stream the raw launcher of
    ``spec.contract`` is enqueued on, or the GEMM and split alone when ``spec.gemm_alone``):
    one step checked against the reference, then ``chain`` steps captured in one CUDA graph."""
    from dflash_bench.raw_launchers import cuda_launcher
    from dflash_bench.torch_side import import_torch, torch_inputs, torch_pool

    one_layer(problem)
    torch = import_torch()
    num_sets, launch, check = gemm_sets(problem, "gpu"), None, _unchecked()
    if not spec.gemm_alone:
        launcher = cuda_launcher(problem, torch, torch_inputs(torch, problem, ctx), spec.contract)
        pool = torch_pool(torch, problem, spec.contract)

        def launch(j: int, **deltas) -> None:
            launcher(pool, j, **deltas)

    enqueue = torch_gemm_chain(torch, problem, spec.contract, num_sets, launch)
    if launch is not None:  # one step from the known pool, against the reference
        enqueue(0)
        torch.cuda.synchronize()
        check = _checked(problem, spec.contract, pool)
    info = _gemm_info(problem, num_sets, check, launch is not None)
    return cuda_graph(torch, enqueue, settings.chain, info)
