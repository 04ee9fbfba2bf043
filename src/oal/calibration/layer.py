"""Calibration of one layer's kernel by output matching on frozen Q/K/V (Eq. 20, App. B, F.1).

* OAL (``OALKernel``): the learned global quadratic is calibrated first (its own initialisations), then OAL
  from ``config.oal_inits`` — by default the embedded calibrated global (App. D), the second-order Taylor
  factor and a Gaussian-perturbed embedded global. Per head, the best-validation checkpoint of each
  initialisation is kept, then the best initialisation.
* The learned global quadratic (``GlobalQuadraticKernel``): the same protocol with ``config.global_inits``.
* Any other ``AttentionKernel`` (the F.1 baselines): its trainable parameters from their natural
  initialisation (the values the kernel holds), one initialisation. Trainable parameters carry the query
  heads on their first dimension, or are shared by the layer's heads (SpectraFormer's B, G, S): then heads
  are not independent, and checkpoints and early stopping are per layer, on the mean over heads. An
  attribute ``shared_parameters`` (names) declares them; without it, a parameter whose first dimension is
  not the number of query heads is taken as shared. A kernel without trainable parameters (Performer) is
  only evaluated.

Grouped kernels use the precomputed output statistics of ``stats.py`` (``config.fast_path``); all kernels
can use the generic path through ``AttentionKernel.at_positions``. Both minimise the same objective on the
same schedule (one per layer, shared by all initialisations).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import AttentionKernel, GlobalQuadraticKernel, OALKernel, SoftmaxKernel, embed_global, taylor_L
from ..kernels.oal import taylor_global_L
from ..kernels.registry import kernel_config
from .config import QKV, CalibrationConfig, check_qkv
from .fit import Adam, FitOutcome, autograd_step, clip_per_unit, optimise
from .sampling import Schedule, layer_generator, make_schedule
from .stats import factor_mse, grouped_output_stats, pair_map

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: stage is e.g. ``"global"``, ``"oal"`` or the kernel's name."""

_POSITION_CHUNK = 128


@contextmanager
def _num_threads(n: int) -> Iterator[None]:
    """Run a block with n intra-op threads. The fast path's update loop is made of tiny tensor ops, for which
    a thread pool only adds synchronisation (badly so on a busy machine); the statistics pass inside it
    switches back to the caller's setting."""
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)


