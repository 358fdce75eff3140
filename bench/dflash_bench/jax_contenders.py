"""The JAX contenders: this project's op in every contract (with and without the fused k-norm),
the unfused pair, the RMSNorm alone and the straightforward jnp version, each a jitted chain of
``chain`` updates (the pool carried and donated, the input sets rotated) timed from the host.

With dynamic scales the carried "pools" are ``(pool, scale_pool)``: the op takes and returns
both, and the chain donates both."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dflash_bench.check import check_scales, compare_sample, sample_array
from dflash_bench.contracts import CONTRACTS, delta_shape
from dflash_bench.dtypes import DTYPES
from dflash_bench.problem import POOL_FILL, SCALE_FILL, Problem
from dflash_bench.shapes import BenchShape
from dflash_bench.timing import Prepared, Settings, Skip, host_timed
from jax_dflash.contract import DEFAULT_NORM_EPS

if TYPE_CHECKING:
    from dflash_bench.contenders import Contender

# rmsnorm_jax writes every output once per call into a buffer it owns: at most this many bytes.
NORM_OUTPUT_BYTES = 4e9


def jax_device(backend: str):
    import jax

    return jax.devices("gpu" if backend == "gpu" else "cpu")[0]


class JaxInputs:
    """One shape's operands on the JAX device, uploaded once and shared by the JAX contenders;
    each contract's addressing operands on first use."""

    def __init__(self, problem: Problem, device):
        import jax

        self.problem, self.device = problem, device
        self.put = functools.partial(jax.device_put, device=device)
        self.ks = tuple(self.put(k) for k in problem.k_sets)
        self.vs = tuple(self.put(v) for v in problem.v_sets)
        self.scales = {k: self.put(v) for k, v in problem.scales().items()}
        self.k_norm_weight = self.put(problem.k_norm_weight)
        self._operands = {}

    def operands(self, contract: str) -> tuple[tuple, tuple]:
        """(per-set ``(k, v, addressing)`` tuples, shared ``(addressing, scales, weight)``):
        what an update built by ``dflash_update`` takes."""
        if contract not in self._operands:
            c, p = CONTRACTS[contract], self.problem
            sets = tuple(
                (k, v, {name: self.put(a) for name, a in c.per_set(p, j).items()})
                for j, (k, v) in enumerate(zip(self.ks, self.vs))
            )
            common = {name: self.put(a) for name, a in c.shared(p).items()}
            self._operands[contract] = (sets, (common, self.scales, self.k_norm_weight))
        return self._operands[contract]


def jax_pool(problem: Problem, device, contract: str):
    """The known pool: POOL_FILL, with the sample in the sampled sequences' pages (layer 0);
    with dynamic scales ``(pool, scale_pool)``, the scale pool SCALE_FILL with the sample's
    scales in those pages (problem.host_scale_pool)."""
    import jax
    import jax.numpy as jnp

    s = problem.shape
    k_pages, v_pages = problem.sample_pages(contract)
    at = (0,) * len(s.lead)

    def build(shape, fill, dtype, sample, k_pages, v_pages):
        pool = jnp.full(shape, fill, dtype=dtype)
        pool = pool.at[(*at, 0, k_pages)].set(sample[0])
        return pool.at[(*at, 1, v_pages)].set(sample[1])

    put = functools.partial(jax.device_put, device=device)
    pages = (put(k_pages), put(v_pages))
    pool = jax.jit(functools.partial(build, s.pool_shape, POOL_FILL, s.np_pool_dtype))(
        put(problem.sample_init), *pages
    )
    if problem.sample_scale_init is None:
        return pool
    scales = jax.jit(functools.partial(build, s.scale_pool_shape, SCALE_FILL, jnp.float32))(
        put(problem.sample_scale_init), *pages
    )
    return pool, scales


def plain_pool(pools):
    """The pool of ``jax_pool``'s (or the op's) result, without its scale pool."""
    return pools[0] if isinstance(pools, tuple) else pools


def rms_norm(x, weight, eps: float):
    """The model's RMSNorm (HF): normalize in float32, round to x's dtype, times the weight."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(eps))
    return weight * (x32 * inv).astype(x.dtype)


def distinct(x, step):
    """``x`` itself (``step >= 0`` at run time), as a value of its own per chain step.

    The chain repeats each input set, so XLA computes jnp work on a set's inputs (the unfused
    pair's RMSNorm) once per set and reuses it, and that work would not be timed. The select on
    a runtime scalar fuses into the work's own kernel and changes no bit."""
    import jax.numpy as jnp

    return jnp.where(step >= 0, x, jnp.zeros_like(x))


