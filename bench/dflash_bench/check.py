"""The correctness gate: a contender's sample after one update against the NumPy reference (and,
with dynamic scales, the sample's scale pool entries against the reference's)."""

from __future__ import annotations

import numpy as np

from dflash_bench.dtypes import bits, ulp
from dflash_bench.problem import Problem


def compare_sample(
    got: np.ndarray, want: np.ndarray, exact_required: bool, magnitude: float = 1.0
) -> dict:
    """A contender's sample after one update against the NumPy reference's: bit-exact, or
    within two ulps of max(|expected|, ``magnitude``)."""
    got = np.asarray(got).reshape(want.shape)
    if got.dtype != want.dtype:
        got = got.view(want.dtype) if got.dtype.itemsize == want.dtype.itemsize else got
    exact = bool(np.array_equal(bits(got), bits(want)))
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    diff = np.abs(got32 - want32)
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    tol = 2 * ulp(want.dtype) * np.maximum(np.abs(want32), magnitude)
    close = bool(np.all(diff <= tol)) and not np.isnan(got32).any()
    ok = exact if exact_required else close
    return {
        "ok": ok,
        "bit_exact": exact,
        "max_abs_diff": max_abs,
        "criterion": "bit-exact"
        if exact_required
        else "within 2 ulp" + (f" at magnitude {magnitude:g}" if magnitude != 1 else ""),
    }


def sample_array(pool, problem: Problem, contract: str) -> np.ndarray:
    """The sampled pages of layer 0 of a pool (JAX, torch or NumPy) on the host, as
    ``[2, pages, P, H, D]``."""
    k_pages, v_pages = problem.sample_pages(contract)
    if problem.shape.num_layers:
        pool = pool[0]
    if hasattr(pool, "detach"):  # torch
        import torch

        from dflash_bench.torch_side import from_torch

        dtype = problem.shape.np_pool_dtype
        k_pages, v_pages = (
            torch.from_numpy(p.astype(np.int64)).to(pool.device) for p in (k_pages, v_pages)
        )
        k = from_torch(pool[0].index_select(0, k_pages), dtype)
        v = from_torch(pool[1].index_select(0, v_pages), dtype)
    else:
        k, v = np.asarray(pool[0][k_pages]), np.asarray(pool[1][v_pages])
    return np.stack([k, v])


def sample_scales(scale_pool, problem: Problem, contract: str) -> np.ndarray:
    """The sampled pages' entries of layer 0 of a scale pool (JAX or NumPy) on the host, as
    ``[2, pages, P, H]``."""
    k_pages, v_pages = problem.sample_pages(contract)
    if problem.shape.num_layers:
        scale_pool = scale_pool[0]
    return np.stack([np.asarray(scale_pool[0][k_pages]), np.asarray(scale_pool[1][v_pages])])


def check_scales(
    check: dict,
    scale_pool,
    problem: Problem,
    contract: str,
    fused_norm: bool = False,
    exact_required: bool = True,
) -> dict:
    """``check`` with, for a pool with dynamic scales, ``scale_pool``: its sample's entries
    against the reference's (bit for bit, or within two float32 ulps), ``ok`` only if the
    pool's sample and the scales both pass."""
    want = problem.expected_scales(contract, fused_norm)
    if want is None:
        return check
    scales = compare_sample(sample_scales(scale_pool, problem, contract), want, exact_required)
    check["scale_pool"] = scales
    check["ok"] = check["ok"] and scales["ok"]
    return check
