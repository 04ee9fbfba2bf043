import pytest
import torch
from peft.tuners.lora import LoraLayer

from oal.models import attached_kernels
from oal.training import apply_lora, trainable_parameters
from oal.training.config import FinetuneConfig
from oal.training.lora import is_kernel_parameter, load_trainable_state, trainable_state


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_targets_and_trainable_parameters(converted):
    model = converted()
    kernels = attached_kernels(model)
    groups = kernels[1].groups.clone()
    pm = apply_lora(model, FinetuneConfig())
    wrapped = sorted(n for n, m in pm.named_modules() if isinstance(m, LoraLayer))
    want = sorted(
        f"base_model.model.model.layers.{i}.self_attn.{p}"
        for i in range(3)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    assert wrapped == want  # every layer, softmax layer 0 included
    for n in wrapped:
        layer = pm.get_submodule(n)
        assert layer.r["default"] == 8 and layer.scaling["default"] == 2.0
        assert layer.lora_dropout["default"].p == 0.05
    trainable = trainable_parameters(pm)
    kernel_names = {n for n in trainable if is_kernel_parameter(n)}
    assert kernel_names == {
        "base_model.model.model.layers.1.self_attn.oal_kernel.L",
        "base_model.model.model.layers.2.self_attn.oal_kernel.theta",
    }
    assert all("lora_A" in n or "lora_B" in n for n in set(trainable) - kernel_names)
    assert len(trainable) == 2 + 2 * 12
    frozen = [n for n, p in pm.named_parameters() if not p.requires_grad]
    assert frozen and not any("lora_" in n or "oal_kernel" in n for n in frozen)
    # groups are a buffer, untouched by wrapping, and the kernels are the same objects
    assert "groups" in dict(kernels[1].named_buffers()) and torch.equal(kernels[1].groups, groups)
    assert pm.base_model.model.model.layers[1].self_attn.oal_kernel is kernels[1]


def test_kernel_parameters_can_stay_frozen(converted):
    pm = apply_lora(converted(), FinetuneConfig(train_kernels=False))
    assert not any(is_kernel_parameter(n) for n in trainable_parameters(pm))


def test_refuses_double_wrapping_and_unknown_targets(converted):
    pm = apply_lora(converted(), FinetuneConfig())
    with pytest.raises(ValueError, match="PeftModel"):
        apply_lora(pm, FinetuneConfig())
    model = converted()
    with pytest.raises(ValueError, match="lora_targets: expected one module named 'gate_proj_x' in layer 0"):
        apply_lora(model, FinetuneConfig(lora_targets=("q_proj", "gate_proj_x")))
    assert not any(isinstance(m, LoraLayer) for m in model.modules())  # refused before wrapping
    pm = apply_lora(converted(), FinetuneConfig(lora_targets=("q_proj", "gate_proj")))  # any per-layer module
    assert isinstance(pm.base_model.model.model.layers[2].mlp.gate_proj, LoraLayer)


def test_fresh_lora_keeps_the_oal_path(converted):
    ids = torch.randint(0, 97, (2, 21))
    base = converted()
    want = _logits(base, ids)
    softmax = _logits(converted({}), ids)
    assert not torch.allclose(want, softmax, atol=1e-4)  # the kernels matter for this model
    pm = apply_lora(converted(), FinetuneConfig())
    pm.eval()
    torch.testing.assert_close(_logits(pm, ids), want, rtol=0, atol=0)


def test_lora_and_kernel_updates_reach_the_output(converted):
    ids = torch.randint(0, 97, (1, 17))
    pm = apply_lora(converted(), FinetuneConfig())
    pm.eval()
    before = _logits(pm, ids)
    with torch.no_grad():
        pm.base_model.model.model.layers[1].self_attn.q_proj.lora_B["default"].weight.normal_()
    after_lora = _logits(pm, ids)
    assert not torch.allclose(before, after_lora)
    # the LoRA-wrapped projections feed the kernel: merging gives the same logits
    merged = pm.merge_and_unload()
    torch.testing.assert_close(_logits(merged, ids), after_lora, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        attached_kernels(merged)[1].L.mul_(1.5)
    assert not torch.allclose(_logits(merged, ids), after_lora)


def test_trainable_state_round_trip(converted):
    pm = apply_lora(converted(), FinetuneConfig())
    state = trainable_state(pm)
    with torch.no_grad():
        for p in trainable_parameters(pm).values():
            p.add_(1.0)
    load_trainable_state(pm, state)
    assert all(torch.equal(p, state[n]) for n, p in trainable_parameters(pm).items())
    with pytest.raises(ValueError, match="missing"):
        load_trainable_state(pm, {k: v for k, v in state.items() if "oal_kernel" not in k})
    bad = dict(state)
    key = next(iter(bad))
    bad[key] = torch.zeros(1)
    with pytest.raises(ValueError, match="shape"):
        load_trainable_state(pm, bad)