@dataclass
class LayerResult:
    """Calibration of one layer.

    ``state``: the calibrated ``state_dict`` (parameters and buffers, CPU). ``inits``: initialisation names,
    indexing the first dimension of the ``(I, Hq)`` tensors. ``selection``: ``"per_head"``, ``"per_layer"``
    (shared parameters) or ``"none"`` (nothing to calibrate). ``chosen_init[h]``: the initialisation kept for
    head h. ``val_mse (Hq,)``: validation MSE of the kept checkpoint; ``val_mse_per_init``: of each
    initialisation's best checkpoint; ``init_val_mse``: of each initialisation before training;
    ``best_update``: update count of each best checkpoint (0 = the initialisation); ``updates``: updates
    run before early stopping. ``global_stage``: for OAL, the calibration of the learned global quadratic
    that provided its initialisations. ``meta``: shapes, and ``kernel_config`` (the registry's
    ``kernel_config``, None for kernels it does not know) to rebuild the kernel. ``timings``: wall
    seconds by phase (targets or statistics, and each stage's optimisation).
    """

    kernel: str
    state: dict[str, torch.Tensor]
    inits: tuple[str, ...]
    selection: str
    chosen_init: tuple[int, ...]
    val_mse: torch.Tensor
    val_mse_per_init: torch.Tensor
    init_val_mse: torch.Tensor
    best_update: torch.Tensor
    updates: torch.Tensor
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    global_stage: LayerResult | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-ready description, one entry per query head."""
        groups = self.state.get("groups")
        heads = []
        for h in range(self.val_mse.shape[0]):
            c = self.chosen_init[h]
            entry: dict[str, Any] = {
                "head": h,
                "init": self.inits[c],
                "init_index": c,
                "val_mse": float(self.val_mse[h]),
                "val_mse_per_init": [float(x) for x in self.val_mse_per_init[:, h]],
                "init_val_mse": [float(x) for x in self.init_val_mse[:, h]],
                "best_update": [int(x) for x in self.best_update[:, h]],
                "updates": [int(x) for x in self.updates[:, h]],
            }
            if groups is not None:
                entry["groups"] = [int(x) for x in groups[h]]
                entry["num_groups"] = len(set(entry["groups"]))
            heads.append(entry)
        out: dict[str, Any] = {
            "kernel": self.kernel,
            "selection": self.selection,
            "inits": list(self.inits),
            "seconds": self.seconds,
            "timings": self.timings,
            "meta": self.meta,
            "heads": heads,
        }
        if self.global_stage is not None:
            out["global_stage"] = self.global_stage.summary()
        return out


# --------------------------------------------------------------------------------------------- problems


def _at_positions_chunked(kernel: AttentionKernel, q, k, v, positions: torch.Tensor) -> torch.Tensor:
    """``kernel.at_positions`` for one sequence ``(Hq, N, d)``, ``(Hkv, N, ·)`` in position chunks:
    ``(Hq, P, dv)``."""
    outs = [
        kernel.at_positions(q[None], k[None], v[None], positions[i : i + _POSITION_CHUNK])[0]
        for i in range(0, positions.numel(), _POSITION_CHUNK)
    ]
    return torch.cat(outs, dim=1)


class _GroupedStats:
    """Output statistics (``stats.py``) of the scheduled training positions, computed lazily, one
    validation interval of updates at a time (so updates that early stopping never reaches cost nothing),
    and of the validation positions, computed up front."""

    def __init__(
        self,
        train: QKV,
        val: QKV,
        groups: torch.Tensor,
        num_groups: int,
        scale: float,
        schedule: Schedule,
        config: CalibrationConfig,
        target: AttentionKernel | None,
        block_bytes: int,
    ) -> None:
        self.train, self.groups, self.G, self.scale = train, groups, num_groups, scale
        self.target, self.block_bytes, self.step = target, block_bytes, config.val_every
        U, P = schedule.positions.shape
        N = train.q.shape[2]
        keys = (schedule.seq[:, None] * N + schedule.positions).flatten()
        uniq, inv = torch.unique(keys, return_inverse=True)
        self.item_seq, self.item_pos = uniq // N, uniq % N
        self.items = inv.view(U, P)
        first = torch.full((uniq.numel(),), U, dtype=torch.long)
        self.first_update = first.scatter_reduce_(0, inv, torch.arange(U).repeat_interleave(P), "amin")
        Hq = groups.shape[0]
        n = (num_groups + 1) * (num_groups + 2) // 2
        self.R = torch.empty(Hq, uniq.numel(), n, n, dtype=torch.float64)
        self.f = torch.empty(Hq, uniq.numel(), n, dtype=torch.float64)
        self.ready = 0  # training statistics exist for the items of updates < ready
        self.threads = torch.get_num_threads()
        self.train_seconds = 0.0
        t0 = time.perf_counter()
        vals = [self._stats(val, s, pos) for s, pos in enumerate(schedule.val_positions)]
        self.val_seconds = time.perf_counter() - t0
        self.val_R = torch.cat([x.R for x in vals], dim=1)
        self.val_f = torch.cat([x.f for x in vals], dim=1)
        self.dv = train.v.shape[-1]

    def _stats(self, data: QKV, s: int, positions: torch.Tensor):
        q, k, v = data.q[s], data.k[s], data.v[s]
        target = None
        if self.target is not None:
            with torch.no_grad():
                target = _at_positions_chunked(self.target, q, k, v, positions).float()
        return grouped_output_stats(
            q, k, v, self.groups, self.G, positions, scale=self.scale, target=target, block_bytes=self.block_bytes
        )

    def train_batch(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:
        while u >= self.ready:
            t0 = time.perf_counter()
            hi = min(self.ready + self.step, self.items.shape[0])
            new = ((self.first_update >= self.ready) & (self.first_update < hi)).nonzero().flatten()
            with _num_threads(self.threads):
                for s in self.item_seq[new].unique().tolist():
                    sel = new[self.item_seq[new] == s]
                    st = self._stats(self.train, s, self.item_pos[sel])
                    self.R[:, sel], self.f[:, sel] = st.R, st.f
            self.ready = hi
            self.train_seconds += time.perf_counter() - t0
        idx = self.items[u]
        return self.R.index_select(1, idx), self.f.index_select(1, idx)


class _KernelTargets:
    """Target outputs for the generic path: the target kernel's full output per training sequence
    (SDPA for softmax), and its outputs at the validation positions."""

    def __init__(self, train: QKV, val: QKV, schedule: Schedule, target: AttentionKernel) -> None:
        self.train, self.val, self.schedule = train, val, schedule
        with torch.no_grad():
            self.train_out = torch.stack(
                [
                    target(train.q[s][None], train.k[s][None], train.v[s][None])[0][0].float()
                    for s in range(len(train.q))
                ]
            )
            self.val_out = [
                target(val.q[s][None], val.k[s][None], val.v[s][None])[0][0, :, pos].float()
                for s, pos in enumerate(schedule.val_positions)
            ]

    def train_loss(self, kernel: AttentionKernel, u: int) -> torch.Tensor:
        s, pos = int(self.schedule.seq[u]), self.schedule.positions[u]
        out = kernel.at_positions(self.train.q[s][None], self.train.k[s][None], self.train.v[s][None], pos)[0]
        return (out.float() - self.train_out[s][:, pos]).square().mean((-2, -1))[None]

    def val_mse(self, kernel: AttentionKernel) -> torch.Tensor:
        """``(1, Hq)``: mean over all validation positions and output channels."""
        total, count = 0.0, 0
        with torch.no_grad():
            for s, pos in enumerate(self.schedule.val_positions):
                out = _at_positions_chunked(kernel, self.val.q[s], self.val.k[s], self.val.v[s], pos).float()
                total = total + (out - self.val_out[s]).double().square().sum((-2, -1))
                count += out.shape[1] * out.shape[2]
        return (total / count)[None]


# --------------------------------------------------------------------------------------------- inits


def _perturb(L: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    """``L (Hq, r, r)`` plus Gaussian noise on the lower triangle, per head of std
    ``std · ‖L_h‖_F / √r`` (relative to the RMS row norm, so it is scale-free)."""
    Lt = L.tril()
    sigma = std * Lt.norm(dim=(-2, -1)) / math.sqrt(L.shape[-1])
    return Lt + torch.randn(L.shape, generator=gen).tril() * sigma[:, None, None]


def _global_inits(names: tuple[str, ...], Hq: int, std: float, gen: torch.Generator) -> torch.Tensor:
    taylor = taylor_global_L().expand(Hq, 2, 2).clone()
    out = [taylor if name == "taylor" else _perturb(taylor, std, gen) for name in names]
    return torch.stack(out)


def _oal_inits(
    names: tuple[str, ...], L_global: torch.Tensor, G: int, std: float, gen: torch.Generator
) -> torch.Tensor:
    embedded = embed_global(L_global, G)
    table = {"global": lambda: embedded, "taylor": lambda: taylor_L(L_global.shape[0], G)}
    out = [table[name]() if name in table else _perturb(embedded, std, gen) for name in names]
    return torch.stack(out)


# --------------------------------------------------------------------------------------------- fitting


@dataclass
class _Stage:
    """Best factor per (init, head) and the outcome tensors, ``(I, Hq, ...)``."""

    best: torch.Tensor
    best_val: torch.Tensor
    init_val: torch.Tensor
    best_update: torch.Tensor
    updates: torch.Tensor

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Best initialisation per head: ``(chosen (Hq,), factor (Hq, r, r))``."""
        chosen = self.best_val.argmin(0)
        return chosen, self.best[chosen, torch.arange(chosen.numel())]


