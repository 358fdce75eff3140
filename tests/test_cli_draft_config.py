"""``run --draft-config PATH``: a draft's config.json in z-lab's / Hugging Face's form gives the
workload its geometry; the presets are such files, read by the same reader, and read what z-lab's
``DFlashDraftModel`` reads; a field that cannot be used exits 2 before the run, naming it, what
was expected and what was given. Also the names: one scheme for formats and presets, the other
spellings as aliases, and "did you mean" for a wrong one."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json

import numpy as np
import pytest

from jax_dflash.cli import draft_config, plan, presets, workload
from jax_dflash.cli.presets import PRESETS
from test_cli import run_cli

CONFIGS = importlib.resources.files("jax_dflash.cli").joinpath("configs")
# A small draft of the user's: z-lab's fields, a scaled RoPE, and a CPU-sized pool.
USER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "torch_dtype": "bfloat16",
    "dflash_config": {"block_size": 4, "target_layer_ids": [1, 5, 9]},
    "block_size": 16,  # dflash_config's comes first, as in z-lab's reader
    "jax_dflash": {
        "page_size": 8,
        "pages_per_slot": 8,
        "num_slots": 4,
        "default_batch": 4,
        "default_steps": 3,
        "gpu_sized": False,
    },
}


def _write(tmp_path, config, folder="my-draft") -> str:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config) if isinstance(config, dict) else config)
    return str(path)


def _config(**changes) -> dict:
    config = json.loads(json.dumps(USER_CONFIG))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


# ---- the presets are configs --------------------------------------------------------------------

# (layers, KV heads, D, rotary dim, hidden, block, target layers, window, page size, slots)
PRESET_GEOMETRY = {
    "tiny": (2, 2, 32, 32, 64, 8, 2, None, 8, 4),
    "small": (5, 4, 64, 64, 256, 16, 2, None, 16, 16),
    "qwen3-4b-b16": (5, 8, 128, 128, 2560, 16, 5, None, 128, 64),
    "qwen3-8b-b16": (5, 8, 128, 128, 4096, 16, 5, None, 128, 64),
    "llama3.1-8b-b10": (5, 8, 128, 128, 4096, 10, 5, None, 128, 64),
    "kimi-k2.5-b8": (6, 8, 128, 128, 7168, 8, 5, None, 128, 64),
    "qwen3.5-27b-b16": (5, 4, 256, 64, 5120, 16, 5, None, 128, 64),
    "dflash2-b8-w2048": (5, 8, 128, 128, 4096, 8, 5, 2048, 128, 32),
}


def test_every_preset_is_a_config_file_read_by_the_reader():
    files = sorted(e.name for e in CONFIGS.iterdir() if e.name.endswith(".json"))
    assert files == sorted(f"{name}.json" for name in PRESETS)
    assert set(PRESET_GEOMETRY) == set(PRESETS)
    for name, p in PRESETS.items():
        config = json.loads(CONFIGS.joinpath(f"{name}.json").read_text())
        assert presets.from_config(config, name=name, source=name) == p
        shape = (p.num_layers, p.num_kv_heads, p.head_dim, p.rope_dim, p.hidden_size)
        shape += (p.block_size, p.target_layers, p.window, p.page_size, p.num_slots)
        assert shape == PRESET_GEOMETRY[name], name
        assert p.default_contract == ("paged" if p.window else "slot")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_presets_rope_table_builds(name):
    p = PRESETS[name]
    table = plan.rope_table(64, p.rope_dim, p.rope_theta, p.rope_scaling)
    assert table.shape == (1, 64, p.rope_dim) and np.isfinite(table).all()


@pytest.mark.skipif(
    importlib.util.find_spec("dflash") is None or importlib.util.find_spec("transformers") is None,
    reason="z-lab's dflash and transformers are not installed (make oracle installs them)",
)
@pytest.mark.parametrize("name", [*PRESETS, "user"])
def test_the_reader_reads_what_zlab_reads(name, tmp_path):
    """Each config through transformers' Qwen3Config, read as DFlashDraftModel and its layers
    read it (dflash/model.py), against this reader."""
    from dflash.model import _draft_value, build_target_layer_ids
    from transformers import Qwen3Config

    config = (
        USER_CONFIG if name == "user" else json.loads(CONFIGS.joinpath(f"{name}.json").read_text())
    )
    p = PRESETS.get(name) or presets.read_draft_config(_write(tmp_path, config))
    zlab = Qwen3Config(**{k: v for k, v in config.items() if k != "jax_dflash"})
    layers = zlab.num_hidden_layers
    ids = _draft_value(zlab, "target_layer_ids", None) or build_target_layer_ids(
        zlab.num_target_layers, layers
    )
    windows = {
        zlab.sliding_window if zlab.layer_types[i] == "sliding_attention" else None
        for i in range(layers)
    }
    assert (p.num_layers, p.num_kv_heads, p.head_dim) == (
        layers,
        zlab.num_key_value_heads,
        getattr(zlab, "head_dim", zlab.hidden_size // zlab.num_attention_heads),
    )
    assert (p.hidden_size, p.target_layers) == (zlab.hidden_size, len(ids))
    assert p.block_size == int(_draft_value(zlab, "block_size", 16))
    assert windows == {p.window} and p.norm_eps == zlab.rms_norm_eps
    assert p.rope_theta == zlab.rope_parameters["rope_theta"]
    factor = zlab.rope_parameters.get("partial_rotary_factor", 1.0)
    assert p.rope_dim == int(p.head_dim * factor)
    assert (p.rope_scaling is None) == (zlab.rope_parameters["rope_type"] == "default")


# ---- a user's config ----------------------------------------------------------------------------


def test_a_users_config_runs_with_its_geometry(capsys, tmp_path):
    path = _write(tmp_path, USER_CONFIG)
    status, out, err = run_cli(capsys, "run", "--draft-config", path, "--json", "--no-progress")
    assert status == 0, err
    s = json.loads(out)
    assert (s["preset"], s["draft_config"], s["steps"], s["batch"]) == ("my-draft", path, 3, 4)
    shape = s["shape"]
    assert (shape["layers"], shape["num_kv_heads"], shape["head_dim"]) == (2, 2, 32)
    assert (shape["block_size"], shape["target_layers"], shape["feature_size"]) == (4, 3, 192)
    assert shape["norm_eps"] == 1e-5 and shape["rope_theta"] == 500000.0
    assert shape["rope_scaling"]["rope_type"] == "llama3"
    [kernel] = s["results"]
    assert kernel["check"] == "bit-exact" and kernel["readback"]["passed"]
    assert err.startswith(f"jax-dflash run: draft config {path}\n")


def test_a_sliding_window_config_runs_paged_with_ring_pages(capsys, tmp_path):
    config = _config(layer_types=["sliding_attention"] * 2, use_sliding_window=True)
    config["sliding_window"] = 16
    path = _write(tmp_path, config)
    status, out, err = run_cli(capsys, "run", "--draft-config", path, "--json", "--no-progress")
    assert status == 0, err
    s = json.loads(out)
    assert s["contract"] == "paged" and s["window"] == 16 and s["paged"]["ring"]
    assert s["results"][0]["check"] == "bit-exact"


def test_a_config_without_simulation_choices_gets_the_gpu_presets_pool(capsys, tmp_path):
    path = _write(tmp_path, _config(jax_dflash=None))
    p = presets.read_draft_config(path)
    assert (p.page_size, p.pages_per_slot, p.num_slots, p.gpu_sized) == (128, 16, 64, True)
    status, out, err = run_cli(capsys, "run", "--draft-config", path, "--backend", "cpu")
    assert status == 2 and out == "" and err.count("\n") == 1
    assert f"draft config {path} is GPU-sized" in err and "--force" in err


def test_a_preset_and_a_draft_config_exclude_each_other(capsys, tmp_path):
    path = _write(tmp_path, USER_CONFIG)
    status, _, err = run_cli(capsys, "run", "--preset", "tiny", "--draft-config", path)
    assert status == 2 and "argument --draft-config: not allowed with argument --preset" in err


MIXED = ["full_attention", "sliding_attention"]


@pytest.mark.parametrize(
    "changes, reason",
    [
        (
            dict(layer_types=MIXED, use_sliding_window=True, sliding_window=16),
            "layer_types: expected every layer of one kind (the run keeps one page table for "
            "every layer",
        ),
        (dict(layer_types=["full_attention"]), "layer_types: expected a list of 2"),
        (
            dict(num_key_value_heads="2"),
            "num_key_value_heads: expected an integer >= 1, got '2'",
        ),
        (dict(num_key_value_heads=3), "num_key_value_heads: expected a divisor of"),
        (
            dict(head_dim=None),
            "head_dim: expected an integer >= 2, got nothing (the field is missing)",
        ),
        (dict(head_dim=33), "head_dim: expected an even number"),
        (dict(num_hidden_layers=0), "num_hidden_layers: expected an integer >= 1, got 0"),
        (
            dict(rope_parameters={"rope_type": "default"}),
            "rope_theta: expected a finite number > 0, got nothing",
        ),
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}),
            "rope_parameters.rope_type: expected one of default, linear, llama3, yarn, got "
            "'dynamic'",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
            "rope_scaling / rope_parameters: scaling: rope_type 'llama3' needs",
        ),
        (
            dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.3}),
            "partial_rotary_factor: expected a share of head_dim 32 that is an even number",
        ),
        (
            dict(torch_dtype="float64"),
            "torch_dtype: expected one of float16, bfloat16, float32, got 'float64'",
        ),
        (dict(rms_norm_eps=0.0), "rms_norm_eps: expected a finite number > 0, got 0.0"),
        (
            dict(dflash_config={"block_size": 4}),
            "target_layer_ids: expected a list of the target layers the draft reads (or "
            "num_target_layers), got nothing",
        ),
        (
            dict(jax_dflash={"page": 8}),
            "jax_dflash: expected an object of page_size, pages_per_slot",
        ),
        (dict(jax_dflash={"num_slots": 0}), "num_slots: expected an integer >= 1, got 0"),
    ],
)
def test_a_field_that_cannot_be_used_exits_2_before_the_run(
    capsys, monkeypatch, tmp_path, changes, reason
):
    monkeypatch.setattr(workload, "Workload", None)  # building it would raise TypeError
    path = _write(tmp_path, _config(**changes))
    status, out, err = run_cli(capsys, "run", "--draft-config", path)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"jax-dflash: error: --draft-config {path}: "), err
    assert reason in err


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "expected JSON, got an error at line 1 column 2"),
        ("[1, 2]", "the config: expected a JSON object, got list"),
    ],
)
def test_a_file_that_is_no_config_exits_2(capsys, tmp_path, text, reason):
    path = _write(tmp_path, text)
    status, _, err = run_cli(capsys, "run", "--draft-config", path)
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"jax-dflash: error: --draft-config {path}: {reason}")


def test_a_missing_file_exits_2(capsys, tmp_path):
    path = str(tmp_path / "nowhere" / "config.json")
    status, _, err = run_cli(capsys, "run", "--draft-config", path)
    assert status == 2
    assert (
        err
        == f"jax-dflash: error: --draft-config {path}: cannot read it (No such file or directory)\n"
    )


def test_a_window_the_pages_cannot_hold_names_the_config_field(capsys, tmp_path):
    config = _config(layer_types=["sliding_attention"] * 2, use_sliding_window=True)
    config["sliding_window"] = 12
    path = _write(tmp_path, config)
    status, _, err = run_cli(capsys, "run", "--draft-config", path)
    assert status == 2 and err.count("\n") == 1
    assert (
        f"--draft-config {path}: sliding_window 12: expected a positive multiple of the page "
        in err
    )


def test_a_window_without_use_sliding_window_is_no_window(tmp_path):
    """As in Qwen3Config, which drops sliding_window unless use_sliding_window."""
    config = _config(layer_types=MIXED, sliding_window=16)
    assert presets.read_draft_config(_write(tmp_path, config)).window is None


def test_target_layers_from_their_count_as_zlab_builds_them():
    assert draft_config.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert draft_config.build_target_layer_ids(36, 1) == [18]


# ---- names --------------------------------------------------------------------------------------


def test_short_format_names_are_aliases_of_one_scheme(capsys):
    base = ("run", "--preset", "tiny", "--steps", "2", "--no-check", "--json", "--no-progress")
    shapes = []
    for flags in (("--dtype", "bf16", "--kv-dtype", "e4m3"), ("--kv-dtype", "float8_e4m3fn")):
        status, out, err = run_cli(capsys, *base, *flags)
        assert status == 0, err
        shapes.append(json.loads(out)["shape"])
    assert shapes[0]["pool_dtype"] == shapes[1]["pool_dtype"] == "float8_e4m3fn"
    assert shapes[0]["delta_dtype"] == "bfloat16"


def test_an_old_preset_name_is_an_alias(capsys, monkeypatch):
    monkeypatch.setattr(workload, "Workload", None)
    status, _, err = run_cli(capsys, "run", "--preset", "qwen3.5-27b", "--backend", "cpu")
    assert status == 2 and "preset qwen3.5-27b-b16 is GPU-sized" in err


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["--preset", "qwen3-8b"], "'qwen3-8b-b16'"),
        (["--kv-dtype", "e4m3fn"], "'e4m3'"),
        (["--kv-dtype", "float8_e4m3"], "'float8_e4m3fn'"),
        (["--dtype", "bfloat"], "'bfloat16'"),
        (["--contract", "pagd"], "'paged'"),
    ],
)
def test_a_wrong_name_gets_did_you_mean(capsys, argv, suggestion):
    status, out, err = run_cli(capsys, "run", *argv)
    last = err.strip().splitlines()[-1]
    assert status == 2 and out == ""
    assert f"argument {argv[0]}: invalid choice: {argv[1]!r} (did you mean {suggestion}?)" in last
    assert "expected one of" in last
