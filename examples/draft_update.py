"""A DFlash draft's target-context update, written in JAX and exported to ONNX for TensorRT.

Each draft layer projects the target model's hidden features into keys and values
(``k = RMSNorm_D(h @ Wk)``, ``v = h @ Wv``, reshaped to ``[B, L, H, D]``) and writes them into its
paged KV pool with :func:`jax_dflash.target_kv_cache_update` (RoPE applied to the keys on the
way). The weights are closed over, so they become initializers of the exported graph; the graph
inputs are the runtime tensors only.

The paged variant (TensorRT Edge-LLM 0.11's contract) takes token-major features ``[T, hidden]``
and writes them with :func:`jax_dflash.target_kv_cache_update_paged` through a page table; it
exports to Edge-LLM's own ``trt_edgellm`` node.

Run ``python examples/draft_update.py [out.onnx [dtype]]``: it exports both functions (one
``DFlashTargetKVCacheUpdate`` node per layer, the rest standard ONNX; the paged graph next to
the slot one, ``*_paged.onnx``), runs each graph with ONNX's reference evaluator (the node on
this project's CPU kernel) and compares with JAX.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_dflash


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    hidden: int = 64  # target hidden size fed to the draft's context projections
    num_layers: int = 2
    num_kv_heads: int = 2  # H
    head_dim: int = 16  # D
    rotary_dim: int = 16  # R
    page_size: int = 128  # P: TensorRT's plugin takes pages of 128 tokens
    pages_per_slot: int = 2
    max_batch: int = 3
    rms_norm_eps: float = 1e-6

    @property
    def slot_capacity(self) -> int:
        return self.page_size * self.pages_per_slot

    def pool_shape(self) -> tuple[int, ...]:
        num_pages = self.max_batch * self.pages_per_slot
        return (2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    wk: np.ndarray  # [hidden, H * D]
    wv: np.ndarray  # [hidden, H * D]
    k_norm: np.ndarray  # [D], the RMSNorm weight of the keys


def random_weights(config: DraftConfig, dtype, seed: int = 0) -> list[LayerWeights]:
    rng = np.random.default_rng(seed)
    width = config.num_kv_heads * config.head_dim
    scale = 1.0 / np.sqrt(config.hidden)

    def normal(*shape, std=1.0):
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    return [
        LayerWeights(
            normal(config.hidden, width, std=scale),
            normal(config.hidden, width, std=scale),
            (1.0 + normal(config.head_dim, std=0.1).astype(np.float32)).astype(dtype),
        )
        for _ in range(config.num_layers)
    ]


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, in float32."""
    x = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv_rms * weight.astype(jnp.float32)


def project_context(target_hidden, weights: LayerWeights, config: DraftConfig, dtype):
    """One layer's ``k_delta``, ``v_delta`` in ``dtype`` (float32 arithmetic): ``[B, L, H, D]``
    from ``[B, L, hidden]`` features, ``[T, H, D]`` from token-major ``[T, hidden]`` ones."""
    heads_shape = (*target_hidden.shape[:-1], config.num_kv_heads, config.head_dim)
    h = target_hidden.astype(jnp.float32)
    k = jnp.matmul(h, jnp.asarray(weights.wk).astype(jnp.float32)).reshape(heads_shape)
    v = jnp.matmul(h, jnp.asarray(weights.wv).astype(jnp.float32)).reshape(heads_shape)
    k = rms_norm(k, jnp.asarray(weights.k_norm), config.rms_norm_eps)
    return k.astype(dtype), v.astype(dtype)


def make_draft_context_update(weights: list[LayerWeights], config: DraftConfig):
    """``fn(target_hidden, rope_cos_sin, delta_start_positions, delta_lengths, *pools)``.

    ``target_hidden`` [B, L, hidden]; one pool [2, numPages, P, H, D] per layer. Returns the
    updated pools, one per layer, in order.
    """

    def draft_context_update(
        target_hidden, rope_cos_sin, delta_start_positions, delta_lengths, *pools
    ):
        if len(pools) != len(weights):
            raise ValueError(f"pools: expected {len(weights)} (one per layer), got {len(pools)}")
        updated = []
        for layer_weights, pool in zip(weights, pools):
            k, v = project_context(target_hidden, layer_weights, config, pool.dtype)
            updated.append(
                jax_dflash.target_kv_cache_update(
                    k,
                    v,
                    pool,
                    rope_cos_sin,
                    delta_start_positions,
                    delta_lengths,
                    pages_per_slot=config.pages_per_slot,
                )
            )
        return tuple(updated)

    return draft_context_update