def _stage_from(outcomes: list[FitOutcome], best: torch.Tensor) -> _Stage:
    """Concatenate outcomes along the initialisation dimension; ``best (I, Hq, r, r)``."""
    return _Stage(
        best=best,
        best_val=torch.cat([o.best_val for o in outcomes]),
        init_val=torch.cat([o.init_val for o in outcomes]),
        best_update=torch.cat([o.best_update for o in outcomes]),
        updates=torch.cat([o.updates for o in outcomes]),
    )


def _fit_factor_fast(
    stats: _GroupedStats, init: torch.Tensor, eps: float, config: CalibrationConfig, progress
) -> _Stage:
    """All initialisations ``init (I, Hq, r, r)`` (r = G+1 for OAL, 2 for the global) at once on the
    precomputed statistics, with the closed-form gradient of :func:`factor_mse`."""
    L = init.clone()
    W = pair_map(stats.G, L.shape[-1])
    adam = Adam(L, config.lr)

    def step(u: int) -> None:
        R, f = stats.train_batch(u)
        _, grad = factor_mse(L, W, eps, R, f, stats.dv)
        grad = grad.float()
        clip_per_unit([grad], [2], config.grad_clip)
        adam.step(grad)

    def val_mse() -> torch.Tensor:
        return factor_mse(L, W, eps, stats.val_R, stats.val_f, stats.dv, grad=False)[0]

    with _num_threads(1):
        outcome = optimise([L], [2], step, val_mse, config, progress=progress)
    return _stage_from([outcome], outcome.best[0])


