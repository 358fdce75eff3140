"""The peer: FlashInfer's RoPE (``apply_rope_with_cos_sin_cache_inplace`` or the module under
it) then ``append_paged_kv_cache``, into the slot contract's pool layout, GPU only."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dflash_bench.check import compare_sample, sample_array
from dflash_bench.problem import Problem
from dflash_bench.timing import Prepared, Settings, Skip, cuda_graph
from dflash_bench.torch_side import import_torch, to_torch, torch_dtype, torch_pool

if TYPE_CHECKING:
    from dflash_bench.contenders import Contender


def _flashinfer():
    try:
        import flashinfer
    except Exception as e:  # any import failure means: not available here
        raise Skip(
            f"flashinfer is not importable ({type(e).__name__}: {e}); install "
            "flashinfer-python==0.2.8 (BENCHMARKS.md, Reproducing)"
        ) from e
    return flashinfer


@dataclasses.dataclass
class _Operands:
    """FlashInfer's view of the problem: keys and values ``[nnz, H, D]`` per set and layer,
    the tokens' positions per set, the pages of sequence b at ``b * M ...`` (the slot layout)."""

    ks: list  # [set][layer]
    vs: list
    positions: list  # [set]
    batch_indices: object
    kv_indices: object
    kv_indptr: object
    last_page_len: object
    cos_sin: object  # [S, R]: cos then sin, FlashInfer's layout


def _operands(torch, problem: Problem) -> _Operands:
    s = problem.shape
    nnz = s.tokens
    tokens = (nnz, s.num_kv_heads, s.head_dim)

    def layers_of(array):  # one [nnz, H, D] tensor per layer
        t = to_torch(torch, array)
        if s.num_layers:
            return [t[layer].reshape(tokens) for layer in range(s.layers)]
        return [t.reshape(tokens)]

    def ints(values):
        return values.to(dtype=torch.int32, device="cuda")

    t_index = torch.arange(s.delta_len, dtype=torch.int32, device="cuda")
    return _Operands(
        ks=[layers_of(k) for k in problem.k_sets],
        vs=[layers_of(v) for v in problem.v_sets],
        positions=[
            (to_torch(torch, x)[:, None] + t_index[None, :]).reshape(nnz).contiguous()
            for x in problem.start_sets
        ],
        batch_indices=ints(torch.arange(s.batch)).repeat_interleave(s.delta_len),
        kv_indices=ints(torch.arange(s.num_pages)),
        kv_indptr=ints(torch.arange(s.batch + 1)) * s.pages_per_slot,
        last_page_len=ints(torch.full((s.batch,), s.page_size)),
        cos_sin=to_torch(torch, problem.rope[0]),
    )


def _rope_variants(flashinfer, torch, problem: Problem, ops: _Operands) -> list:
    """(name, rope(positions, key)) in the order tried: keys only through the rope module the
    public call wraps, with a query of zero heads (the cheapest FlashInfer path); else the
    public API, which needs a query: one head."""
    s = problem.shape
    nnz, dtype = s.tokens, torch_dtype(torch, s.dtype)
    no_query = torch.empty((nnz, 0, s.head_dim), dtype=dtype, device="cuda")
    one_head_query = torch.zeros((nnz, s.head_dim), dtype=dtype, device="cuda")

    def rope_keys_only(pos, key):
        flashinfer.rope._apply_rope_pos_ids_cos_sin_cache(
            q=no_query,
            k=key,
            q_rope=no_query,
            k_rope=key,
            cos_sin_cache=ops.cos_sin,
            pos_ids=pos,
            interleave=False,
        )

    def rope_public(pos, key):
        flashinfer.apply_rope_with_cos_sin_cache_inplace(
            positions=pos,
            query=one_head_query,
            key=key.view(nnz, -1),
            head_size=s.head_dim,
            cos_sin_cache=ops.cos_sin,
            is_neox=True,
        )

    return [
        ("keys only (rope module, 0 query heads)", rope_keys_only),
        ("public API (1-head query)", rope_public),
    ]


def _update(flashinfer, problem: Problem, ops: _Operands, pool, j: int, rope_fn) -> None:
    """One update with set j: every layer's keys rotated in place, then appended with values."""
    s = problem.shape
    for layer in range(s.layers):
        layer_pool = pool[layer] if s.num_layers else pool
        rope_fn(ops.positions[j], ops.ks[j][layer])
        flashinfer.append_paged_kv_cache(
            ops.ks[j][layer],
            ops.vs[j][layer],
            ops.batch_indices,
            ops.positions[j],
            (layer_pool[0], layer_pool[1]),
            ops.kv_indices,
            ops.kv_indptr,
            ops.last_page_len,
            kv_layout="NHD",
        )


def _pick_variant(flashinfer, torch, problem: Problem, ops: _Operands):
    """The first RoPE variant that runs and matches the reference (if none matches, the last
    that ran, its check failed): (variant, check, pool after one update, notes on the others).
    Correctness runs on set 0 restored before each try and after (the rope is in place)."""
    original = [k.clone() for k in ops.ks[0]]
    variant, check, pool, errors = None, None, None, []
    for name, rope_fn in _rope_variants(flashinfer, torch, problem, ops):
        for layer, k in enumerate(original):
            ops.ks[0][layer].copy_(k)
        candidate = torch_pool(torch, problem, "slot")
        try:
            _update(flashinfer, problem, ops, candidate, 0, rope_fn)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - try the next variant
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        variant, pool = (name, rope_fn), candidate
        check = compare_sample(
            sample_array(pool, problem, "slot"), problem.expected("slot"), exact_required=False
        )
        if check["ok"]:
            break
        errors.append(f"{name}: result differs from the reference ({check})")
    if variant is None:
        raise Skip("flashinfer calls failed: " + " | ".join(errors))
    for layer, k in enumerate(original):
        ops.ks[0][layer].copy_(k)
    return variant, check, pool, errors


def prepare_flashinfer(
    spec: Contender, problem: Problem, settings: Settings, ctx: dict
) -> Prepared:
    s = problem.shape
    if not s.pool_is_delta_dtype:
        raise Skip(f"{s.pool_label} pool: FlashInfer's append writes the cache in the key's dtype")
    torch = import_torch()
    flashinfer = _flashinfer()
    ops = _operands(torch, problem)
    (name, rope_fn), check, pool, errors = _pick_variant(flashinfer, torch, problem, ops)
    info = {
        "check": check,
        "variant": name,
        "version": getattr(flashinfer, "__version__", "unknown"),
    }
    if errors:
        info["variant_notes"] = errors

    def enqueue(i: int) -> None:
        _update(flashinfer, problem, ops, pool, i % len(ops.ks), rope_fn)

    return cuda_graph(torch, enqueue, settings.chain, info)