def dflash_update(
    contract: str, shape: BenchShape, fused_norm: bool = False, jnp_norm: bool = False
) -> Callable:
    """This project's op in ``contract``: ``update(pools, per_set, shared, step=None) -> pools``
    over ``JaxInputs.operands`` (``pools``: the pool, or ``(pool, scale_pool)`` with dynamic
    scales); ``fused_norm`` passes the k-norm weight to the op, ``jnp_norm`` normalizes the keys
    in jnp first (the unfused pair; ``step`` keeps that work per update)."""
    import jax_dflash

    c = CONTRACTS[contract]
    op, statics, layout = getattr(jax_dflash, c.jax_op), c.statics(shape), delta_shape(c, shape)

    def update(pools, per_set, shared, step=None):
        (k, v, operands), (common, scales, weight) = per_set, shared
        k, v = k.reshape(layout), v.reshape(layout)  # a bitcast under jit
        extra = {}
        if fused_norm:
            extra = {"k_norm_weight": weight, "norm_eps": DEFAULT_NORM_EPS}
        elif jnp_norm:
            k = rms_norm(k if step is None else distinct(k, step), weight, DEFAULT_NORM_EPS)
        if shape.dynamic_scales:
            pool, extra["scale_pool"] = pools
        else:
            pool = pools
        return op(k, v, pool, **operands, **common, **statics, **scales, **extra)

    return update


def baseline_update(shape: BenchShape) -> Callable:
    """The straightforward jnp version over the slot contract's ``JaxInputs.operands``."""
    import jax

    from dflash_bench import baseline

    one = functools.partial(baseline.target_kv_cache_update, pages_per_slot=shape.pages_per_slot)
    if shape.num_layers:  # what a JAX user writes for stacked layers: vmap the one-layer version
        one = jax.vmap(one, in_axes=(0, 0, 0, None, None, None))

    def update(pool, per_set, shared):
        (k, v, operands), (common, _, _) = per_set, shared
        rope, lengths = common["rope_cos_sin"], common["delta_lengths"]
        return one(k, v, pool, rope, operands["delta_start_positions"], lengths)

    return update


def jitted_chain(update: Callable, chain: int, per_step: bool = False):
    """``update`` applied ``chain`` times in one jitted function, pool donated (with dynamic
    scales ``pool`` is ``(pool, scale_pool)``, both donated), input sets rotated:
    ``step(pool, sets, shared) -> pool`` with ``update(pool, sets[j], shared)``.

    ``per_step``: ``step(pool, sets, shared, steps)`` with ``steps`` an int32 ``[chain]`` array
    of non-negative values, and ``update(pool, sets[j], shared, steps[i])``: a value XLA cannot
    know, for updates that must keep jnp work on the inputs from being computed once per set
    (see ``distinct``)."""
    import jax

    def chained(pool, sets, shared, steps=None):
        # Unrolled: each update reads its own operands (no slicing copies in front of the call).
        for i in range(chain):
            extra = (steps[i],) if per_step else ()
            pool = update(pool, sets[i % len(sets)], shared, *extra)
        return pool

    return jax.jit(chained, donate_argnums=0)


def bit_mismatches(a, b) -> int:
    import jax
    import jax.numpy as jnp

    word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return int(
        jax.jit(
            lambda x, y: jnp.sum(
                jax.lax.bitcast_convert_type(x, word) != jax.lax.bitcast_convert_type(y, word)
            )
        )(a, b)
    )


def gather_pool(pool, problem: Problem, contract: str):
    """The contract's pool in slot order (its page order, see contracts.Contract)."""
    import jax
    import jax.numpy as jnp

    k_pages, v_pages = (jax.device_put(p, pool.device) for p in problem.page_order(contract))
    lead = len(problem.shape.lead)

    @jax.jit
    def gather(pool, k_pages, v_pages):
        planes = jnp.moveaxis(pool, lead, 0)  # [2, (layers,) N, P, H, D]
        return jnp.moveaxis(
            jnp.stack(
                [jnp.take(planes[0], k_pages, axis=lead), jnp.take(planes[1], v_pages, axis=lead)]
            ),
            0,
            lead,
        )

    return gather(pool, k_pages, v_pages)


def _once(update: Callable, problem: Problem, inputs: JaxInputs, contract: str):
    """The pool (with dynamic scales ``(pool, scale_pool)``) after one update with set 0 from the
    known pool."""
    import jax

    sets, shared = inputs.operands(contract)
    return jax.jit(update)(jax_pool(problem, inputs.device, contract), sets[0], shared)


