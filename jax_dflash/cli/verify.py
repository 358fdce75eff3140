"""The run's checks: the final pools against the NumPy reference, bit for bit, replayed on the
host in step order (merged into one call where no pool row is written twice); and the read-back
check (:mod:`jax_dflash.cli.readback`): attention over the pool equals attention over keys and
values recomputed from the features without a cache, within the pool dtype's rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dflash import reference
from jax_dflash.cli import allocator, pipeline, readback
from jax_dflash.cli.plan import RunPlan
from jax_dflash.cli.steps import DeviceSteps
from jax_dflash.testing import ULP_SAMPLE

# Sequences the read-back check samples.
READBACK_SEQUENCES = 4


@dataclasses.dataclass(frozen=True)
class Differences:
    """Where pools ``[layers, 2, ...]`` differ from the reference: the differing keys and values,
    the largest distance in ulps of the pool dtype, the reference's magnitude there, and the
    largest absolute difference (over the first ``ULP_SAMPLE`` differing elements)."""

    keys: int
    values: int
    max_ulp: int
    magnitude_at_max_ulp: float
    max_abs: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def differences(actual: np.ndarray, expected: np.ndarray) -> Differences:
    bits = np.dtype(f"int{8 * expected.dtype.itemsize}")
    a, e = actual.view(bits).reshape(-1), expected.view(bits).reshape(-1)
    differ = np.flatnonzero(a != e)
    plane = (differ // expected[0, 0].size) % 2  # 0: keys, 1: values
    values = int(np.count_nonzero(plane))
    differ = differ[:ULP_SAMPLE]
    ai, ei = a[differ].astype(np.int64), e[differ].astype(np.int64)
    sign = np.int64(1) << (8 * expected.dtype.itemsize - 1)
    ulps = np.abs(
        np.where(ai < 0, -(ai & (sign - 1)), ai) - np.where(ei < 0, -(ei & (sign - 1)), ei)
    )
    af = actual.reshape(-1)[differ].astype(np.float32)
    ef = expected.reshape(-1)[differ].astype(np.float32)
    worst = int(np.argmax(ulps)) if differ.size else 0
    return Differences(
        keys=int(plane.size) - values,
        values=values,
        max_ulp=int(ulps.max(initial=0)),
        magnitude_at_max_ulp=float(np.abs(ef[worst])) if differ.size else 0.0,
        max_abs=float(np.nanmax(np.abs(af - ef), initial=0.0)),
    )


def slot_deltas(steps: dict, schedule, block_size: int):
    """Slot contract: every step's deltas as one per-sequence delta ``[layers, B, total, H, D]``,
    token ``j`` of sequence ``b`` at its position ``starts[b] + j`` (no position is written
    twice, so the whole run is one update)."""
    k0, _ = steps[0]
    layers, _, heads, head_dim = k0.shape
    batch = len(schedule.starts)
    total = max(int(schedule.totals.max(initial=0)), 1)
    k_all = np.zeros((layers, batch, total, heads, head_dim), k0.dtype)
    v_all = np.zeros_like(k_all)
    for i, (k, v) in sorted(steps.items()):
        k = k.reshape(layers, batch, block_size, heads, head_dim)
        v = v.reshape(layers, batch, block_size, heads, head_dim)
        offsets = schedule.positions[i] - schedule.starts
        for b, n in enumerate(schedule.lengths[i]):
            if n > 0:
                o = offsets[b]
                k_all[:, b, o : o + n] = k[:, b, :n]
                v_all[:, b, o : o + n] = v[:, b, :n]
    return k_all, v_all


def gather_rope_host(rope: np.ndarray, positions: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """NumPy twin of ``jax_dflash.gather_rope``: row ``positions[t]`` of ``rope[0]``, zeros for
    padding and positions outside the table (a copy either way, so the bits agree)."""
    table = rope[0]
    ok = (owners >= 0) & (positions >= 0) & (positions < table.shape[0])
    rows = table[np.clip(positions, 0, table.shape[0] - 1)]
    return np.where(ok[:, None], rows, np.float32(0))


def paged_replay_groups(plan: allocator.PagedPlan, steps: range):
    """Consecutive steps merged into groups in which no pool row is written twice (a freed page
    reused, or a ring page overwritten, starts a new group): each group is one reference call,
    and the groups in step order reproduce the run. Each kind of layer's pages counts apart."""
    P = plan.page_size
    group: list[int] = []
    seen: set[tuple[int, int]] = set()
    for i in steps:
        pos, own, tables = _step_arrays(plan, i)
        mine = own >= 0
        rows = set()
        for k, (kind, table) in enumerate(zip(plan.kinds, plan.kind_tables(tables))):
            slot = pos[mine] // P
            if kind.ring:  # the op's rule: the table's width, which a repeated ring fills
                slot = slot % plan.table_pages
            pages = table[own[mine], 0, slot].astype(np.int64)
            rows |= {(k, row) for row in (pages * P + pos[mine] % P).tolist()}
        if group and (rows & seen):
            yield group
            group, seen = [], set()
        group.append(i)
        seen |= rows
    if group:
        yield group


