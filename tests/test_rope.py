"""rope_cos_sin against the published frequency definitions of each model family, written here in
NumPy float64 after Hugging Face's rope initialisers and DeepSeek-V3's YaRN rotary embedding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_problem
from jax_dflash import reference
from jax_dflash.rope import rope_cos_sin


def default_inv_freq(dim, base):
    # HF _compute_default_rope_parameters: 1 / base^(arange(0, dim, 2) / dim).
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def linear_inv_freq(dim, base, factor):
    # HF _compute_linear_scaling_rope_parameters: the default frequencies divided by the factor.
    return default_inv_freq(dim, base) / factor


def llama3_inv_freq(dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
    # HF _compute_llama3_parameters (Llama 3.1), element by element.
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in default_inv_freq(dim, base):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim, base, factor, original_max_position_embeddings, beta_fast, beta_slow):
    # DeepSeek-V3's DeepseekV3YarnRotaryEmbedding (the same as HF _compute_yarn_parameters with
    # truncate=True).
    def find_correction_dim(num_rotations):
        turns = original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(beta_fast)), 0)
    high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq_mask = 1.0 - ramp
    freq_extra = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freq_inter = 1.0 / (factor * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask


def table(positions, inv_freq, attention_factor=1.0):
    freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
    return np.concatenate([np.cos(freqs), np.sin(freqs)], -1) * attention_factor


def assert_float32_close(got, want):
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    # One rounding of a float64 value to float32: within half an ulp of the value (2^-24 of
    # the largest magnitude, the attention factor, covers every entry).
    atol = 2.0**-24 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=atol)


POSITIONS = np.array([0, 1, 2, 17, 1000, 4095, 4096, 8191, 32768, 131071, 1_000_000])

FAMILIES = [
    # (id, rotary_dim, theta, scaling, reference inv_freq, attention factor)
    ("llama2", 128, 10000.0, None, default_inv_freq(128, 10000.0), 1.0),
    ("qwen3", 128, 1e6, {"rope_type": "default"}, default_inv_freq(128, 1e6), 1.0),
    ("partial_rotary", 32, 10000.0, None, default_inv_freq(32, 10000.0), 1.0),
    (
        "linear",
        64,
        10000.0,
        {"rope_type": "linear", "factor": 4.0},
        linear_inv_freq(64, 10000.0, 4.0),
        1.0,
    ),
    (
        "llama3.1",
        128,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192),
        1.0,
    ),
    (
        "deepseek_v3",
        64,
        10000.0,
        {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        yarn_inv_freq(64, 10000.0, 40, 4096, 32, 1),
        1.0,
    ),
    (
        "kimi_k2",
        64,
        50000.0,
        {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        yarn_inv_freq(64, 50000.0, 32.0, 4096, 1.0, 1.0),
        1.0,
    ),
    (
        "yarn_mscale",
        64,
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        yarn_inv_freq(64, 10000.0, 16.0, 2048, 32, 1),
        yarn_get_mscale(16.0, 0.707) / yarn_get_mscale(16.0, 1.0),
    ),
    # HF's defaults (beta_fast 32, beta_slow 1) and its attention factor 0.1 ln(factor) + 1.
    (
        "yarn_hf_defaults",
        128,
        1e6,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        yarn_inv_freq(128, 1e6, 4.0, 32768, 32, 1),
        0.1 * math.log(4.0) + 1.0,
    ),
]


@pytest.mark.parametrize(
    "rotary_dim, theta, scaling, inv_freq, attention",
    [f[1:] for f in FAMILIES],
    ids=[f[0] for f in FAMILIES],
)
def test_matches_the_published_definition(rotary_dim, theta, scaling, inv_freq, attention):
    got = rope_cos_sin(POSITIONS, rotary_dim, theta=theta, scaling=scaling)
    assert_float32_close(got, table(POSITIONS, inv_freq, attention))


def test_families_differ_from_the_default():
    # Each scaling changes the frequencies it is meant to change (the tests above are not all
    # comparing one table with itself).
    base = np.asarray(rope_cos_sin(POSITIONS, 64, theta=10000.0))
    for scaling in (f[3] for f in FAMILIES if f[3] and f[1] == 64 and f[2] == 10000.0):
        assert np.abs(np.asarray(rope_cos_sin(POSITIONS, 64, scaling=scaling)) - base).max() > 0.1


def test_seq_len_gives_a_slot_table():
    got = rope_cos_sin(12, 8)
    assert got.shape == (1, 12, 8) and got.dtype == jnp.float32
    assert_float32_close(got, table(np.arange(12)[None], default_inv_freq(8, 10000.0)))
    # The slot op reads row pos of it: a key at position 3 rotated by the row of position 3.
    problem = make_problem(
        np.random.default_rng(0),
        batch=1,
        delta_len=1,
        heads=1,
        head_dim=8,
        page_size=4,
        pages_per_slot=3,
        dtype=np.float32,
        hostile=False,
    )
    problem.delta_start_positions[:] = 3
    out = reference.target_kv_cache_update(
        problem.k_delta,
        problem.v_delta,
        problem.past_key_value,
        np.asarray(got),
        problem.delta_start_positions,
        problem.delta_lengths,
        pages_per_slot=3,
    )
    x = problem.k_delta[0, 0, 0].astype(np.float64)
    angle = 3 * default_inv_freq(8, 10000.0)
    rotated = np.concatenate(
        [
            x[:4] * np.cos(angle) - x[4:] * np.sin(angle),
            x[4:] * np.cos(angle) + x[:4] * np.sin(angle),
        ]
    )
    np.testing.assert_allclose(out[0, 0, 3, 0], rotated, rtol=0, atol=1e-6)


def test_batched_positions_keep_their_shape():
    positions = np.array([[0, 5, 9], [100, 2, 7]], np.int32)
    got = rope_cos_sin(positions, 16, theta=1e6)
    assert got.shape == (2, 3, 16)
    assert_float32_close(got, table(positions, default_inv_freq(16, 1e6)))
    assert_float32_close(
        rope_cos_sin(jnp.asarray(positions), 16, theta=1e6),
        table(positions, default_inv_freq(16, 1e6)),
    )


def test_deterministic_and_zero_rotary_dim():
    a = np.asarray(rope_cos_sin(POSITIONS, 64, scaling=FAMILIES[5][3]))
    b = np.asarray(rope_cos_sin(POSITIONS, 64, scaling=FAMILIES[5][3]))
    assert a.tobytes() == b.tobytes()
    assert rope_cos_sin(5, 0).shape == (1, 5, 0)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((8, 7), {}, ValueError, "rotary_dim"),
        ((8, -2), {}, ValueError, "rotary_dim"),
        ((8, 8.0), {}, TypeError, "rotary_dim"),
        ((-1, 8), {}, ValueError, "positions_or_seq_len"),
        ((np.array([0.5, 1.0]), 8), {}, TypeError, "positions_or_seq_len"),
        ((True, 8), {}, TypeError, "positions_or_seq_len"),
        ((8, 8), {"theta": 0.0}, ValueError, "theta"),
        ((8, 8), {"scaling": {"rope_type": "ntk"}}, ValueError, "unknown rope_type 'ntk'"),
        ((8, 8), {"scaling": {"factor": 2.0}}, ValueError, "rope_type"),
        ((8, 8), {"scaling": {"rope_type": "linear"}}, ValueError, "missing \\['factor'\\]"),
        (
            (8, 8),
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                }
            },
            ValueError,
            "original_max_position_embeddings",
        ),
        (
            (8, 8),
            {"scaling": {"rope_type": "yarn", "factor": 4.0}},
            ValueError,
            "original_max_position_embeddings",
        ),
        (
            (8, 8),
            {"scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}},
            ValueError,
            "unknown keys \\['beta_fast'\\]",
        ),
        ((8, 8), {"scaling": {"rope_type": "linear", "factor": -2.0}}, ValueError, "factor"),
        (
            (8, 8),
            {"scaling": {"rope_type": "linear", "type": "yarn", "factor": 2.0}},
            ValueError,
            "disagree",
        ),
        ((8, 8), {"scaling": "linear"}, TypeError, "scaling"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        rope_cos_sin(*args, **kwargs)


def test_traced_positions_are_rejected():
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda p: rope_cos_sin(p, 8))(jnp.arange(4))
