"""Build attention kernels by name and round-trip them through JSON-friendly configs.

``build_kernel(name, num_heads=…, num_kv_heads=…, head_dim=…, layer_idx=…, seed=…, **kw)`` for the names in
:data:`KERNELS`. ``layer_idx`` and ``seed`` select the fixed random projections of the seeded baselines (Performer,
SpectraFormer, DiJiang) and are recorded by all baselines; the deterministic softmax / global / OAL kernels accept
and ignore them. Trained values (L, θ, τ, FastFood vectors) and the fixed projections live in the state dict;
``kernel_config`` + ``kernel_from_config`` + ``load_state_dict`` restore a kernel bit-identically.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .base import AttentionKernel, SoftmaxKernel
from .baselines import DiJiangKernel, PerformerKernel, SpectraFormerKernel, TaylorShiftKernel
from .baselines.common import check_nonnegative_int
from .hybrid import EXACT_HEADS, ExactHeadsKernel
from .oal import GlobalQuadraticKernel, OALKernel
from .sink_window import SinkWindowKernel, split_sink_window_name

BASELINES: dict[str, type[AttentionKernel]] = {
    cls.name: cls for cls in (PerformerKernel, SpectraFormerKernel, DiJiangKernel, TaylorShiftKernel)
}
KERNELS = ("softmax", "global", "oal", *BASELINES)
# exact sinks and/or an exact local window around the quadratic kernels ("Beyond the paper")
SINK_WINDOW_KERNELS = tuple(
    f"{base}{tail}" for base in ("oal", "global") for tail in ("+sink", "+window", "+sink+window")
)
SINK_WINDOW_DEFAULTS = {"n_sink": 4, "window": 64}


def _check_kwargs(name: str, kw: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(kw) - allowed)
    if unknown:
        raise ValueError(f"kw: unknown options {unknown} for kernel {name!r}; expected a subset of {sorted(allowed)}")


def build_kernel(
    name: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    layer_idx: int = 0,
    seed: int = 0,
    **kw: Any,
) -> AttentionKernel:
    """A kernel for the query heads of one layer.

    Extra options: performer ``num_features``, ``dtype``; spectraformer ``eps``, ``dtype``; dijiang and
    taylorshift ``dtype``; global ``eps``, ``L (Hq, 2, 2)``; oal ``groups (Hq, d)`` (required), ``num_groups``,
    ``eps``, ``L (Hq, G+1, G+1)``. Unknown options raise ValueError.
    """
    check_nonnegative_int("layer_idx", layer_idx)
    check_nonnegative_int("seed", seed)
    if name in SINK_WINDOW_KERNELS:
        base, sink, window = split_sink_window_name(name)
        n_sink = kw.pop("n_sink", SINK_WINDOW_DEFAULTS["n_sink"] if sink else 0)
        w = kw.pop("window", SINK_WINDOW_DEFAULTS["window"] if window else 0)
        if bool(n_sink) != sink or bool(w) != window:
            raise ValueError(
                f"n_sink, window: {name!r} needs n_sink > 0 iff '+sink' and window > 0 iff '+window', "
                f"got n_sink={n_sink}, window={w}"
            )
        beta = kw.pop("beta", None)
        inner = build_kernel(base, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **kw)
        return SinkWindowKernel(inner, n_sink=n_sink, window=w, beta=beta)
    if name in BASELINES:
        cls = BASELINES[name]
        allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "num_heads", "num_kv_heads", "head_dim"}
        _check_kwargs(name, kw, allowed - {"layer_idx", "seed"})
        return cls(num_heads, num_kv_heads, head_dim, layer_idx=layer_idx, seed=seed, **kw)
    if name == "softmax":
        _check_kwargs(name, kw, set())
        return SoftmaxKernel(num_heads, num_kv_heads, head_dim)
    if name == "global":
        _check_kwargs(name, kw, {"eps", "L"})
        return GlobalQuadraticKernel(num_heads, num_kv_heads, head_dim, **kw)
    if name == "oal":
        _check_kwargs(name, kw, {"groups", "num_groups", "eps", "L"})
        groups = kw.pop("groups", None)
        if groups is None:
            raise ValueError("groups: the 'oal' kernel needs a groups tensor of shape (num_heads, head_dim)")
        if isinstance(groups, list):
            groups = torch.tensor(groups, dtype=torch.long)
        if not isinstance(groups, torch.Tensor) or tuple(groups.shape) != (num_heads, head_dim):
            got = tuple(groups.shape) if isinstance(groups, torch.Tensor) else type(groups).__name__
            raise ValueError(f"groups: expected shape ({num_heads}, {head_dim}), got {got}")
        return OALKernel(groups, num_kv_heads, **kw)
    raise ValueError(f"name: expected one of {KERNELS + SINK_WINDOW_KERNELS}, got {name!r}")


def kernel_config(kernel: AttentionKernel) -> dict[str, Any]:
    """JSON-friendly constructor arguments of any kernel :func:`build_kernel` makes (not its trained values)."""
    if isinstance(kernel, tuple(BASELINES.values())):
        return kernel.config()
    if isinstance(kernel, ExactHeadsKernel):
        cfg = {"name": EXACT_HEADS, "exact_kv_heads": list(kernel.exact_kv_heads), "inner": kernel_config(kernel.inner)}
        if kernel.kv_dtype is not None:  # only when set: configs written before the option stay as they were
            cfg["kv_dtype"] = str(kernel.kv_dtype).removeprefix("torch.")
        if kernel.product_dtype is not None:
            cfg["product_dtype"] = str(kernel.product_dtype).removeprefix("torch.")
        if kernel.decode_budget is not None:
            cfg.update(decode_budget=kernel.decode_budget, decode_page=kernel.decode_page)
        return cfg
    if isinstance(kernel, SinkWindowKernel):
        inner = kernel_config(kernel.inner)
        inner.pop("name")
        return {"name": kernel.name, "n_sink": kernel.n_sink, "window": kernel.window, **inner}
    cfg: dict[str, Any] = {
        "name": kernel.name,
        "num_heads": kernel.num_heads,
        "num_kv_heads": kernel.num_kv_heads,
        "head_dim": kernel.head_dim,
    }
    if isinstance(kernel, GlobalQuadraticKernel):
        cfg["eps"] = kernel.eps
    elif isinstance(kernel, OALKernel):
        cfg.update(eps=kernel.eps, num_groups=kernel.num_groups, groups=kernel.groups.tolist())
    elif not isinstance(kernel, SoftmaxKernel):
        raise ValueError(f"kernel: expected a kernel built by build_kernel, got {type(kernel).__name__}")
    return cfg


def kernel_from_config(config: dict[str, Any]) -> AttentionKernel:
    """Rebuild a kernel from :func:`kernel_config` output; load its state dict to restore trained values."""
    if not isinstance(config, dict) or "name" not in config:
        raise ValueError(f"config: expected a dict with a 'name' key, got {config!r}")
    cfg = dict(config)
    name = cfg.pop("name")
    if name == EXACT_HEADS:
        optional = {"kv_dtype", "product_dtype", "decode_budget", "decode_page"}
        if sorted(set(cfg) - optional) != ["exact_kv_heads", "inner"]:
            raise ValueError(
                f"config: expected the keys ['exact_kv_heads', 'inner'] (and optionally {sorted(optional)}) for "
                f"{EXACT_HEADS!r}, got {sorted(cfg)}"
            )
        dtypes = {}
        for key, allowed in (("kv_dtype", ("bfloat16", "int8")), ("product_dtype", ("bfloat16",))):
            value = cfg.get(key)
            if value is not None and value not in allowed:
                raise ValueError(f"config: {key} expected one of {list(allowed)} or absent, got {value!r}")
            dtypes[key] = None if value is None else getattr(torch, value)
        budget = {key: cfg[key] for key in ("decode_budget", "decode_page") if key in cfg}
        return ExactHeadsKernel(kernel_from_config(cfg["inner"]), cfg["exact_kv_heads"], **dtypes, **budget)
    if name in BASELINES:
        return BASELINES[name].from_config(config)
    missing = sorted({"num_heads", "num_kv_heads", "head_dim"} - set(cfg))
    if missing:
        raise ValueError(f"config: missing keys {missing} for kernel {name!r}")
    return build_kernel(name, **cfg)
