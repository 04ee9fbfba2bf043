"""What the F.1 baselines share: seeding, input checks, config round trips and the feature-kernel base class."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch

from ...ops.linear import DEFAULT_CHUNK, LinearState, accumulation_dtype, causal_kernel_matrix, linear_attention
from ..base import AttentionKernel, check_positions


def kernel_generator(name: str, seed: int, layer_idx: int) -> torch.Generator:
    """A CPU generator seeded from (kernel name, seed, layer): fixed random projections are reproducible from the
    config alone, and different layers (and kernels) draw independent ones."""
    digest = hashlib.sha256(f"oal/{name}/seed={seed}/layer={layer_idx}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: torch.dtype | str, name: str = "dtype") -> torch.dtype:
    dt = getattr(torch, value, None) if isinstance(value, str) else value
    if not (isinstance(dt, torch.dtype) and dt.is_floating_point):
        raise ValueError(f"{name}: expected a floating torch.dtype or its name, got {value!r}")
    return dt


def check_nonnegative_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    return value


def check_qk(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor) -> None:
    """q ``(B, Hq, N, d)`` and k ``(B, Hkv, N, d)`` with this kernel's head counts and head dimension."""
    for name, x, heads in (("q", q, kernel.num_heads), ("k", k, kernel.num_kv_heads)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a floating-point tensor, got {got}")
        if x.dim() != 4 or x.shape[1] != heads or x.shape[3] != kernel.head_dim:
            raise ValueError(f"{name}: expected shape (B, {heads}, N, {kernel.head_dim}), got {tuple(x.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k: expected batch and length {q.shape[0]}, {q.shape[2]} like q, got {tuple(k.shape)}")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k: expected dtype {q.dtype} on {q.device} like q, got {k.dtype} on {k.device}")


class ConfigMixin:
    """``config()`` records the constructor arguments as a JSON-friendly dict; ``from_config`` rebuilds the kernel.

    Fixed random projections are regenerated from the recorded seed and layer; trained parameters come from the
    state dict (where the projections are stored as buffers too, so a reload is bit-identical either way).
    """

    name: str
    _config_keys: tuple[str, ...] = ()

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"name": self.name}
        for key in ("num_heads", "num_kv_heads", "head_dim", "layer_idx", "seed", *self._config_keys):
            value = getattr(self, key)
            cfg[key] = dtype_name(value) if isinstance(value, torch.dtype) else value
        return cfg

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        cfg = dict(config)
        name = cfg.pop("name", None)
        if name != cls.name:
            raise ValueError(f"config: expected name {cls.name!r}, got {name!r}")
        allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(cfg) - allowed)
        if unknown:
            raise ValueError(f"config: unknown keys {unknown} for {cls.name!r}; expected a subset of {sorted(allowed)}")
        return cls(**cfg)


class FeatureKernel(ConfigMixin, AttentionKernel):
    """A positive feature kernel ``κ_h(q, k) = φ_q(q)ᵀ φ_k(k)`` evaluated by :func:`oal.ops.linear.linear_attention`.

    Subclasses implement :meth:`query_features` and :meth:`key_features` (or key log-features when
    ``log_keys``), both taking the queries ``(B, Hq, n, d)`` and keys ``(B, Hkv, n, d)`` of the same n tokens in
    the accumulation dtype, and set :attr:`num_features` and :attr:`key_heads`.

    ``weights`` and ``forward(mode="naive")`` build the explicit kernel matrix; ``"chunk"`` and ``"recurrent"``
    run on prefix states :class:`oal.ops.linear.LinearState` with ``kv (B, key_heads, m, dv + 1)``. Features and
    prefix sums use ``dtype`` (fp64 inputs always use fp64); outputs have the input dtype.
    """

    log_keys: bool = False

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, *, layer_idx: int, seed: int, dtype: torch.dtype
    ) -> None:
        for key, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if check_nonnegative_int(key, value) == 0:
                raise ValueError(f"{key}: expected a positive integer, got {value}")
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.layer_idx = check_nonnegative_int("layer_idx", layer_idx)
        self.seed = check_nonnegative_int("seed", seed)
        self.dtype = parse_dtype(dtype)
        self.input_scale = head_dim**-0.25

    @property
    def num_features(self) -> int:
        raise NotImplementedError

    @property
    def key_heads(self) -> int:
        """Heads of the key features and of the state: ``num_kv_heads`` or ``num_heads``."""
        raise NotImplementedError

    def query_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def key_features(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_shape(self, batch_size: int, dv: int) -> LinearState:
        """The shapes of the state's ``kv`` and ``shift`` for a batch (a LinearState of shapes)."""
        return LinearState((batch_size, self.key_heads, self.num_features, dv + 1), (batch_size, self.key_heads))

    def weights(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Explicit kernel ``(B, Hq, P, N)`` in the accumulation dtype, zero above the causal diagonal.

        For ``log_keys`` kernels row p carries the stabiliser ``exp(-c_p)`` (c_p the largest key log-feature over
        the keys ≤ p and all features), and the query features their per-token stabiliser: rows are the kernel up
        to a positive per-row factor, which the normalisation cancels.
        """
        check_qk(self, q, k)
        positions = check_positions(positions, q.shape[2])
        cdt = accumulation_dtype(self.dtype, q.dtype)
        qf, kf = q.to(cdt), k.to(cdt)
        fq = self.query_features(qf[:, :, positions], kf[:, :, positions])
        kern, _ = causal_kernel_matrix(fq, self.key_features(qf, kf), positions, log_keys=self.log_keys)
        return kern

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mode: str = "chunk",
        initial_state: LinearState | None = None,
        output_final_state: bool = False,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> tuple[torch.Tensor, LinearState | None]:
        """Outputs ``(B, Hq, N, dv)`` and, if asked, the :class:`LinearState` after the last token."""
        check_qk(self, q, k)
        return linear_attention(
            q,
            k,
            v,
            self.query_features,
            self.key_features,
            key_heads=self.key_heads,
            log_keys=self.log_keys,
            dtype=self.dtype,
            mode=mode,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
        )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"features={self.num_features}, layer={self.layer_idx}, seed={self.seed}, dtype={dtype_name(self.dtype)}"
        )
