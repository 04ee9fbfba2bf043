"""build_kernel / kernel_config / kernel_from_config for every kernel name, including OAL and the global one."""

from __future__ import annotations

import json

import pytest
import torch

from oal.kernels import (
    KERNELS,
    GlobalQuadraticKernel,
    OALKernel,
    SoftmaxKernel,
    build_kernel,
    kernel_config,
    kernel_from_config,
    oal_attention,
)

DIMS = dict(num_heads=4, num_kv_heads=2, head_dim=8)


def groups():
    return torch.tensor([[0] * 6 + [1, 2]] * 2 + [[0] * 7 + [1]] * 2)


def qkv(n=17):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, 4, n, 8, generator=g),
        torch.randn(1, 2, n, 8, generator=g),
        torch.randn(1, 2, n, 3, generator=g),
    )


def test_every_name_builds_and_round_trips():
    assert set(KERNELS) == {"softmax", "global", "oal", "performer", "spectraformer", "dijiang", "taylorshift"}
    q, k, v = qkv()
    for name in KERNELS:
        kw = {"groups": groups()} if name == "oal" else {}
        kern = build_kernel(name, layer_idx=3, seed=7, **DIMS, **kw)
        assert kern.name == name and (kern.num_heads, kern.num_kv_heads, kern.head_dim) == (4, 2, 8)
        with torch.no_grad():
            for p in kern.parameters():
                p.add_(0.1)
        cfg = json.loads(json.dumps(kernel_config(kern)))
        other = kernel_from_config(cfg)
        assert type(other) is type(kern) and kernel_config(other) == cfg
        other.load_state_dict(kern.state_dict())
        assert torch.equal(kern(q, k, v)[0], other(q, k, v)[0]), name


def test_oal_and_global_are_wired_to_their_kernels():
    q, k, v = qkv()
    kern = build_kernel("oal", groups=groups(), eps=1e-5, **DIMS)
    assert isinstance(kern, OALKernel) and kern.num_groups == 3 and kern.eps == 1e-5
    o, _ = kern(q, k, v)
    torch.testing.assert_close(o, oal_attention(q, k, v, kern.groups, kern.L, 1e-5)[0])
    assert isinstance(build_kernel("global", **DIMS), GlobalQuadraticKernel)
    assert isinstance(build_kernel("softmax", **DIMS), SoftmaxKernel)
    cfg = kernel_config(kern)
    assert cfg["groups"] == groups().tolist() and cfg["num_groups"] == 3


def test_options_are_passed_through():
    assert build_kernel("performer", num_features=30, **DIMS).num_features == 30
    assert build_kernel("dijiang", dtype="float64", **DIMS).dtype == torch.float64
    assert build_kernel("spectraformer", eps=0.0, **DIMS).eps == 0.0
    assert kernel_config(build_kernel("performer", seed=2, layer_idx=9, **DIMS)) == {
        "name": "performer",
        **DIMS,
        "layer_idx": 9,
        "seed": 2,
        "num_features": 250,
        "dtype": "float64",
    }


def test_bad_requests_raise():
    with pytest.raises(ValueError, match="name"):
        build_kernel("cosformer", **DIMS)
    with pytest.raises(ValueError, match="groups"):
        build_kernel("oal", **DIMS)
    with pytest.raises(ValueError, match="groups"):
        build_kernel("oal", groups=groups()[:, :4], **DIMS)
    with pytest.raises(ValueError, match="num_features"):
        build_kernel("softmax", num_features=3, **DIMS)
    with pytest.raises(ValueError, match="eps"):
        build_kernel("dijiang", eps=1e-3, **DIMS)
    with pytest.raises(ValueError, match="seed"):
        build_kernel("performer", seed=-1, **DIMS)
    with pytest.raises(ValueError, match="config"):
        kernel_from_config({"num_heads": 4})
    with pytest.raises(ValueError, match="config"):
        kernel_from_config({"name": "global", "num_heads": 4})
    with pytest.raises(ValueError, match="config"):
        kernel_from_config({**kernel_config(build_kernel("dijiang", **DIMS)), "num_features": 3})


@pytest.mark.parametrize("name", ["oal+sink+window", "global+window", "oal+sink"])
def test_sink_window_kernels_round_trip(name):
    from oal.kernels import SINK_WINDOW_KERNELS, SinkWindowKernel

    assert name in SINK_WINDOW_KERNELS
    kw = {"groups": torch.randint(0, 3, (6, 8))} if name.startswith("oal") else {}
    k = build_kernel(name, num_heads=6, num_kv_heads=2, head_dim=8, window=4 if "window" in name else 0, **kw)
    assert isinstance(k, SinkWindowKernel) and k.name == name
    with torch.no_grad():
        k.beta.normal_()
    k2 = kernel_from_config(kernel_config(k))
    k2.load_state_dict(k.state_dict())
    q, kk, v = torch.randn(1, 6, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    assert torch.equal(k(q, kk, v)[0], k2(q, kk, v)[0])


def test_sink_window_flag_mismatch():
    with pytest.raises(ValueError, match="n_sink, window"):
        build_kernel("global+sink", num_heads=2, num_kv_heads=1, head_dim=4, n_sink=0)