def _trainable(kernel: AttentionKernel) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """Trainable parameters and their unit dimensions: 1 (per query head, on the first dimension) or 0
    (shared by the layer's heads). A ``shared_parameters`` attribute naming the shared ones is authoritative;
    without it a parameter is per head iff its first dimension is the number of query heads."""
    declared = getattr(kernel, "shared_parameters", None)
    names, params, lead = [], [], []
    for name, p in kernel.named_parameters():
        if not p.requires_grad:
            continue
        per_head = p.dim() > 0 and p.shape[0] == kernel.num_heads
        shared = name in declared if declared is not None else not per_head
        if not shared and not per_head:
            raise ValueError(
                f"{type(kernel).__name__}.{name}: expected the {kernel.num_heads} query heads on the first "
                f"dimension of a per-head parameter, got shape {tuple(p.shape)}; list parameters shared by all "
                f"heads in the attribute `shared_parameters`"
            )
        if shared and declared is None:
            log.info("%s.%s %s: shared by all heads (selection per layer)", kernel.name, name, tuple(p.shape))
        names.append(name)
        params.append(p)
        lead.append(0 if shared else 1)
    return names, params, lead


def _fit_kernel(
    kernel: AttentionKernel, targets: _KernelTargets, config: CalibrationConfig, progress
) -> tuple[FitOutcome | None, bool, torch.Tensor]:
    """Generic path for one initialisation (the kernel's current parameters, modified in place to the best
    checkpoint). Returns the outcome (None when there is nothing to train), whether selection is per layer,
    and the per-head validation MSE of the final parameters."""
    names, params, lead = _trainable(kernel)
    if not params:
        return None, False, targets.val_mse(kernel)[0]
    per_layer = 0 in lead
    step = autograd_step(params, lead, lambda u: targets.train_loss(kernel, u), config)
    outcome = optimise(
        params, lead, step, lambda: targets.val_mse(kernel), config, per_layer=per_layer, progress=progress
    )
    with torch.no_grad():
        for p, b in zip(params, outcome.best, strict=True):
            p.copy_(b)
    if per_layer:  # report per head at the layer-level checkpoint
        best_u = int(outcome.best_update.reshape(-1)[0])
        per_head = dict(outcome.history)[best_u]
        outcome.init_val = outcome.history[0][1]
        outcome.best_val = per_head
        outcome.best_update = outcome.best_update.expand_as(per_head).clone()
        outcome.updates = outcome.updates.expand_as(per_head).clone()
    return outcome, per_layer, outcome.best_val[0]


def _fit_factor_generic(
    make: Callable[[torch.Tensor], OALKernel],
    init: torch.Tensor,
    targets: _KernelTargets,
    config: CalibrationConfig,
    progress,
) -> _Stage:
    """Each initialisation ``init[i] (Hq, r, r)`` in turn through ``at_positions`` (cross-check path)."""
    outcomes, best = [], []
    for L0 in init:
        kernel = make(L0)
        outcome, _, _ = _fit_kernel(kernel, targets, config, progress)
        outcomes.append(outcome)
        best.append(kernel.L.detach().clone())
    return _stage_from(outcomes, torch.stack(best))


# --------------------------------------------------------------------------------------------- entry


