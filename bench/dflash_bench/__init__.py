"""The benchmark of the update: this project's kernel, both contracts, against what users pick instead.

One run on one device times the time per update of every contender at every shape:

- ``ours_jax``: :func:`jax_dflash.target_kv_cache_update` (slot contract) under ``jax.jit`` with
  the pool donated.
- ``ours_raw``: the same kernel through its raw launcher (``_dflash_cuda.launch`` over torch
  tensors, ``chain`` launches captured in a CUDA graph; on CPU the NumPy entry of
  ``_dflash_cpu``).
- ``paged_jax`` / ``paged_raw``: the paged contract (Edge-LLM 0.11):
  :func:`jax_dflash.target_kv_cache_update_paged` and ``_dflash_cuda.launch_paged`` (CPU: the
  NumPy entry), ``T = B * L`` tokens, ``M`` pages per sequence, every sequence's pages a random
  permutation of the pool.
- ``slots_jax`` / ``slots_raw``: the slot-mapping form (vLLM's flat slots):
  :func:`jax_dflash.target_kv_cache_update_slots` and ``_dflash_cuda.launch_form`` (CPU: the
  NumPy ``update``), the paged form's rows as ``slot = K page * P + position % P``.
- ``knorm_jax``: the paged op with the fused k-norm (``k_norm_weight``).
- ``unfused_jax``: a jnp RMSNorm of the keys under the same jit, then the paged op;
  ``rmsnorm_jax``: that RMSNorm alone, host-timed. Only at the shapes marked ``unfused``. On the
  GPU every JAX contender's result also has ``kernels_us``, its kernels' device time per update
  (CUPTI through torch.profiler): the norm's own time is that of the pair's norm kernels.
- ``jax_baseline``: :func:`dflash_bench.baseline.target_kv_cache_update` (jnp RoPE +
  ``.at[].set(mode="drop")``), jitted the same way: what a JAX user writes without us.
- ``flashinfer``: FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` +
  ``append_paged_kv_cache`` (GPU only; skipped with the reason when it cannot be imported).
- ``copy``: a device-to-device copy moving the same number of bytes (read + written), the floor.
- ``gemm_jax`` / ``gemm_raw`` and ``gemm_{ours,paged,slots}_{jax,raw}``: the k/v projection GEMM
  that produces the deltas, split into contiguous k and v, alone and followed by each form's
  update (``gemm_chain``; GPU decode shapes): the update's added time in the chain.

TensorRT Edge-LLM 0.11's own kernel cannot run here; its numbers measured on the H200
(``EDGE_LLM_0_11_US``) are quoted next to ours and enter the targets.

How time is measured. JAX contenders: one jitted function applies ``chain`` updates back to back
(the pool carried, inputs rotated), so XLA sees one program (on GPU it may run it as one command
buffer); it is called repeatedly without waiting (async dispatch keeps the device busy) and
timed with ``time.perf_counter`` up to ``block_until_ready``. Raw launchers, FlashInfer and the
copy on GPU: ``chain`` calls captured in one CUDA graph, replays timed with CUDA events. On CPU
every contender is timed with ``time.perf_counter``. A measurement lasts at least ``min_time``.
All contenders of a shape are set up first, then measured in turns (the order rotated every
round), so none is timed under conditions the others do not share; the reported time per update
is the median over ``repeats`` measurements of time / updates. Nothing is subtracted. On the GPU,
``nvidia-smi`` samples the SM clock and the power draw every 100 ms during the run; each result's
``clocks`` holds the samples taken during its own measurements, and the run lists the contenders
measured at a lower median SM clock than the others (a power limit slowing them down).

Inputs are rotated: ``num_sets`` sets of k/v deltas and positions, enough that for large shapes
their bytes exceed the L2 cache (60 MB on the H200), so the benchmark does not measure the
cache. Bytes moved per update = K/V read (delta dtype) + pool rows written (K and V, pool dtype;
int4: D/2 bytes a head) + scale pool entries written (dynamic scales: 4 bytes per written row,
head and plane) + cos/sin rows read.

Pool formats (``dtypes.DTYPES``): the delta dtypes, FP8 and int8 with per-head static scales,
their ``-dynamic`` formats with per-token-head scales (a float32 scale pool beside the pool) and
int4 (dynamic scales only, two elements per byte of a uint8 pool). With a scale pool the JAX
contenders carry and donate ``(pool, scale_pool)``; the raw contenders call the by-name entries
(``launch_form`` / ``update``), which update the scale pool in place with the pool.

Correctness is checked once per shape and contender before timing: one update from a known pool,
the first sequences' pages (a sample) compared against the NumPy reference of the contender's
contract (bit-exact for this project's kernel, within two ulps for the others), with dynamic
scales the sample's scale pool entries too (bit-exact); the whole pool of ``ours_jax`` against
the straightforward version's, and the whole pool (and scale pool) of every paged contender,
gathered through its page table, against the slot op's of the same framework. A
contender that fails is marked ``WRONG`` in the table and the run exits 1.

Usage: ``python bench/bench_kv_update.py [--backend auto|cpu|gpu] [--shapes a,b]
[--contenders a,b] [--iters N] [--repeats N] [--min-time S] [--out DIR] [--quick]``. Writes
``kv_update_<backend>.json`` and, when matplotlib is importable, ``kv_update_<backend>.png``
into ``--out`` (default: the current directory).

Modules: ``shapes`` (the cases), ``dtypes`` (element formats), ``contracts`` (addressing forms),
``problem`` (host data and references), ``contenders`` (what is timed, and the preparer of each
kind: ``jax_contenders``, ``raw_launchers``, ``flashinfer_peer``, ``copy_floor``, over
``torch_side``; ``gemm_chain``), ``check`` (the correctness gate), ``timing`` and ``clocks`` (how it is timed),
``runner`` (one shape), ``targets``, ``report``, ``plot`` and ``cli`` (the command line).
"""

from dflash_bench.cli import main

__all__ = ["main"]
