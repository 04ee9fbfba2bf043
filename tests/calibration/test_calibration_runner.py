"""The layer runner: outputs, loading back, resuming after an interruption, and refusing to mix runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from oal.calibration import QKV, CalibrationConfig, calibrate_layer, calibrate_layers, load_calibrated
from oal.calibration.runner import load_calibrated_state
from oal.kernels import GlobalQuadraticKernel, OALKernel

CFG = CalibrationConfig(max_updates=60, val_every=20, patience=40, train_pool=40, val_positions=32)
Hq, Hkv, N, d, G = 3, 1, 40, 8, 2


def _qkv(S, gen):
    return QKV(
        torch.randn(S, Hq, N, d, generator=gen) * 1.5,
        torch.randn(S, Hkv, N, d, generator=gen),
        torch.randn(S, Hkv, N, d, generator=gen),
    )


@pytest.fixture(scope="module")
def layers():
    gen = torch.Generator().manual_seed(1)
    data = {i: (_qkv(2, gen), _qkv(1, gen)) for i in range(3)}
    groups = {i: torch.randint(0, G, (Hq, d), generator=gen) for i in range(3)}
    return data, groups


def _run(out, layers, calls=None, fail_at=None, config=CFG, description="synthetic", groups_override=None, bar=False):
    data, groups = layers
    groups = groups_override or groups

    def get(i):
        if calls is not None:
            calls.append(i)
        if i == fail_at:
            raise KeyboardInterrupt("simulated kill")
        return data[i]

    return calibrate_layers(
        lambda i: OALKernel(groups[i], Hkv, num_groups=G), get, [0, 1, 2], out,
        config=config, data_description=description, progress=bar,
    )  # fmt: skip


def test_outputs_and_loading(tmp_path, layers):
    summary = _run(tmp_path, layers, bar=True)
    params = load_file(str(tmp_path / "params.safetensors"))
    assert set(params) == {f"layers.{i}.{k}" for i in range(3) for k in ("groups", "L")}
    assert summary["kernel"] == "oal" and summary["data"] == "synthetic" and summary["config"] == CFG.to_dict()
    head = summary["layers"]["1"]["heads"][2]
    assert {"init", "val_mse", "val_mse_per_init", "updates", "groups"} <= set(head)
    assert json.loads((tmp_path / "run.json").read_text())["config"] == CFG.to_dict()
    # the stored parameters are those of calibrate_layer for the same layer index
    data, groups = layers
    direct = calibrate_layer(OALKernel(groups[1], Hkv, num_groups=G), *data[1], config=CFG, layer=1)
    kernel = load_calibrated(tmp_path, 1)
    assert isinstance(kernel, OALKernel) and torch.equal(kernel.L.detach(), direct.state["L"])
    assert torch.equal(kernel.groups, groups[1])
    # the learned global quadratic calibrated on the way is stored alongside
    glob = load_calibrated(tmp_path / "global", 1)
    assert isinstance(glob, GlobalQuadraticKernel) and torch.equal(glob.L.detach(), direct.global_stage.state["L"])
    # loading into a given instance, and errors
    into = load_calibrated(tmp_path / "params.safetensors", 2, OALKernel(groups[2], Hkv, num_groups=G))
    assert torch.equal(into.L.detach(), load_calibrated_state(tmp_path, 2)["L"])
    with pytest.raises(ValueError, match="layer"):
        load_calibrated_state(tmp_path, 7)
    with pytest.raises(ValueError, match="path"):
        load_calibrated(tmp_path / "missing", 0)


def test_resume_reproduces_an_uninterrupted_run(tmp_path, layers):
    full = tmp_path / "full"
    _run(full, layers)
    part = tmp_path / "part"
    calls: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        _run(part, layers, calls=calls, fail_at=2)
    assert calls == [0, 1, 2]  # killed while fetching layer 2
    assert set(load_file(str(part / "params.safetensors"))) == {
        f"layers.{i}.{k}" for i in (0, 1) for k in ("groups", "L")
    }
    # a kill between a layer's shard and its JSON (the commit marker) leaves debris: the layer is redone
    (part / "layers" / "layer_002.safetensors").write_bytes(b"partial")
    (part / "layers" / "layer_002.json.tmp").write_text("{")
    calls.clear()
    _run(part, layers, calls=calls)
    assert calls == [2]  # finished layers are not redone
    a, b = load_file(str(full / "params.safetensors")), load_file(str(part / "params.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (full, part))
    for s in (sa, sb):  # everything but wall-clock times is reproduced
        for layer in s["layers"].values():
            for entry in (layer, layer["global_stage"]):
                entry.pop("seconds")
                entry.pop("timings")
    assert sa == sb


def test_mismatch_is_an_error(tmp_path, layers):
    _run(tmp_path, layers)
    with pytest.raises(ValueError, match="config"):
        _run(tmp_path, layers, config=dataclasses.replace(CFG, lr=0.01))
    with pytest.raises(ValueError, match="data"):
        _run(tmp_path, layers, description="other data")
    data, groups = layers
    other = {i: (g + 1) % G for i, g in groups.items()}
    with pytest.raises(ValueError, match="groups"):
        _run(tmp_path, layers, groups_override=other)


def test_bad_layers(tmp_path, layers):
    with pytest.raises(ValueError, match="layers"):
        calibrate_layers(lambda i: None, lambda i: None, [0, 0], tmp_path, config=CFG, progress=False)


def test_baseline_roundtrip(tmp_path, layers):
    """Any registry kernel is rebuilt from the stored config and state (here SpectraFormer: shared B, G, S)."""
    from oal.kernels.registry import build_kernel

    data, _ = layers
    d8 = {i: tuple(QKV(x.q[..., :8], x.k[..., :8], x.v[..., :8]) for x in pair) for i, pair in data.items()}
    cfg = dataclasses.replace(CFG, max_updates=20, val_every=10)
    make = lambda i: build_kernel("spectraformer", num_heads=Hq, num_kv_heads=Hkv, head_dim=8, layer_idx=i)  # noqa: E731
    calibrate_layers(make, lambda i: d8[i], [1], tmp_path, config=cfg, progress=False)
    kernel = load_calibrated(tmp_path, 1)
    assert type(kernel).__name__ == "SpectraFormerKernel"
    stored = load_calibrated_state(tmp_path, 1)
    assert all(torch.equal(v, stored[k]) for k, v in kernel.state_dict().items())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layers"]["1"]["selection"] == "per_layer"
    assert not (tmp_path / "global").exists()
