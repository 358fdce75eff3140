"""z-lab's DFlash reference (PyPI ``dflash`` 0.1.0, ``dflash/model.py``, torch) run end to end on
tiny random float32 Qwen3 models, with every draft-cache write it makes recorded.

``dflash_generate`` runs the target over the prompt, then per step: the draft projects the new
context features (``k_norm(k_proj(hidden_norm(fc(target_hidden))))`` with rotate-half RoPE, and
``v_proj(...)``) into an HF ``DynamicCache`` together with the noise block, crops the cache back
to the context, and the target verifies the drafted block. The recorder keeps, per step, the
features the draft was given, the positions they took, each layer's ``k_proj``/``v_proj`` outputs
for them (keys before the k-norm and RoPE: the op's ``k_delta``) and a copy of the draft cache
right after the crop: that copy is what the project's update must reproduce.

How steps come to accept several tokens: the draft reads the target's embedding and output head
(z-lab's design), so both models' next-token distributions are softmaxes of logits through one
head; sampled at ``TEMPERATURE`` they overlap enough that rejection sampling accepts a varying
number of drafted tokens (from none to the whole block; the test checks that it did).
"""

from __future__ import annotations

import dataclasses
import unittest.mock

import numpy as np
import torch
from dflash import model as zlab
from transformers import Qwen3Config, Qwen3ForCausalLM

from jax_dflash.contract import DEFAULT_NORM_EPS

SEED = 0
VOCAB = 64
HIDDEN = 64
TARGET_LAYERS = 6
TARGET_LAYER_IDS = [1, 4]  # the target layers whose hidden states the draft reads
DRAFT_LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # the draft's; the target's is 16, so nothing can be read from the wrong model
DRAFT_ROPE_THETA = 10000.0
TARGET_ROPE_THETA = 1e6
BLOCK_SIZE = 8
PROMPT_TOKENS = 12
NEW_TOKENS = 64
TEMPERATURE = 2.0
MAX_POSITIONS = 128


@dataclasses.dataclass(frozen=True)
class Step:
    """One draft step: the context tokens at positions ``[start, start + length)`` were written,
    and the draft cache then held positions ``[0, start + length)``."""

    start: int
    length: int
    cache_k: np.ndarray  # [layers, start + length, KV_HEADS, HEAD_DIM] float32, after the crop
    cache_v: np.ndarray


@dataclasses.dataclass(frozen=True)
class Trace:
    steps: list[Step]
    features: np.ndarray  # [positions, len(TARGET_LAYER_IDS) * HIDDEN]: target_hidden by position
    k_proj: np.ndarray  # [layers, positions, KV_HEADS, HEAD_DIM]: k_proj outputs (no norm, no RoPE)
    v_proj: np.ndarray  # [layers, positions, KV_HEADS, HEAD_DIM]
    fc: np.ndarray  # [features, HIDDEN] (x @ fc, as the pipeline multiplies)
    hidden_norm: np.ndarray  # [HIDDEN]
    k_proj_weight: np.ndarray  # [layers, HIDDEN, KV_HEADS * HEAD_DIM] (x @ w)
    v_proj_weight: np.ndarray  # [layers, HIDDEN, KV_HEADS * HEAD_DIM]
    k_norm_weight: np.ndarray  # [layers, HEAD_DIM]
    norm_eps: float
    rope_theta: float
    rope_table: np.ndarray  # [1, MAX_POSITIONS, HEAD_DIM]: the draft's cos (R/2) then sin (R/2)
    output_ids: np.ndarray  # [tokens]

    @property
    def produced(self) -> list[int]:
        """Tokens each verification produced (accepted draft tokens plus the target's own):
        the context lengths of the steps after the prompt."""
        return [s.length for s in self.steps[1:]]