def make_draft_context_update_paged(weights: list[LayerWeights], config: DraftConfig):
    """``fn(target_hidden, rope_cos_sin, delta_positions, delta_token_to_sequence, kv_page_table,
    *pools)``: the paged contract.

    ``target_hidden`` [T, hidden] token-major, ``rope_cos_sin`` [T, R] (token-aligned rows),
    positions and owners [T], the page table [B, 2, M]; one pool per layer. Returns the
    updated pools.
    """

    def draft_context_update_paged(
        target_hidden, rope_cos_sin, delta_positions, delta_token_to_sequence, kv_page_table, *pools
    ):
        if len(pools) != len(weights):
            raise ValueError(f"pools: expected {len(weights)} (one per layer), got {len(pools)}")
        updated = []
        for layer_weights, pool in zip(weights, pools):
            k, v = project_context(target_hidden, layer_weights, config, pool.dtype)
            updated.append(
                jax_dflash.target_kv_cache_update_paged(
                    k,
                    v,
                    pool,
                    rope_cos_sin,
                    delta_positions,
                    delta_token_to_sequence,
                    kv_page_table,
                )
            )
        return tuple(updated)

    return draft_context_update_paged


def input_specs(config: DraftConfig, batch: int, delta_len: int, dtype, rope_seq_len=None):
    """The ``jax.ShapeDtypeStruct`` of each argument of ``draft_context_update``."""
    rope_seq_len = config.slot_capacity if rope_seq_len is None else rope_seq_len
    return [
        jax.ShapeDtypeStruct((batch, delta_len, config.hidden), dtype),
        jax.ShapeDtypeStruct((1, rope_seq_len, config.rotary_dim), np.float32),
        jax.ShapeDtypeStruct((batch,), np.int32),
        jax.ShapeDtypeStruct((batch,), np.int32),
        *[jax.ShapeDtypeStruct(config.pool_shape(), dtype)] * config.num_layers,
    ]


def input_names(config: DraftConfig) -> list[str]:
    return [
        "target_hidden",
        "rope_cos_sin",
        "delta_start_positions",
        "delta_lengths",
        *[f"past_key_value_{i}" for i in range(config.num_layers)],
    ]


def output_names(config: DraftConfig) -> list[str]:
    return [f"present_key_value_{i}" for i in range(config.num_layers)]


def paged_input_specs(config: DraftConfig, batch: int, delta_len: int, dtype):
    """The ``jax.ShapeDtypeStruct`` of each argument of ``draft_context_update_paged``: the
    ``batch * delta_len`` token rows of ``batch`` sequences, a page table of their slots."""
    tokens = batch * delta_len
    return [
        jax.ShapeDtypeStruct((tokens, config.hidden), dtype),
        jax.ShapeDtypeStruct((tokens, config.rotary_dim), np.float32),
        jax.ShapeDtypeStruct((tokens,), np.int32),
        jax.ShapeDtypeStruct((tokens,), np.int32),
        jax.ShapeDtypeStruct((batch, 2, config.pages_per_slot), np.int32),
        *[jax.ShapeDtypeStruct(config.pool_shape(), dtype)] * config.num_layers,
    ]


def paged_input_names(config: DraftConfig) -> list[str]:
    return [
        "target_hidden",
        "rope_cos_sin",
        "delta_positions",
        "delta_token_to_sequence",
        "kv_page_table",
        *[f"past_key_value_{i}" for i in range(config.num_layers)],
    ]