def calibrate_layer(
    kernel: AttentionKernel | Callable[[], AttentionKernel],
    train: QKV,
    val: QKV,
    *,
    config: CalibrationConfig | None = None,
    layer: int = 0,
    target: AttentionKernel | None = None,
    progress: ProgressFn | None = None,
    block_bytes: int = 1 << 26,
) -> LayerResult:
    """Calibrate one layer's kernel on frozen Q/K/V (Eq. 20; protocol of App. B).

    Args:
        kernel: the kernel to fit, or a zero-argument factory returning it. It is not modified.
        train, val: :class:`QKV` of the training and validation sequences, q ``(S, Hq, N, d)``,
            k ``(S, Hkv, N, d)``, v ``(S, Hkv, N, dv)``; cast to fp32.
        config: protocol options (paper defaults).
        layer: layer index; with ``config.seed`` it determines every random draw (schedule, pools,
            validation positions, perturbations), so results do not depend on other layers.
        target: the kernel whose outputs are matched; default exact softmax (Eq. 20).
        progress: ``progress(stage, done, total)`` after each update.
        block_bytes: working memory of one block of the statistics pass (speed only).

    Returns:
        :class:`LayerResult`.
    """
    config = CalibrationConfig() if config is None else config
    if not isinstance(kernel, AttentionKernel):
        if not callable(kernel):
            raise ValueError(f"kernel: expected an AttentionKernel or a factory, got {type(kernel).__name__}")
        kernel = kernel()
        if not isinstance(kernel, AttentionKernel):
            raise ValueError(f"kernel: the factory returned {type(kernel).__name__}, not an AttentionKernel")
    kernel = copy.deepcopy(kernel).cpu()
    for p in kernel.parameters():  # parameters are optimised in FP32 (App. B); buffers keep their dtype
        p.data = p.data.float()
    train, val = check_qkv(train, "train"), check_qkv(val, "val")
    for name, data in (("train", train), ("val", val)):
        Hq, Hkv, d = data.q.shape[1], data.k.shape[1], data.q.shape[3]
        if (Hq, Hkv, d) != (kernel.num_heads, kernel.num_kv_heads, kernel.head_dim):
            raise ValueError(
                f"{name}: expected (Hq, Hkv, d) = {(kernel.num_heads, kernel.num_kv_heads, kernel.head_dim)} of "
                f"the kernel, got {(Hq, Hkv, d)}"
            )
    if val.v.shape[-1] != train.v.shape[-1]:
        raise ValueError(f"val: expected dv={train.v.shape[-1]} like train, got {val.v.shape[-1]}")
    if target is not None:
        target = copy.deepcopy(target).float().cpu().requires_grad_(False)

    start = time.perf_counter()
    gen = layer_generator(config.seed, layer)
    schedule = make_schedule(gen, train.q.shape[0], val.q.shape[0], train.q.shape[2], val.q.shape[2], config)
    meta = {"num_heads": kernel.num_heads, "num_kv_heads": kernel.num_kv_heads, "head_dim": kernel.head_dim}

    def stage_progress(stage: str):
        return None if progress is None else (lambda done, total: progress(stage, done, total))

    if isinstance(kernel, OALKernel):
        result = _calibrate_grouped(kernel, train, val, schedule, gen, config, target, stage_progress, block_bytes)
    else:
        t0 = time.perf_counter()
        targets = _KernelTargets(
            train, val, schedule, target or SoftmaxKernel(kernel.num_heads, kernel.num_kv_heads, kernel.head_dim)
        )
        t1 = time.perf_counter()
        outcome, per_layer, val_mse = _fit_kernel(kernel, targets, config, stage_progress(kernel.name))
        timings = {"targets": t1 - t0, "fit": time.perf_counter() - t1}
        Hq = kernel.num_heads
        zeros = torch.zeros(1, Hq, dtype=torch.long)
        result = LayerResult(
            kernel=kernel.name,
            state={k: v.detach().clone() for k, v in kernel.state_dict().items()},
            inits=("natural",),
            selection="none" if outcome is None else ("per_layer" if per_layer else "per_head"),
            chosen_init=(0,) * Hq,
            val_mse=val_mse,
            val_mse_per_init=val_mse[None],
            init_val_mse=val_mse[None] if outcome is None else outcome.init_val,
            best_update=zeros if outcome is None else outcome.best_update,
            updates=zeros if outcome is None else outcome.updates,
            seconds=0.0,
            timings=timings,
        )
    result.meta = {**meta, **result.meta, "kernel_config": _config_of(kernel)}
    result.seconds = time.perf_counter() - start
    return result