def _configs():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=DEFAULT_NORM_EPS,
        tie_word_embeddings=False,
    )
    target = Qwen3Config(
        num_hidden_layers=TARGET_LAYERS,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": TARGET_ROPE_THETA},
        **common,
    )
    draft = Qwen3Config(
        num_hidden_layers=DRAFT_LAYERS,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": DRAFT_ROPE_THETA},
        num_target_layers=TARGET_LAYERS,
        dflash_config={
            "block_size": BLOCK_SIZE,
            "mask_token_id": VOCAB - 1,
            "target_layer_ids": TARGET_LAYER_IDS,
        },
        **common,
    )
    return target, draft


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Unit-scale random weights: matrices N(0, 1/fan_in), so activations stay of order one
    through the layers (HF's 0.02 init would leave them tiny); norm weights 1 + 0.1 N(0, 1), so a
    wrong (all-ones) k-norm weight shows."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[1] ** 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))


def build_models(seed: int = SEED):
    """(target, draft): a random ``Qwen3ForCausalLM`` and z-lab's ``DFlashDraftModel``, float32,
    in eval mode."""
    target_config, draft_config = _configs()
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(target_config).float().eval()
    draft = zlab.DFlashDraftModel(draft_config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    _randomize(target, generator)
    _randomize(draft, generator)
    assert draft.target_layer_ids == TARGET_LAYER_IDS and draft.block_size == BLOCK_SIZE
    return target, draft


def draft_rope_table(draft, positions: int) -> np.ndarray:
    """``[1, positions, R]`` in the op's layout (R/2 cosines, then R/2 sines) from the draft's own
    rotary embedding: the very cos/sin bits z-lab's attention multiplied the keys by."""
    pos = torch.arange(positions)[None]
    cos, sin = draft.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = cos[0].numpy(), sin[0].numpy()
    half = cos.shape[-1] // 2
    # Rotate-half (NeoX) layout: HF repeats the R/2 frequencies, which the op's table stores once.
    assert np.array_equal(cos[:, :half], cos[:, half:]) and np.array_equal(
        sin[:, :half], sin[:, half:]
    )
    return np.concatenate([cos[:, :half], sin[:, :half]], axis=-1)[None].astype(np.float32)


class _Recorder:
    """Hooks on the draft model and around z-lab's cache helpers."""

    def __init__(self, draft):
        self.draft = draft
        self.draft_cache = None
        self.calls = []  # per draft forward: (features [ctx, F], positions [ctx])
        self.ctx_input = {}  # layer -> the projected context features its attention was given
        self.k, self.v = [], []  # per draft forward and layer: [ctx, H * D]
        self.snapshots = []  # per draft crop: (keys, values), [layers, length, H, D] each
        self.handles = []

    def __enter__(self):
        self.handles.append(
            self.draft.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        )
        for i, layer in enumerate(self.draft.layers):
            attn = layer.self_attn
            self.handles += [
                attn.register_forward_pre_hook(self._on_attention(i), with_kwargs=True),
                attn.k_proj.register_forward_hook(self._on_proj(i, self.k)),
                attn.v_proj.register_forward_hook(self._on_proj(i, self.v)),
            ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _on_forward(self, module, args, kwargs):
        features = kwargs["target_hidden"][0]
        positions = kwargs["position_ids"][0, : features.shape[0]]
        self.calls.append((features.numpy().copy(), positions.numpy().copy()))
        self.k.append({})
        self.v.append({})

    def _on_attention(self, layer):
        def hook(module, args, kwargs):
            self.ctx_input[layer] = kwargs["target_hidden"]

        return hook

    def _on_proj(self, layer, out):
        # The attention projects the context and the noise block with the same module; the
        # context call is the one whose input is the attention's target_hidden.
        def hook(module, args, output):
            if args[0] is self.ctx_input.get(layer):
                out[-1][layer] = output[0].numpy().copy()

        return hook

    def make_cache(self, config, _make=zlab._make_cache):
        cache = _make(config)
        if config is self.draft.config:
            self.draft_cache = cache
        return cache

    def crop_to(self, cache, length, _crop=zlab._crop_to):
        _crop(cache, length)
        if cache is self.draft_cache:
            keys = [layer.keys[0].transpose(0, 1).numpy().copy() for layer in cache.layers]
            values = [layer.values[0].transpose(0, 1).numpy().copy() for layer in cache.layers]
            self.snapshots.append((np.stack(keys), np.stack(values)))


def run(seed: int = SEED) -> Trace:
    """Runs ``dflash_generate`` (sampled, seeded) and returns what the draft cache received."""
    target, draft = build_models(seed)
    prompt = torch.randint(
        0, VOCAB - 1, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed + 1)
    )
    torch.manual_seed(seed + 2)  # the sampling's draws
    recorder = _Recorder(draft)
    with (
        recorder,
        unittest.mock.patch.object(zlab, "_make_cache", recorder.make_cache),
        unittest.mock.patch.object(zlab, "_crop_to", recorder.crop_to),
    ):
        output = zlab.dflash_generate(
            draft,
            target,
            prompt,
            max_new_tokens=NEW_TOKENS,
            stop_token_ids=None,
            temperature=TEMPERATURE,
        )
    assert len(recorder.calls) == len(recorder.snapshots) > 0

    shape = (KV_HEADS, HEAD_DIM)
    steps, features, k_proj, v_proj = [], [], [], []
    for (feats, positions), k, v, (cache_k, cache_v) in zip(
        recorder.calls, recorder.k, recorder.v, recorder.snapshots
    ):
        start, length = int(positions[0]), len(positions)
        # Each step's context continues the previous one: position p is written exactly once.
        assert np.array_equal(positions, np.arange(start, start + length))
        assert start == sum(s.length for s in steps)
        assert cache_k.shape[1] == start + length, "the crop keeps exactly the context"
        steps.append(Step(start, length, cache_k, cache_v))
        features.append(feats)
        k_proj.append(np.stack([k[i].reshape(length, *shape) for i in range(DRAFT_LAYERS)]))
        v_proj.append(np.stack([v[i].reshape(length, *shape) for i in range(DRAFT_LAYERS)]))

    def weight_t(linear):  # torch's Linear computes x @ W.T
        return linear.weight.detach().numpy().T.copy()

    attns = [layer.self_attn for layer in draft.layers]
    eps = {attn.k_norm.variance_epsilon for attn in attns} | {draft.hidden_norm.variance_epsilon}
    assert len(eps) == 1, f"one norm epsilon throughout the draft, got {eps}"
    return Trace(
        steps=steps,
        features=np.concatenate(features),
        k_proj=np.concatenate(k_proj, axis=1),
        v_proj=np.concatenate(v_proj, axis=1),
        fc=weight_t(draft.fc),
        hidden_norm=draft.hidden_norm.weight.detach().numpy().copy(),
        k_proj_weight=np.stack([weight_t(a.k_proj) for a in attns]),
        v_proj_weight=np.stack([weight_t(a.v_proj) for a in attns]),
        k_norm_weight=np.stack([a.k_norm.weight.detach().numpy() for a in attns]),
        norm_eps=eps.pop(),
        rope_theta=draft.config.rope_parameters["rope_theta"],
        rope_table=draft_rope_table(draft, MAX_POSITIONS),
        output_ids=output[0].numpy().copy(),
    )