def _whole_pool_checks(
    spec: Contender, problem: Problem, inputs: JaxInputs, once, check: dict
) -> None:
    """The whole pool after one update: the slot op's against the jnp baseline's (where that
    has the pool format), any other contract's, gathered in slot order, against the slot op's
    bit for bit (with dynamic scales, the pool's and the scale pool's bits)."""
    import jax
    import jax.numpy as jnp

    shape = problem.shape
    if spec.kind != "jax" or spec.jnp_norm:
        return
    if spec.contract == "slot" and not spec.fused_norm and shape.pool_is_delta_dtype:
        other = _once(baseline_update(shape), problem, inputs, "slot")
        diff = jax.jit(
            lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
        )(once, other)
        check["full_pool_max_abs_diff_vs_baseline"] = float(diff)
        tol = 2 * DTYPES[shape.dtype].ulp * 8  # |rotated keys| stay well below 8 here
        check["ok"] = check["ok"] and float(diff) <= tol
    elif spec.contract != "slot":
        twin = _once(dflash_update("slot", shape, spec.fused_norm), problem, inputs, "slot")
        mine, theirs = jax.tree.leaves(once), jax.tree.leaves(twin)
        mismatches = sum(
            bit_mismatches(gather_pool(a, problem, spec.contract), b) for a, b in zip(mine, theirs)
        )
        check["full_pool_bits_differing_vs_slot_op"] = mismatches
        check["ok"] = check["ok"] and mismatches == 0


def jax_inputs(problem: Problem, settings: Settings, ctx: dict) -> JaxInputs:
    if "jax_inputs" not in ctx:
        ctx["jax_inputs"] = JaxInputs(problem, jax_device(settings.backend))
    return ctx["jax_inputs"]


def prepare_jax(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """A JAX contender (``contenders.Contender`` of kind ``jax`` or ``jax_baseline``) checked
    and ready: its sample against the reference of its contract, its whole pool against the
    slot op's or the baseline's, then the jitted chain."""
    import jax.numpy as jnp

    shape, contract = problem.shape, spec.contract
    baseline = spec.kind == "jax_baseline"
    if baseline and not shape.pool_is_delta_dtype:
        raise Skip(f"the straightforward JAX version has no {shape.pool_label} pool")
    inputs = jax_inputs(problem, settings, ctx)
    if baseline:
        update = baseline_update(shape)
    else:
        update = dflash_update(contract, shape, spec.fused_norm, spec.jnp_norm)
    once = _once(update, problem, inputs, contract)
    # The unfused pair's normed keys may differ from the fused ones by an ulp (SPEC.md, "Fused
    # norms"), which RoPE carries at the magnitude of the normed keys (below 8 here).
    normed = spec.fused_norm or spec.jnp_norm
    check = compare_sample(
        sample_array(plain_pool(once), problem, contract),
        problem.expected(contract, normed),
        exact_required=spec.exact,
        magnitude=8.0 if spec.jnp_norm else 1.0,
    )
    if shape.dynamic_scales:
        check_scales(check, once[1], problem, contract, normed, exact_required=spec.exact)
    _whole_pool_checks(spec, problem, inputs, once, check)
    del once

    chain = settings.baseline_chain if baseline else settings.chain
    # The unfused pair's norm is computed in every update, not once per input set.
    step = jitted_chain(update, chain, per_step=spec.jnp_norm)
    state = {"carried": jax_pool(problem, inputs.device, contract)}
    steps = (jnp.arange(chain, dtype=jnp.int32),) if spec.jnp_norm else ()
    prepared = host_timed(step, state, inputs.operands(contract) + steps, chain, settings.backend)
    prepared.info["check"] = check
    return prepared


def prepare_rmsnorm(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    """The keys' RMSNorm alone: every call writes ``chain`` normed copies into the slices of one
    carried, donated buffer, each slice once, so no write is dead and none is elided (one
    buffer, not ``chain``: per-buffer dispatch cost made a tuple of outputs host-bound). On the
    H200 XLA also copies the whole carried buffer once per call (a device-to-device copy in the
    result's ``kernels_us``), so this time is an upper bound of the norm's own; the norm's
    kernels are the rest of ``kernels_us``, and the unfused pair's own (``norm_kernels_us``)."""
    import jax
    import jax.numpy as jnp

    s, inputs = problem.shape, jax_inputs(problem, settings, ctx)
    key_bytes = math.prod(s.delta_shape) * s.np_dtype.itemsize
    chain = int(max(1, min(settings.chain, NORM_OUTPUT_BYTES // key_bytes)))

    def chained(out, ks, weight, steps):
        for i in range(chain):
            normed = rms_norm(distinct(ks[i % len(ks)], steps[i]), weight, DEFAULT_NORM_EPS)
            out = out.at[i].set(normed)
        return out

    step = jax.jit(chained, donate_argnums=0)
    got = np.asarray(
        jax.jit(rms_norm, static_argnums=2)(inputs.ks[0], inputs.k_norm_weight, DEFAULT_NORM_EPS)
    )
    want = problem.expected_normed_keys()
    got = got[(0,) * len(s.lead)][: problem.sample_slots]
    check = compare_sample(got, want, exact_required=False)
    out = jnp.zeros((chain, *s.delta_shape), s.np_dtype, device=inputs.device)
    steps = jnp.arange(chain, dtype=jnp.int32)
    args = (inputs.ks, inputs.k_norm_weight, steps)
    prepared = host_timed(step, {"carried": out}, args, chain, settings.backend)
    prepared.info.update({"check": check, "what": "jnp RMSNorm of the keys alone"})
    return prepared
