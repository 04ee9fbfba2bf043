"""Layer calibration: recovery of a known optimum, error reduction on softmax, fast == generic path,
per-head independence, determinism, and the generic path for other kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oal.calibration import QKV, CalibrationConfig, calibrate_layer
from oal.kernels import AttentionKernel, GlobalQuadraticKernel, OALKernel, SoftmaxKernel, repeat_kv
from oal.kernels.base import check_positions

FAST = CalibrationConfig(max_updates=150, val_every=25, patience=100, train_pool=48, val_positions=40)


def _qkv(S, Hq, Hkv, N, d, dv=None, spread=1.5):
    dv = d if dv is None else dv
    return QKV(torch.randn(S, Hq, N, d) * spread, torch.randn(S, Hkv, N, d), torch.randn(S, Hkv, N, dv))


def _groups(Hq, d, G):
    g = torch.randint(0, G, (Hq, d))
    g[:, :G] = torch.arange(G)
    return g


def test_recovers_a_known_optimum():
    """Target = an OAL kernel with known L*: from the Taylor init, calibration drives the output error to
    ~0 and recovers M* = L*L*ᵀ up to the scale the normalised output cannot see."""
    Hq, Hkv, N, d, G = 2, 1, 80, 8, 2
    groups = _groups(Hq, d, G)
    L_star = torch.tensor(
        [[[0.3, 0, 0], [0.9, 0.6, 0], [-0.4, 0.2, 1.1]], [[1.2, 0, 0], [0.1, 0.4, 0], [0.5, -0.7, 0.5]]]
    )
    target = OALKernel(groups, Hkv, num_groups=G, L=L_star)
    train, val = _qkv(4, Hq, Hkv, N, d), _qkv(1, Hq, Hkv, N, d)
    cfg = CalibrationConfig(
        max_updates=1000, val_every=50, patience=400, train_pool=None, val_positions=None,
        global_inits=("taylor",), oal_inits=("taylor",),
    )  # fmt: skip
    res = calibrate_layer(OALKernel(groups, Hkv, num_groups=G), train, val, config=cfg, target=target)
    assert res.inits == ("taylor",)
    init_err, err = res.init_val_mse[0], res.val_mse
    assert (err < 1e-2 * init_err).all(), (err, init_err)
    L = res.state["L"].tril()
    M, M_star = L @ L.mT, L_star.tril() @ L_star.tril().mT
    unit = lambda x: x / x.flatten(-2).norm(dim=-1)[:, None, None]  # noqa: E731
    torch.testing.assert_close(unit(M), unit(M_star), atol=0.03, rtol=0)
    # the global stage cannot represent a grouped target: it stays well above OAL
    assert (res.global_stage.val_mse > 10 * err).all()


def test_reduces_error_against_softmax():
    Hq, Hkv, N, d, G = 3, 1, 96, 16, 3
    train, val = _qkv(3, Hq, Hkv, N, d), _qkv(1, Hq, Hkv, N, d)
    res = calibrate_layer(OALKernel(_groups(Hq, d, G), Hkv, num_groups=G), train, val, config=FAST)
    assert res.kernel == "oal" and res.inits == ("global", "taylor", "global_perturbed")
    taylor = res.inits.index("taylor")
    assert (res.val_mse < 0.9 * res.init_val_mse[taylor]).all()
    # per head, the kept checkpoint is the best over inits, and never worse than an initialisation
    torch.testing.assert_close(res.val_mse, res.val_mse_per_init.min(0).values)
    assert (res.val_mse_per_init <= res.init_val_mse).all()
    # init 0 is the embedded calibrated global: it starts exactly at the global's best validation error
    torch.testing.assert_close(res.init_val_mse[0], res.global_stage.val_mse)
    assert (res.val_mse <= res.global_stage.val_mse).all()
    assert res.state["groups"].shape == (Hq, d) and res.state["L"].shape == (Hq, G + 1, G + 1)
    summary = res.summary()
    assert len(summary["heads"]) == Hq and summary["global_stage"]["kernel"] == "global"
    assert summary["heads"][0]["init"] in res.inits and "groups" in summary["heads"][0]


@pytest.mark.parametrize("Hkv", [1, 3])
def test_fast_path_equals_generic_path(Hkv):
    Hq, N, d, G = 3, 40, 8, 2
    train, val = _qkv(2, Hq, Hkv, N, d, dv=5), _qkv(1, Hq, Hkv, N, d, dv=5)
    kernel = OALKernel(_groups(Hq, d, G), Hkv, num_groups=G)
    cfg = dataclasses.replace(
        FAST,
        max_updates=40,
        val_every=10,
        patience=20,
        global_inits=("taylor_perturbed",),
        oal_inits=("global", "taylor"),
    )
    fast = calibrate_layer(kernel, train, val, config=cfg)
    slow = calibrate_layer(kernel, train, val, config=dataclasses.replace(cfg, fast_path=False))
    for a, b in ((fast, slow), (fast.global_stage, slow.global_stage)):
        torch.testing.assert_close(a.init_val_mse, b.init_val_mse, rtol=1e-4, atol=0)
        torch.testing.assert_close(a.val_mse_per_init, b.val_mse_per_init, rtol=2e-3, atol=0)
        assert a.chosen_init == b.chosen_init
        assert torch.equal(a.best_update, b.best_update) and torch.equal(a.updates, b.updates)
        torch.testing.assert_close(a.state["L"], b.state["L"], rtol=0, atol=2e-3)


def test_heads_are_independent():
    """Fitting two heads jointly equals fitting each alone (same seed, hence same schedule)."""
    N, d, G = 48, 8, 2
    train, val = _qkv(2, 2, 1, N, d), _qkv(1, 2, 1, N, d)
    groups = _groups(2, d, G)
    cfg = dataclasses.replace(FAST, global_inits=("taylor",), oal_inits=("global", "taylor"))
    joint = calibrate_layer(OALKernel(groups, 1, num_groups=G), train, val, config=cfg)
    for h in range(2):
        tr, va = (QKV(x.q[:, h : h + 1], x.k, x.v) for x in (train, val))
        alone = calibrate_layer(OALKernel(groups[h : h + 1], 1, num_groups=G), tr, va, config=cfg)
        for a, b in ((joint, alone), (joint.global_stage, alone.global_stage)):
            torch.testing.assert_close(a.state["L"][h : h + 1], b.state["L"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a.val_mse_per_init[:, h : h + 1], b.val_mse_per_init, rtol=1e-6, atol=0)
            assert torch.equal(a.best_update[:, h : h + 1], b.best_update)
            assert torch.equal(a.updates[:, h : h + 1], b.updates)
            assert a.chosen_init[h] == b.chosen_init[0]


def test_deterministic_per_layer_seed():
    Hq, Hkv, N, d = 2, 2, 32, 8
    train, val = _qkv(2, Hq, Hkv, N, d), _qkv(1, Hq, Hkv, N, d)
    kernel = GlobalQuadraticKernel(Hq, Hkv, d)
    cfg = dataclasses.replace(FAST, max_updates=50)
    a = calibrate_layer(kernel, train, val, config=cfg, layer=3)
    b = calibrate_layer(kernel, train, val, config=cfg, layer=3)
    c = calibrate_layer(kernel, train, val, config=cfg, layer=4)
    assert torch.equal(a.state["L"], b.state["L"]) and torch.equal(a.val_mse_per_init, b.val_mse_per_init)
    assert not torch.equal(a.state["L"], c.state["L"])
    assert a.kernel == "global" and a.global_stage is None and a.inits == cfg.global_inits
    assert torch.equal(kernel.L, GlobalQuadraticKernel(Hq, Hkv, d).L)  # the input kernel is untouched


class TemperatureSoftmax(AttentionKernel):
    """Toy baseline: softmax with a trainable per-head temperature (or a shared one)."""

    name = "temperature"

    def __init__(self, Hq, Hkv, d, init=0.4, shared=False, shape=None, declare=True):
        super().__init__(Hq, Hkv, d)
        self.tau = torch.nn.Parameter(torch.full(shape or ((1,) if shared else (Hq,)), init))
        if declare:
            self.shared_parameters = ("tau",) if shared else ()

    def weights(self, q, k, positions):
        positions = check_positions(positions, q.shape[2])
        logits = (q[:, :, positions].float() @ repeat_kv(k.float(), self.num_heads).mT) * self.scale
        logits = logits * self.tau.reshape(-1)[None, :, None, None].expand(1, self.num_heads, 1, 1)
        logits = logits.masked_fill(~self.causal_mask(positions, k.shape[2]), float("-inf"))
        return torch.exp(logits - logits.amax(-1, keepdim=True))


@pytest.mark.parametrize(("shared", "declare"), [(False, True), (True, True), (True, False)])
def test_generic_kernel(shared, declare):
    Hq, Hkv, N, d = 3, 1, 40, 8
    train, val = _qkv(2, Hq, Hkv, N, d), _qkv(1, Hq, Hkv, N, d)
    cfg = dataclasses.replace(FAST, max_updates=80, val_every=20, patience=60)
    res = calibrate_layer(TemperatureSoftmax(Hq, Hkv, d, shared=shared, declare=declare), train, val, config=cfg)
    assert res.selection == ("per_layer" if shared else "per_head")
    assert res.inits == ("natural",) and res.chosen_init == (0,) * Hq
    assert res.val_mse.shape == (Hq,) and (res.val_mse < 0.5 * res.init_val_mse[0]).all()
    tau = res.state["tau"]
    assert ((tau - 1).abs() < (0.4 - 1.0) * -0.5).all()  # moved well towards the softmax temperature 1
    if shared:
        assert torch.equal(res.best_update, res.best_update[:, :1].expand(1, Hq))


def test_generic_kernel_rejects_a_per_head_parameter_without_heads():
    train, val = _qkv(1, 2, 1, 40, 4), _qkv(1, 2, 1, 16, 4)
    with pytest.raises(ValueError, match="shared_parameters"):
        calibrate_layer(TemperatureSoftmax(2, 1, 4, shape=(5,)), train, val, config=FAST)


def test_nothing_to_calibrate():
    Hq, Hkv, N, d = 2, 1, 40, 4
    train, val = _qkv(2, Hq, Hkv, N, d), _qkv(1, Hq, Hkv, N, d)
    res = calibrate_layer(lambda: SoftmaxKernel(Hq, Hkv, d), train, val, config=FAST)
    assert res.selection == "none" and res.state == {} and res.updates.sum() == 0
    assert (res.val_mse < 1e-12).all()


def test_input_validation():
    kernel = GlobalQuadraticKernel(2, 1, 4)
    good = _qkv(1, 2, 1, 40, 4)
    with pytest.raises(ValueError, match="train"):
        calibrate_layer(kernel, _qkv(1, 3, 1, 40, 4), good, config=FAST)
    with pytest.raises(ValueError, match="val"):
        calibrate_layer(kernel, good, QKV(good.q, good.k, good.v[..., :3]), config=FAST)
    with pytest.raises(ValueError, match="train"):
        calibrate_layer(kernel, QKV(good.q, good.k[:, :, :5], good.v), good, config=FAST)
    with pytest.raises(ValueError, match="positions_per_update"):
        calibrate_layer(kernel, _qkv(1, 2, 1, 16, 4), good, config=dataclasses.replace(FAST, train_pool=None))
    with pytest.raises(ValueError, match="kernel"):
        calibrate_layer(3, good, good, config=FAST)


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", 0.0), ("max_updates", 0), ("patience", -1), ("train_pool", 8), ("oal_inits", ("nope",)),
     ("global_inits", ()), ("perturb_std", -0.1), ("val_positions", 0)],
)  # fmt: skip
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        CalibrationConfig(**{field: value})


def test_config_roundtrip():
    cfg = dataclasses.replace(FAST, oal_inits=("taylor", "global"))
    assert CalibrationConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        CalibrationConfig.from_dict({"learning_rate": 1})


@pytest.mark.parametrize(
    ("name", "selection"),
    [("performer", "none"), ("spectraformer", "per_layer"), ("dijiang", "per_head"), ("taylorshift", "per_head"),
     ("global+sink+window", "per_head")],
)  # fmt: skip
def test_registry_kernels(name, selection):
    """The F.1 baselines (and the sink/window variant) through the generic path with their natural init."""
    from oal.kernels.registry import build_kernel

    Hq, Hkv, N, d = 3, 1, 40, 8
    train, val = _qkv(2, Hq, Hkv, N, d), _qkv(1, Hq, Hkv, N, d)
    extra = {"n_sink": 2, "window": 4} if "+" in name else {}
    kernel = build_kernel(name, num_heads=Hq, num_kv_heads=Hkv, head_dim=d, layer_idx=1, **extra)
    cfg = dataclasses.replace(FAST, max_updates=20, val_every=10, patience=10)
    res = calibrate_layer(kernel, train, val, config=cfg, layer=1)
    assert res.selection == selection and res.kernel == kernel.name
    assert res.meta["kernel_config"]["name"] == kernel.name
    assert res.val_mse.shape == (Hq,) and res.init_val_mse.shape == (1, Hq)
    assert (res.val_mse <= res.init_val_mse[0] + 1e-12).all() and torch.isfinite(res.val_mse).all()
    assert set(res.state) == set(kernel.state_dict())
    assert [h["head"] for h in res.summary()["heads"]] == list(range(Hq))