def _config_of(kernel: AttentionKernel) -> dict[str, Any] | None:
    """``oal.kernels.registry.kernel_config`` (what rebuilds the kernel before its state is loaded), or None
    for kernels the registry does not know."""
    try:
        return kernel_config(kernel)
    except ValueError:
        return None


def _calibrate_grouped(
    kernel: OALKernel,
    train: QKV,
    val: QKV,
    schedule: Schedule,
    gen: torch.Generator,
    config: CalibrationConfig,
    target: AttentionKernel | None,
    stage_progress,
    block_bytes: int,
) -> LayerResult:
    Hq, Hkv, d, G, eps = kernel.num_heads, kernel.num_kv_heads, kernel.head_dim, kernel.num_groups, kernel.eps
    is_global = isinstance(kernel, GlobalQuadraticKernel)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if config.fast_path:
        stats = _GroupedStats(train, val, kernel.groups, G, kernel.scale, schedule, config, target, block_bytes)
        timings["val_stats"] = stats.val_seconds
        fit_global = fit_oal = lambda init, prog: _fit_factor_fast(stats, init, eps, config, prog)  # noqa: E731
    else:
        stats = None
        targets = _KernelTargets(train, val, schedule, target or SoftmaxKernel(Hq, Hkv, d))
        timings["targets"] = time.perf_counter() - t0
        fit_global = lambda init, prog: _fit_factor_generic(  # noqa: E731
            lambda L: GlobalQuadraticKernel(Hq, Hkv, d, eps=eps, L=L), init, targets, config, prog
        )
        fit_oal = lambda init, prog: _fit_factor_generic(  # noqa: E731
            lambda L: OALKernel(kernel.groups, Hkv, num_groups=G, eps=eps, L=L), init, targets, config, prog
        )

    def timed(name: str, fn, *args):
        before = 0.0 if stats is None else stats.train_seconds
        t = time.perf_counter()
        out = fn(*args)
        spent = 0.0 if stats is None else stats.train_seconds - before
        timings[name] = time.perf_counter() - t - spent
        if stats is not None:
            timings["train_stats"] = stats.train_seconds
        return out

    init = _global_inits(config.global_inits, Hq, config.perturb_std, gen)
    g_stage = timed("global_fit", fit_global, init, stage_progress("global"))
    g_chosen, L_global = g_stage.select()
    global_kernel = GlobalQuadraticKernel(Hq, Hkv, d, eps=eps, L=L_global)
    global_result = _result(global_kernel, config.global_inits, g_stage, g_chosen, time.perf_counter() - t0)
    global_result.meta = {
        "num_heads": Hq,
        "num_kv_heads": Hkv,
        "head_dim": d,
        "eps": eps,
        "kernel_config": _config_of(global_kernel),
    }
    if is_global:
        global_result.timings = timings
        return global_result
    init = _oal_inits(config.oal_inits, L_global, G, config.perturb_std, gen)
    o_stage = timed("oal_fit", fit_oal, init, stage_progress("oal"))
    o_chosen, L = o_stage.select()
    with torch.no_grad():
        kernel.L.copy_(L)
    result = _result(kernel, config.oal_inits, o_stage, o_chosen, 0.0)
    result.meta = {"eps": eps, "num_groups": G}
    result.timings = timings
    result.global_stage = global_result
    return result


def _result(kernel: OALKernel, inits, stage: _Stage, chosen: torch.Tensor, seconds: float) -> LayerResult:
    Hq = kernel.num_heads
    return LayerResult(
        kernel=kernel.name,
        state={k: v.detach().clone() for k, v in kernel.state_dict().items()},
        inits=tuple(inits),
        selection="per_head",
        chosen_init=tuple(int(c) for c in chosen),
        val_mse=stage.best_val[chosen, torch.arange(Hq)],
        val_mse_per_init=stage.best_val,
        init_val_mse=stage.init_val,
        best_update=stage.best_update,
        updates=stage.updates,
        seconds=seconds,
    )
