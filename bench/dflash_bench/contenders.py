"""What is timed: one ``Contender`` entry each, set up by the preparer of its kind.

A contender of a new contract or a new norm variant is one entry in ``CONTENDERS`` (its
``kind`` picks how it is set up, checked and timed; its ``contract`` names the addressing form,
``contracts.CONTRACTS``). Targets (targets.py) name contenders explicitly.
"""

from __future__ import annotations

import dataclasses

from dflash_bench import copy_floor, flashinfer_peer, gemm_chain, jax_contenders, raw_launchers
from dflash_bench.problem import Problem
from dflash_bench.timing import Prepared, Settings, Skip


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # how it is set up and timed: a key of PREPARERS
    contract: str = "slot"  # the addressing form it is called in (contracts.CONTRACTS)
    fused_norm: bool = False  # the op normalizes the keys itself (k_norm_weight)
    jnp_norm: bool = False  # a jnp RMSNorm of the keys before the op, under the same jit
    exact: bool = True  # bit-exact against the reference (else within two ulps)
    ours: bool = False  # this project's kernel: its fractions of the floor and of copy bandwidth
    only_at: str = ""  # timed only at the shapes with this BenchShape flag set ("": at every one)
    gemm_alone: bool = False  # a GEMM chain (kind gemm_*) without the update: the GEMM and split


CONTENDERS = {
    c.name: c
    for c in (
        Contender("ours_jax", "jax", ours=True),
        Contender("ours_raw", "raw", ours=True),
        Contender("paged_jax", "jax", "paged", ours=True),
        Contender("paged_raw", "raw", "paged", ours=True),
        Contender("slots_jax", "jax", "slot_mapping", ours=True),
        Contender("slots_raw", "raw", "slot_mapping", ours=True),
        Contender("knorm_jax", "jax", "paged", fused_norm=True, ours=True),
        Contender("unfused_jax", "jax", "paged", jnp_norm=True, exact=False, only_at="unfused"),
        Contender("rmsnorm_jax", "jax_norm_alone", only_at="unfused"),
        Contender("jax_baseline", "jax_baseline", exact=False),
        Contender("flashinfer", "flashinfer", exact=False),
        Contender("copy", "copy"),
        # The update after the k/v GEMM that produces its deltas (gemm_chain.py), per path: the
        # GEMM and split alone, then each form's update after them.
        Contender("gemm_jax", "gemm_jax", only_at="gemm_chain", gemm_alone=True),
        Contender("gemm_ours_jax", "gemm_jax", only_at="gemm_chain"),
        Contender("gemm_paged_jax", "gemm_jax", "paged", only_at="gemm_chain"),
        Contender("gemm_slots_jax", "gemm_jax", "slot_mapping", only_at="gemm_chain"),
        Contender("gemm_raw", "gemm_raw", only_at="gemm_chain", gemm_alone=True),
        Contender("gemm_ours_raw", "gemm_raw", only_at="gemm_chain"),
        Contender("gemm_paged_raw", "gemm_raw", "paged", only_at="gemm_chain"),
        Contender("gemm_slots_raw", "gemm_raw", "slot_mapping", only_at="gemm_chain"),
    )
}
OURS = tuple(name for name, c in CONTENDERS.items() if c.ours)


def _gemm_chains() -> dict[str, tuple[str, str]]:
    """Each GEMM chain with the update -> (its path's GEMM chain alone, the same update timed
    back to back): what its added time is taken from and set beside."""
    out = {}
    for name, c in CONTENDERS.items():
        if c.kind.startswith("gemm_") and not c.gemm_alone:
            alone = next(n for n, a in CONTENDERS.items() if a.kind == c.kind and a.gemm_alone)
            back_to_back = next(
                n
                for n, b in CONTENDERS.items()
                if b.kind == c.kind.removeprefix("gemm_")
                and b.contract == c.contract
                and not (b.fused_norm or b.jnp_norm)
            )
            out[name] = (alone, back_to_back)
    return out


GEMM_CHAINS = _gemm_chains()
# Timed per GEMM step, not per update of the shape's bytes: the report's GEMM-chain table, not
# the main table or the plot.
GEMM_CONTENDERS = tuple(n for n, c in CONTENDERS.items() if c.kind.startswith("gemm_"))

# (kind, backend) -> preparer(spec, problem, settings, ctx); backend None: either.
PREPARERS = {
    ("jax", None): jax_contenders.prepare_jax,
    ("jax_baseline", None): jax_contenders.prepare_jax,
    ("jax_norm_alone", None): jax_contenders.prepare_rmsnorm,
    ("raw", "gpu"): raw_launchers.prepare_raw_gpu,
    ("gemm_jax", None): gemm_chain.prepare_gemm_jax,
    ("gemm_raw", "gpu"): gemm_chain.prepare_gemm_raw,
    ("raw", "cpu"): raw_launchers.prepare_raw_cpu,
    ("flashinfer", "gpu"): flashinfer_peer.prepare_flashinfer,
    ("copy", "gpu"): copy_floor.prepare_copy_gpu,
    ("copy", "cpu"): copy_floor.prepare_copy_cpu,
}


def _preparer(spec: Contender, backend: str):
    preparer = PREPARERS.get((spec.kind, None)) or PREPARERS.get((spec.kind, backend))
    if preparer is None:
        where = [b.upper() for k, b in PREPARERS if k == spec.kind]
        raise Skip(" and ".join(where) + " only")
    return preparer


def prepare_contender(
    name: str, problem: Problem, settings: Settings, ctx: dict | None = None
) -> Prepared | dict:
    """The contender set up and checked, or its result when it does not run (skipped, error,
    n/a). ``ctx`` holds what the contenders of one shape share (device copies of the inputs)."""
    if name not in CONTENDERS:
        raise ValueError(f"--contenders: unknown contender {name!r}, expected {tuple(CONTENDERS)}")
    spec, ctx = CONTENDERS[name], {} if ctx is None else ctx
    if spec.only_at and not getattr(problem.shape, spec.only_at):
        return {"status": "n/a", "reason": f"timed at the shapes marked {spec.only_at} only"}
    try:
        return _preparer(spec, settings.backend)(spec, problem, settings, ctx)
    except Skip as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
        return {"status": "error", "reason": f"{type(e).__name__}: {e}"}
