"""On-disk cache of frozen attention states (post-RoPE q, k, v and the exact attention output before W_o) for
token blocks of one text split, shared by ``oal calibrate``, ``oal fidelity`` and ``oal intervene``.

Every needed layer of a block is captured in ONE forward pass (stopped right after the last needed layer, so
the later layers and the LM head are never run) and written as one file per block::

    <root>/<model>/<split>_N<block_len>/manifest.json            model, text source, tokenizer, split, N, dtype
    <root>/<model>/<split>_N<block_len>/block_0016.safetensors   keys ``layers.{i}.{q,k,v,o}``; metadata: token hash,
                                                                 layers held

Files are written atomically (:func:`oal.io.save_tensors`), so an interrupted capture resumes at the first missing
block. A block file is only reused if its token hash equals the block being asked for, and a cache directory
only if its manifest (model source, text source, tokenizer, block length, dtype) matches: a mismatch raises
ValueError instead of silently reusing other data. Asking for layers a block file lacks recaptures that block
with the union of its layers. Each file records the sha256 of every tensor, checked when the tensor is read: a
damaged or altered block file raises :class:`oal.io.IntegrityError` (delete it to recapture) instead of feeding
wrong states to a run.

Readers stream one layer at a time across blocks (:meth:`QKVCache.layer`), which is what calibration consumes;
safetensors reads only the requested tensors. Several processes (:class:`oal.distributed.Processes`) share the
blocks to capture round robin, so no block is captured twice.

Sizes (fp32): SmolLM2-135M (Hq 9, Hkv 3, d 64), N = 4096: 25 MB per layer and block (q 9.4, k 3.1, v 3.1, o 9.4).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from ..distributed import Processes
from ..io import IntegrityError, load_tensors, read_json, save_tensors, write_json

logger = logging.getLogger(__name__)

FORMAT = "oal-qkv-cache/1"


class LayerStates(NamedTuple):
    """Captured states of one layer for S blocks: q ``(S, Hq, N, d)``, k ``(S, Hkv, N, d)``, v ``(S, Hkv, N, dv)``,
    o ``(S, Hq, N, dv)`` (the model's exact attention output before W_o, or None when not requested), and the
    layer's softmax scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor | None
    scale: float


@dataclass(frozen=True)
class CacheKey:
    """What a cache directory holds; every field must match for a directory to be reused."""

    model: str
    model_source: str
    text_source: str
    split: str
    block_len: int
    tokenizer: str | None
    dtype: str = "float32"


@dataclass
class CaptureStats:
    """What :meth:`QKVCache.ensure` did: blocks captured (forward passes run, by all processes together) and
    reused, wall and process CPU seconds of this process's forwards (including writing the files)."""

    captured: list[int]
    reused: list[int]
    wall_s: float = 0.0
    cpu_s: float = 0.0
    layers_run: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class _StopForward(Exception):
    """Raised by a forward hook after the last needed layer: nothing later is computed."""


def token_hash(ids: torch.Tensor) -> str:
    """sha256 of a block's token ids as little-endian int64."""
    return hashlib.sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def _raise_stop(*_args) -> None:
    raise _StopForward


def capture_sequence(model: torch.nn.Module, ids: torch.Tensor, layers: Sequence[int]) -> dict[int, LayerStates]:
    """One forward of ``ids (1, N)`` through the decoder up to ``max(layers)`` (the rest of the model is skipped),
    returning each layer's q, k, v and exact attention output (fp32, CPU) with batch dimension 1."""
    from ..models import capture_qkv

    layers = sorted(set(layers))
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids: expected one sequence of shape (1, N), got {tuple(ids.shape)}")
    base = getattr(model, "model", model)
    stop = base.layers[layers[-1]].register_forward_hook(_raise_stop)
    try:
        with torch.no_grad(), capture_qkv(model, layers, outputs=True, device="cpu") as rec:
            with contextlib.suppress(_StopForward):
                base(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
            out = {}
            for i in layers:
                q, k, v, o, scale = rec[i]
                out[i] = LayerStates(*(t.float() for t in (q, k, v, o)), scale)
    finally:
        stop.remove()
    return out


class QKVCache:
    """Captured attention states of the blocks ``ids (n, N)`` of one split (see the module docstring).

    Args:
        root: cache root (e.g. ``runs/qkv``).
        key: what the blocks are (model, text source, split, block length, tokenizer fingerprint).
        ids: the split's token blocks ``(n, N)``; block b of the cache is ``ids[b]``.
    """

    def __init__(self, root: str | os.PathLike, key: CacheKey, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[1] != key.block_len:
            raise ValueError(f"ids: expected blocks of shape (n, {key.block_len}), got {tuple(ids.shape)}")
        self.key = key
        self.ids = ids
        self.dir = Path(root) / _slug(key.model) / f"{key.split}_N{key.block_len}"
        manifest = self.dir / "manifest.json"
        want = {"format": FORMAT, **asdict(key)}
        if manifest.exists():
            have = read_json(manifest, what="QKV cache manifest")
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            if diff:
                details = "; ".join(f"{k}: cached {have.get(k)!r} vs requested {want.get(k)!r}" for k in diff)
                raise ValueError(f"cache: {self.dir} holds states of different data ({details}); use another --cache")
        else:
            write_json(manifest, want)

    def path(self, block: int) -> Path:
        return self.dir / f"block_{block:04d}.safetensors"

    def _check_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.ids.shape[0]:
            raise ValueError(
                f"blocks: expected block indices in [0, {self.ids.shape[0]}) ({self.key.split} has "
                f"{self.ids.shape[0]} blocks of {self.key.block_len} tokens), got {block!r}"
            )

    def stored_layers(self, block: int) -> set[int] | None:
        """Layers the block's file holds, None if there is no file. A file for other tokens raises ValueError."""
        self._check_block(block)
        path = self.path(block)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
        except SafetensorError as e:
            raise IntegrityError(
                f"cache: {path} is not a readable safetensors file, truncated or altered ({e}); delete it to "
                "recapture the block"
            ) from None
        if meta.get("format") != FORMAT or meta.get("tokens_sha256") != token_hash(self.ids[block]):
            raise ValueError(
                f"cache: {path} holds other tokens than block {block} of {self.key.text_source} "
                f"(N={self.key.block_len}); delete it or use another --cache"
            )
        return {int(x) for x in meta["layers"].split(",")}

    def missing(self, blocks: Sequence[int], layers: Sequence[int]) -> list[int]:
        """Blocks whose file is absent or lacks one of ``layers``."""
        need = set(layers)
        return [b for b in blocks if not need <= (self.stored_layers(b) or set())]

    def ensure(
        self,
        model: torch.nn.Module,
        blocks: Sequence[int],
        layers: Sequence[int],
        *,
        progress: bool = True,
        processes: Processes | None = None,
    ) -> CaptureStats:
        """Capture every block of ``blocks`` that lacks one of ``layers`` (one forward per block). With several
        ``processes`` (all calling this with the same arguments) each captures every ``world``-th missing block
        and all return once every block is written."""
        processes = Processes() if processes is None else processes
        blocks, layers = list(blocks), sorted(set(layers))
        if not layers:
            raise ValueError("layers: expected at least one layer")
        todo = self.missing(blocks, layers)
        stats = CaptureStats(captured=todo, reused=[b for b in blocks if b not in todo])
        if not todo:
            return stats
        processes.barrier()  # every process has listed the same missing blocks before any is written
        self._capture(model, processes.shard(todo), layers, stats, progress=progress and processes.is_main)
        processes.barrier()
        return stats

    def _capture(
        self, model: torch.nn.Module, todo: list[int], layers: list[int], stats: CaptureStats, *, progress: bool
    ) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not progress,
        )
        t0, c0 = time.perf_counter(), time.process_time()
        with bar:
            task = bar.add_task(f"capturing {self.key.split} blocks (N={self.key.block_len})", total=len(todo))
            for b in todo:
                wanted = sorted(set(layers) | (self.stored_layers(b) or set()))
                states = capture_sequence(model, self.ids[b][None], wanted)
                self._write(b, states)
                stats.layers_run += wanted[-1] + 1
                bar.advance(task)
        stats.wall_s, stats.cpu_s = time.perf_counter() - t0, time.process_time() - c0
        logger.info("captured %d blocks in %.1f s wall, %.1f s CPU", len(todo), stats.wall_s, stats.cpu_s)

    def _write(self, block: int, states: dict[int, LayerStates]) -> None:
        tensors = {}
        scales = set()
        for i, st in states.items():
            for name in ("q", "k", "v", "o"):
                tensors[f"layers.{i}.{name}"] = getattr(st, name)[0].contiguous()
            scales.add(st.scale)
        if len(scales) != 1:
            raise ValueError(f"model: expected one softmax scale for all layers, got {sorted(scales)}")
        meta = {
            "format": FORMAT,
            "tokens_sha256": token_hash(self.ids[block]),
            "layers": ",".join(str(i) for i in sorted(states)),
            "scale": repr(scales.pop()),
        }
        save_tensors(self.path(block), tensors, metadata=meta)

    def layer(self, layer: int, blocks: Sequence[int], *, outputs: bool = False) -> LayerStates:
        """States of ``layer`` for ``blocks``, stacked on a leading sequence dimension (fp32, CPU)."""
        parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("q", "k", "v", "o")}
        scale = None
        names = ("q", "k", "v", "o") if outputs else ("q", "k", "v")
        for b in blocks:
            stored = self.stored_layers(b)
            if stored is None or layer not in stored:
                raise ValueError(f"blocks: block {b} has no captured layer {layer} in {self.dir}; run ensure() first")
            tensors, meta = load_tensors(self.path(b), [f"layers.{layer}.{n}" for n in names], what="cache")
            for n in names:
                parts[n].append(tensors[f"layers.{layer}.{n}"])
            scale = float(meta["scale"])
        if not parts["q"]:
            raise ValueError("blocks: expected at least one block")
        stacked = {n: torch.stack(parts[n]) if parts[n] else None for n in parts}
        return LayerStates(stacked["q"], stacked["k"], stacked["v"], stacked["o"], scale)


def parse_indices(text: str, name: str) -> list[int]:
    """``"3-26"``, ``"4,12,20"``, ``"0-3,8"`` -> sorted distinct non-negative integers (ValueError naming ``name``)."""
    out: list[int] = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ValueError(f"{name}: expected indices like '3-26' or '4,12,20', got {text!r}") from None
    if not out or min(out) < 0 or len(set(out)) != len(out):
        raise ValueError(f"{name}: expected distinct non-negative indices, got {text!r}")
    return sorted(out)


def format_indices(idx: Sequence[int]) -> str:
    """Inverse of :func:`parse_indices` for display: ``[3, 4, 5, 9]`` -> ``"3-5,9"``."""
    idx = sorted(idx)
    runs: list[str] = []
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        runs.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(runs)


def open_cache(
    root: str | os.PathLike,
    model_name: str,
    tokenizer,
    split: str,
    block_len: int,
    *,
    data_dir: str | os.PathLike | None = None,
    model_source: str = "",
) -> QKVCache:
    """The cache of ``split``'s blocks of ``block_len`` tokens (tokenised with ``tokenizer``, see
    :func:`oal.data.blocks`) for ``model_name``."""
    from ..data import blocks as token_blocks
    from ..data import tokenizer_fingerprint

    tb = token_blocks(tokenizer, split, block_len, data_dir=data_dir)
    key = CacheKey(
        model=model_name,
        model_source=model_source,
        text_source=tb.source,
        split=split,
        block_len=block_len,
        tokenizer=tokenizer_fingerprint(tokenizer),
    )
    return QKVCache(root, key, tb.ids)
