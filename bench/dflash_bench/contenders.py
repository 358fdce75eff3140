"""What is timed: one ``Contender`` entry each, set up by the preparer of its kind.

A contender of a new contract or a new norm variant is one entry in ``CONTENDERS`` (its
``kind`` picks how it is set up, checked and timed; its ``contract`` names the addressing form,
``contracts.CONTRACTS``). Targets (targets.py) name contenders explicitly.
"""

from __future__ import annotations

import dataclasses

from dflash_bench import copy_floor, flashinfer_peer, jax_contenders, raw_launchers
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
    unfused_shapes_only: bool = False  # timed at the shapes marked unfused only


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
        Contender(
            "unfused_jax", "jax", "paged", jnp_norm=True, exact=False, unfused_shapes_only=True
        ),
        Contender("rmsnorm_jax", "jax_norm_alone", unfused_shapes_only=True),
        Contender("jax_baseline", "jax_baseline", exact=False),
        Contender("flashinfer", "flashinfer", exact=False),
        Contender("copy", "copy"),
    )
}
OURS = tuple(name for name, c in CONTENDERS.items() if c.ours)

# (kind, backend) -> preparer(spec, problem, settings, ctx); backend None: either.
PREPARERS = {
    ("jax", None): jax_contenders.prepare_jax,
    ("jax_baseline", None): jax_contenders.prepare_jax,
    ("jax_norm_alone", None): jax_contenders.prepare_rmsnorm,
    ("raw", "gpu"): raw_launchers.prepare_raw_gpu,
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
    if spec.unfused_shapes_only and not problem.shape.unfused:
        return {"status": "n/a", "reason": "timed at the shapes marked unfused only"}
    try:
        return _preparer(spec, settings.backend)(spec, problem, settings, ctx)
    except Skip as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
        return {"status": "error", "reason": f"{type(e).__name__}: {e}"}