def rope_table(seq_len: int, rotary_dim: int, base: float = 10000.0) -> np.ndarray:
    """[1, seq_len, rotary_dim] float32: the cosines then the sines of rotate-half RoPE."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], -1)[None].astype(np.float32)


def random_inputs(config: DraftConfig, batch: int, delta_len: int, dtype, seed: int = 1):
    """Random features and pools; starts/lengths include padding and a drop past the slot."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((batch, delta_len, config.hidden), dtype=np.float32).astype(dtype)
    starts = rng.integers(0, config.slot_capacity, batch).astype(np.int32)
    starts[-1] = config.slot_capacity - 2  # the last sequence runs past its slot
    lengths = rng.integers(1, delta_len + 1, batch).astype(np.int32)
    pools = [
        rng.standard_normal(config.pool_shape(), dtype=np.float32).astype(dtype)
        for _ in range(config.num_layers)
    ]
    return [hidden, rope_table(config.slot_capacity, config.rotary_dim), starts, lengths, *pools]


def paged_inputs(config: DraftConfig, inputs):
    """The paged form of :func:`random_inputs`' slot inputs, built as Edge-LLM 0.11 builds them:
    token positions and owners (-1 for padding), rope rows gathered per token (zero past the
    table), the identity page table (slot b's pages); the same writes for positions below S."""
    hidden, rope, starts, lengths, *pools = inputs
    batch, delta_len = hidden.shape[:2]
    positions, owners = jax_dflash.token_positions(starts, lengths, delta_len)
    rows = jax_dflash.gather_rope(rope, positions, owners)
    table = jax_dflash.identity_page_table(batch, config.pages_per_slot, config.pool_shape()[1])
    flat = hidden.reshape(batch * delta_len, hidden.shape[-1])
    return [flat, *(np.asarray(a) for a in (rows, positions, owners, table)), *pools]


def _export_and_compare(to_onnx, reference_evaluator, fn, specs, names, outputs, inputs, path):
    model = to_onnx(fn, specs, input_names=names, output_names=outputs)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    ops = [f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node]
    print(f"wrote {path}: {len(ops)} nodes: {', '.join(ops)}")
    onnx_pools = reference_evaluator(model).run(None, dict(zip(names, inputs)))
    jax_pools = jax.jit(fn)(*inputs)
    for i, (a, b) in enumerate(zip(onnx_pools, jax_pools)):
        diff = np.abs(a.astype(np.float32) - np.asarray(b).astype(np.float32)).max()
        print(f"  layer {i}: max |ONNX reference - JAX| = {diff:.3g}")


def main(argv: list[str]) -> int:
    from jax_dflash.interop.export import to_onnx
    from jax_dflash.interop.onnx_reference import reference_evaluator

    path = argv[1] if len(argv) > 1 else "draft_update.onnx"
    paged_path = (path[:-5] if path.endswith(".onnx") else path) + "_paged.onnx"
    config, batch, delta_len = DraftConfig(), 2, 4
    dtype = np.dtype(argv[2]) if len(argv) > 2 else np.dtype(np.float16)
    weights = random_weights(config, dtype)
    inputs = random_inputs(config, batch, delta_len, dtype)

    _export_and_compare(
        to_onnx,
        reference_evaluator,
        make_draft_context_update(weights, config),
        input_specs(config, batch, delta_len, dtype),
        input_names(config),
        output_names(config),
        inputs,
        path,
    )
    _export_and_compare(
        to_onnx,
        reference_evaluator,
        make_draft_context_update_paged(weights, config),
        paged_input_specs(config, batch, delta_len, dtype),
        paged_input_names(config),
        output_names(config),
        paged_inputs(config, inputs),
        paged_path,
    )
    plugin = "$(python -c 'import jax_dflash; print(jax_dflash.trt_plugin_library_path())')"
    for onnx_path in (path, paged_path):
        engine = (onnx_path[:-5] if onnx_path.endswith(".onnx") else onnx_path) + ".plan"
        print(
            f"build: trtexec --onnx={onnx_path} --dynamicPlugins={plugin} --stronglyTyped "
            f"--preview=+aliasedPluginIO1003 --saveEngine={engine}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