def _step_arrays(plan: allocator.PagedPlan, i: int):
    n_pre = plan.prefill.count
    s = plan.prefill if i < n_pre else plan.decode
    j = i if i < n_pre else i - n_pre
    return s.positions[j], s.owners[j], s.tables[j]


def _recompute(weights, rope, streams, positions, *, geometry, tokens_per_step):
    """See :meth:`Checks.recompute`."""

    def chunk(sp):
        return pipeline.project(weights, sp[0], sp[1], geometry)

    split = (streams.reshape(-1, tokens_per_step), positions.reshape(-1, tokens_per_step))
    k, v = jax.lax.map(chunk, split)  # [chunks, layers, T, H, D]
    k = jnp.moveaxis(k, 0, 1).reshape(geometry.layers, -1, *k.shape[3:])
    v = jnp.moveaxis(v, 0, 1).reshape(geometry.layers, -1, *v.shape[3:])
    x = pipeline.k_normed(weights, k, geometry.norm_eps).astype(jnp.float32)
    rows = rope[0][jnp.clip(positions, 0, rope.shape[1] - 1)]
    y = pipeline.rope_jnp(x, rows[None], geometry.rotary_dim)
    return x, y, v.astype(jnp.float32)


class Checks:
    """The reference replay and the read-back check of one plan's run on one device."""

    def __init__(self, plan: RunPlan, steps: DeviceSteps):
        self.plan, self.steps = plan, steps
        self._recompute = None

    def _reference_extras(self, impl: str) -> dict:
        extras = {}
        if self.plan.fp8:
            extras["k_scale"], extras["v_scale"] = self.steps.scales_host()
        if self.plan.dynamic:
            extras["scale_pool"] = self.plan.initial_scale_pool
        if not pipeline.norms_in_step(self.plan.spec, impl):
            extras["k_norm_weight"] = self.plan.host_weights["k_norm"]
            extras["norm_eps"] = self.plan.geometry.norm_eps
        return extras

    def reference_pools(self, deltas: dict, impl: str = "kernel") -> np.ndarray:
        """The NumPy reference's pools after the run, from the deltas each step gave the update."""
        w = self.plan
        extras = self._reference_extras(impl)
        if w.plan is None:
            k, v = slot_deltas(deltas, w.schedule, w.preset.block_size)
            return reference.target_kv_cache_update(
                k,
                v,
                w.initial_pool,
                w.rope,
                w.schedule.starts,
                w.schedule.totals,
                pages_per_slot=w.preset.pages_per_slot,
                **extras,
            )
        pool = w.initial_pool
        for group in paged_replay_groups(w.plan, range(w.prefill_steps + w.steps)):
            pool = self._replay_group(pool, group, deltas, extras)
            if w.dynamic:  # the next group starts from this one's scales
                pool, extras["scale_pool"] = pool
        return (pool, extras["scale_pool"]) if w.dynamic else pool

    def _replay_group(self, pool, group: list[int], deltas: dict, extras: dict) -> np.ndarray:
        """One reference call for steps in which no pool row is written twice: their tokens
        concatenated, each step's table rows renumbered apart."""
        w = self.plan
        pos, own, tables, ks, vs = [], [], [], [], []
        for g, i in enumerate(group):
            p, o, t = _step_arrays(w.plan, i)
            pos.append(p)
            own.append(np.where(o >= 0, o + g * w.batch, -1).astype(np.int32))
            tables.append(t)
            ks.append(deltas[i][0])
            vs.append(deltas[i][1])
        pos, own = np.concatenate(pos), np.concatenate(own)
        return reference.target_kv_cache_update_paged(
            np.concatenate(ks, axis=1),
            np.concatenate(vs, axis=1),
            pool,
            gather_rope_host(w.rope, pos, own),
            pos,
            own,
            np.concatenate(tables, axis=-3),  # the sequences' axis, of each layer's table
            ring=w.plan.ring,
            **extras,
        )

    def readback_views(self) -> list[readback.SequenceView]:
        """The sequences the read-back check samples (the same ones for a given seed), with the
        positions the run wrote and the pool still holds: in a slot, from the sequence's start
        (what lies before it was never written); in pages, the whole sequence, its shared prompt
        pages included, or in a windowed layer what its ring still holds; and each layer's
        window (a windowed layer's queries attend to it, a full layer's causally)."""
        w = self.plan
        rng = np.random.default_rng([w.seed, 1])
        return self._slot_views(rng) if w.plan is None else self._paged_views(rng)

    def _slot_views(self, rng) -> list[readback.SequenceView]:
        s, p = self.plan.schedule, self.plan.preset
        live = np.flatnonzero(s.totals > 0)
        sampled = [int(b) for b in rng.permutation(live)[:READBACK_SEQUENCES]]
        return [
            readback.slot_view(
                f"sequence {b}",
                b,
                int(s.starts[b]),
                int(s.starts[b] + s.totals[b]),
                p.pages_per_slot,
                p.page_size,
                b,
                p.num_layers,
            )
            for b in sampled
        ]

    def _paged_views(self, rng) -> list[readback.SequenceView]:
        plan, layers = self.plan.plan, self.plan.preset.num_layers
        kinds = [plan.kinds[plan.kind_of(n)] for n in range(layers)]
        tables = plan.decode.tables[-1]
        if not plan.mixed:
            tables = np.broadcast_to(tables, (layers, *tables.shape))
        views = []
        for n in rng.permutation(len(plan.final))[:READBACK_SEQUENCES]:
            f = plan.final[int(n)]
            pos = np.arange(f.visible_start, f.length)
            streams = np.where(pos < f.prompt_length, f.prompt_id, f.stream)
            views.append(
                readback.paged_view(
                    f"sequence in table row {f.row}",
                    tables[:, f.row],
                    pos,
                    streams,
                    self.plan.preset.page_size,
                    plan.num_pages,
                    rings=tuple(kind.ring for kind in kinds),
                    held_from=tuple(f.visible_starts[plan.kind_of(n)] for n in range(layers)),
                    windows=tuple(self.plan.window if kind.ring else None for kind in kinds),
                )
            )
        return views

    def recompute(self, streams, positions, at_least: int = 0):
        """Keys and values of tokens from their features, without a cache: ``(normed keys,
        RoPE'd keys, values)`` float32 ``[layers, n_padded, H, D]``, the tokens padded to a step's
        token count times a power of two. The projection runs chunk by chunk in the step's
        own token count, the shape the step ran."""
        T = self.plan.tokens_per_step
        n = len(positions)
        chunks = 1 << max(0, int(np.ceil(np.log2(max(n, at_least, 1) / T))))
        pad = chunks * T - n
        s = np.concatenate([np.asarray(streams, np.int32), np.zeros(pad, np.int32)])
        q = np.concatenate([np.asarray(positions, np.int32), np.zeros(pad, np.int32)])
        if self._recompute is None:
            self._recompute = jax.jit(
                functools.partial(_recompute, geometry=self.plan.geometry, tokens_per_step=T)
            )
        consts = self.steps.consts()
        return self._recompute(consts.weights, consts.rope, self.steps.put(s), self.steps.put(q))

    def readback(self, pools) -> readback.ReadbackResult:
        k_scale, v_scale = self.steps.scales_host()
        scale_pool = None
        if self.plan.dynamic:
            pools, scale_pool = pools
        return readback.check_sequences(
            pools,
            self.readback_views(),
            self.recompute,
            delta_dtype=self.plan.delta_dtype,
            rotary_dim=self.plan.geometry.rotary_dim,
            k_scale=k_scale,
            v_scale=v_scale,
            scale_pool=scale_pool,
            rng=np.random.default_rng([self.plan.seed, 2]),
        )
