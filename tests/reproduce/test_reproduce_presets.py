"""Presets of ``oal reproduce``: the paper's numbers, validation, overrides and the command-line parsing."""

from __future__ import annotations

import pytest

from oal.calibration.config import CalibrationConfig
from oal.reproduce import PAPER_METHODS, PRESETS, ReproducePreset, preset
from oal.reproduce.cli import parse_field, parse_methods
from oal.training.config import PRESETS as FINETUNE_PRESETS


def test_paper_preset_is_the_paper():
    p = PRESETS["paper"]
    assert p.methods == PAPER_METHODS and p.layers is None
    assert (p.calib_seq_len, p.fidelity_seq_len, p.eval_block_len) == (4096, 4096, 4096)
    assert p.calib_train_blocks == tuple(range(16, 24)) and p.calib_val_blocks == (24, 25)  # App. B
    assert p.fidelity_layers == (4, 12, 20) and p.fidelity_blocks == tuple(range(16))  # Table 2, App. C
    assert p.calibration_config() == CalibrationConfig()  # App. B protocol
    ft = p.finetune_config()  # F.2: 512 x 4096, validation every 128 on 32 blocks, seed 42, LoRA r 8 / α 16
    assert (ft.updates, ft.block_len, ft.val_every, ft.val_blocks, ft.seed) == (512, 4096, 128, 32, 42)
    assert (ft.lora_rank, ft.lora_alpha, ft.lr) == (8, 16.0, 5e-4)
    assert p.eval_max_blocks is None and p.eval_limit is None


def test_cpu_and_demo_presets():
    cpu, demo = PRESETS["cpu"], PRESETS["demo"]
    assert cpu.calib_seq_len == 4096 and cpu.calib_max_updates < 1000
    assert cpu.finetune_updates == FINETUNE_PRESETS["cpu"]["updates"]
    assert cpu.finetune_block_len == FINETUNE_PRESETS["cpu"]["block_len"]
    assert cpu.eval_block_len == 1024 and cpu.eval_limit == 200
    assert demo.layers is None  # the conversion range stays the model's default
    assert demo.calib_seq_len == 512 and demo.finetune_updates == 4 and demo.eval_limit == 10
    for p in PRESETS.values():
        assert set(p.methods) == set(PAPER_METHODS)


def test_overrides_and_round_trip():
    p = preset("cpu", calib_seq_len=2048, fidelity_blocks=[0, 1], eval_limit=None, methods=["oal", "softmax"])
    assert p.calib_seq_len == 2048 and p.fidelity_blocks == (0, 1) and p.methods == ("oal", "softmax")
    assert p.name == "cpu" and PRESETS["cpu"].calib_seq_len == 4096  # presets are not modified
    assert ReproducePreset(**{k: tuple(v) if isinstance(v, list) else v for k, v in p.to_dict().items()}) == p
    assert preset("demo", name="micro").name == "micro"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"methods": ("oal", "hedgehog")}, r"methods: unknown \['hedgehog'\]"),
        ({"methods": ("oal", "oal")}, "each once"),
        ({"calib_val_blocks": (16,)}, "disjoint"),
        ({"calib_train_pool": 8}, "calib_.*train_pool"),
        ({"calib_oal_inits": ("random",)}, "oal_inits"),
        ({"finetune_mixed_precision": "fp8"}, "mixed_precision"),
        ({"finetune_updates": 0}, "finetune_updates: expected an integer ≥ 1"),
        ({"eval_limit": 0}, "eval_limit"),
        ({"fidelity_layers": ()}, "fidelity_layers"),
        ({"typo": 1}, "unknown fields"),
    ],
)
def test_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        preset("demo", **overrides)
    with pytest.raises(ValueError, match="preset"):
        preset("huge")


def test_command_line_values():
    assert parse_field("calib_seq_len", "512") == 512
    assert parse_field("calib_train_pool", "none") is None and parse_field("eval_limit", "20") == 20
    assert parse_field("calib_train_blocks", "16-18,20") == (16, 17, 18, 20)
    assert parse_field("calib_oal_inits", "global, taylor") == ("global", "taylor")
    assert parse_field("group_alpha", "0.25") == 0.25 and parse_field("layers", "3-26") == "3-26"
    assert parse_methods("paper,oal+sink+window") == (*PAPER_METHODS, "oal+sink+window")
    with pytest.raises(ValueError, match="expected an integer, got 'abc'"):
        parse_field("calib_seq_len", "abc")
    with pytest.raises(ValueError, match="or none"):
        parse_field("eval_limit", "x")
    with pytest.raises(ValueError, match="indices"):
        parse_field("fidelity_layers", "4-2")
