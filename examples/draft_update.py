"""A DFlash draft's target-context update, written in JAX and exported to ONNX for TensorRT.

Each draft layer projects the target model's hidden features into keys and values
(``k = RMSNorm_D(h @ Wk)``, ``v = h @ Wv``, reshaped to ``[B, L, H, D]``) and writes them into its
paged KV pool with :func:`jax_dflash.target_kv_cache_update` (RoPE applied to the keys on the
way). The weights are closed over, so they become initializers of the exported graph; the graph
inputs are the runtime tensors only.

Run ``python examples/draft_update.py [out.onnx]``: it exports the function (one
``DFlashTargetKVCacheUpdate`` node per layer, the rest standard ONNX), runs the graph with
ONNX's reference evaluator (the node on this project's CPU kernel) and compares with JAX.
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
    page_size: int = 8  # P (TensorRT serving uses 128)
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
        LayerWeights(normal(config.hidden, width, std=scale), normal(config.hidden, width, std=scale),
                     (1.0 + normal(config.head_dim, std=0.1).astype(np.float32)).astype(dtype))
        for _ in range(config.num_layers)
    ]


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, in float32."""
    x = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv_rms * weight.astype(jnp.float32)


def project_context(target_hidden, weights: LayerWeights, config: DraftConfig, dtype):
    """One layer's ``k_delta``, ``v_delta`` [B, L, H, D] in ``dtype`` (float32 arithmetic)."""
    batch, delta_len, _ = target_hidden.shape
    heads_shape = (batch, delta_len, config.num_kv_heads, config.head_dim)
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

    def draft_context_update(target_hidden, rope_cos_sin, delta_start_positions, delta_lengths,
                             *pools):
        if len(pools) != len(weights):
            raise ValueError(f"pools: expected {len(weights)} (one per layer), got {len(pools)}")
        updated = []
        for layer_weights, pool in zip(weights, pools):
            k, v = project_context(target_hidden, layer_weights, config, pool.dtype)
            updated.append(jax_dflash.target_kv_cache_update(
                k, v, pool, rope_cos_sin, delta_start_positions, delta_lengths,
                pages_per_slot=config.pages_per_slot,
            ))
        return tuple(updated)

    return draft_context_update


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
    return ["target_hidden", "rope_cos_sin", "delta_start_positions", "delta_lengths",
            *[f"past_key_value_{i}" for i in range(config.num_layers)]]


def output_names(config: DraftConfig) -> list[str]:
    return [f"present_key_value_{i}" for i in range(config.num_layers)]


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
    pools = [rng.standard_normal(config.pool_shape(), dtype=np.float32).astype(dtype)
             for _ in range(config.num_layers)]
    return [hidden, rope_table(config.slot_capacity, config.rotary_dim), starts, lengths, *pools]


def main(argv: list[str]) -> int:
    from jax_dflash.interop.export import to_onnx
    from jax_dflash.interop.onnx_reference import reference_evaluator

    path = argv[1] if len(argv) > 1 else "draft_update.onnx"
    # P = 128 tokens per page: the TensorRT plugin's contract (the tests use smaller pages).
    config, batch, delta_len = DraftConfig(page_size=128), 2, 4
    dtype = np.dtype(argv[2]) if len(argv) > 2 else np.float16
    fn = make_draft_context_update(random_weights(config, dtype), config)
    model = to_onnx(fn, input_specs(config, batch, delta_len, dtype),
                    input_names=input_names(config), output_names=output_names(config))
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    ops = [f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node]
    print(f"wrote {path}: {len(ops)} nodes: {', '.join(ops)}")

    inputs = random_inputs(config, batch, delta_len, dtype)
    onnx_pools = reference_evaluator(model).run(None, dict(zip(input_names(config), inputs)))
    jax_pools = jax.jit(fn)(*inputs)
    for i, (a, b) in enumerate(zip(onnx_pools, jax_pools)):
        diff = np.abs(a.astype(np.float32) - np.asarray(b).astype(np.float32)).max()
        print(f"layer {i}: max |ONNX reference - JAX| = {diff:.3g}")
    print(f"build: trtexec --onnx={path} --dynamicPlugins=$(python -c 'import jax_dflash; "
          "print(jax_dflash.trt_plugin_library_path())') --stronglyTyped "
          "--preview=+aliasedPluginIO1003 --saveEngine=draft_update.plan")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
