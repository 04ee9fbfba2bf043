import pytest

from oal.training import PRESETS, FinetuneConfig, preset


def test_defaults_are_the_paper_protocol():
    c = FinetuneConfig()
    assert (c.lora_rank, c.lora_alpha, c.lora_dropout) == (8, 16.0, 0.05)
    assert c.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert (c.lr, c.weight_decay, c.betas, c.adam_eps) == (5e-4, 0.01, (0.9, 0.999), 1e-8)
    assert (c.warmup_ratio, c.max_grad_norm, c.seed) == (0.05, 1.0, 42)
    assert (c.updates, c.block_len, c.val_every, c.val_blocks) == (512, 4096, 128, 32)
    assert preset("paper").protocol() == c.protocol()
    assert c.warmup_updates == 26  # ceil(0.05 · 512)


def test_presets_and_overrides():
    assert set(PRESETS) == {"paper", "cpu", "smoke"}
    c = preset("cpu", seed=7)
    assert c.preset == "cpu" and c.seed == 7 and c.updates == PRESETS["cpu"]["updates"]
    with pytest.raises(ValueError, match="preset"):
        preset("gpu")


def test_round_trip():
    c = preset("smoke", betas=(0.8, 0.99), lora_targets=["q_proj", "v_proj"])
    assert c.lora_targets == ("q_proj", "v_proj")
    assert FinetuneConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown fields"):
        FinetuneConfig.from_dict({**c.to_dict(), "lr_schedule": "linear"})


@pytest.mark.parametrize(
    "field,value",
    [
        ("updates", 0),
        ("block_len", 1),
        ("val_every", 1.5),
        ("lora_rank", True),
        ("lr", 0.0),
        ("lora_dropout", 1.0),
        ("warmup_ratio", 1.5),
        ("betas", (0.9,)),
        ("mixed_precision", "fp16"),
        ("seed", -1),
        ("checkpoint_every", 0),
        ("lora_targets", ()),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FinetuneConfig(**{field: value})


def test_validation_and_checkpoint_steps():
    c = FinetuneConfig(updates=10, val_every=4, checkpoint_every=3)
    assert [s for s in range(1, 11) if c.is_validation_step(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if c.is_checkpoint_step(s)] == [3, 4, 6, 8, 9, 10]
