"""The resumable LoRA adaptation loop of App. F.2 on top of ``accelerate``.

:func:`finetune` takes a ready (converted) causal LM and writes into its run directory

* ``config.json``: the protocol, the data and the model identity, written when the run starts;
* ``train_log.jsonl``: one line per update (step, loss, lr, grad_norm, blocks, time of the update);
* ``val.jsonl``: one line per validation point (step, nll, ppl, tokens, time);
* ``checkpoints/step-XXXXXX/``: the latest resumable state (:mod:`oal.training.checkpoint`);
* ``best/``: the best checkpoint by validation NLL (:mod:`oal.training.export`);
* ``summary.json``: config, data description, best validation NLL/PPL, updates, wall time, provenance.

Calling it again on the same run directory resumes from the latest checkpoint (verified against its manifest and
against the run's identity) and ends with exactly the result an uninterrupted run would have given, because the
data order is a fixed function of the seed, dropout is reseeded before every update, and parameters, AdamW and
scheduler states are restored bit for bit.

The loop runs unchanged under ``accelerate launch`` or ``torchrun`` (docs/distributed.md): with A =
``config.grad_accum``, process r of P trains on blocks ``order[s, r·A : (r+1)·A]`` at update s (global batch P·A),
gradients are averaged by accelerate's DDP wrapper (all-reduced once per update), validation blocks are shared out
and their NLL sums reduced, and only the main process writes files. The dropout masks of a block depend on its
slot ``r·A + j`` in the global batch, not on the process, so one process with ``grad_accum=P`` follows the same
trajectory as P processes.

``fsdp=True`` shards the model instead of replicating it (torch's FSDP2, :func:`fsdp_shard`): each decoder block
is one unit, so a process holds 1/P of the backbone, LoRA and kernel parameters and of the AdamW state. Gradients
are reduce-scattered (averaged as under DDP); checkpoints and ``best/`` hold whole tensors gathered from the shards,
in the same files as an unsharded run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from peft import PeftModel
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from ..distributed import launched_world_size
from ..io import provenance, write_json, write_text
from ..models import attached_kernels, get_decoder_layers
from .checkpoint import CheckpointError, latest_checkpoint, load_training_state, save_training_state
from .config import FinetuneConfig
from .data import FinetuneData, prepare_data, tensor_sha256, training_order
from .export import export_finetuned, export_state, kernel_configs
from .lora import (
    apply_lora,
    full_tensor,
    is_kernel_parameter,
    load_trainable_state,
    trainable_parameters,
    trainable_state,
)
from .schedule import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"


@dataclass
class FinetuneResult:
    """``model``: the PEFT model holding the best checkpoint's weights; ``summary``: what ``summary.json`` holds."""

    model: PeftModel
    summary: dict[str, Any]
    run_dir: Path


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a model's state dict (backbone and attached kernels);
    identifies the converted model a run started from, so a resume with another model is refused."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def dropout_seed(seed: int, step: int, slot: int) -> int:
    """The RNG seed for update ``step`` (0-based) and ``slot`` (the block's position in the global batch, the
    process index without accumulation): LoRA dropout masks are a fixed function of (seed, update, slot),
    independent of what ran before, which makes resuming exact."""
    digest = hashlib.sha256(f"oal.finetune:{seed}:{step}:{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def fsdp_shard(model: nn.Module, blocks: list[nn.Module], device: torch.device) -> None:
    """Shard ``model`` in place over the default process group with FSDP2 (``torch.distributed.fsdp.fully_shard``):
    one unit per decoder block in ``blocks``, the root unit for the rest (embeddings, final norm, LM head). Frozen
    and trainable parameters of a unit are sharded alike; parameters become DTensors on ``device``'s type."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


@torch.no_grad()
def validation_nll(
    model: nn.Module, blocks: torch.Tensor, accelerator: Accelerator, *, lockstep: bool = False
) -> tuple[float, int]:
    """Mean next-token NLL (nats/token) over ``blocks (V, L)`` and the number of predicted tokens, with the
    blocks shared out over the processes. Every block contributes its ``L − 1`` predictions.

    ``lockstep``: every process runs the same number of forwards (a sharded model gathers its parameters in each
    one, with every process taking part); a process with no block left repeats block 0 and discards the result."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    rank, world, count = accelerator.process_index, accelerator.num_processes, blocks.shape[0]
    rounds = -(-count // world) if lockstep else len(range(rank, count, world))
    for r in range(rounds):
        i = rank + r * world
        ids = blocks[i if i < count else 0][None].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        n = ids.shape[1] - 1 if i < count else 0
        total += torch.tensor([loss.double().item() * n, n], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(total, "sum")
    model.train(was_training)
    nll, tokens = float(total[0] / total[1]), int(total[1])
    return nll, tokens


def _differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """Human-readable ``key: saved -> now`` lines where two JSON-like values differ (nested dicts descended)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [
            d for k in sorted(set(saved) | set(now)) for d in _differences(saved.get(k), now.get(k), f"{prefix}{k}.")
        ]
    if saved == now:
        return []
    short = [v if len(repr(v)) < 80 else f"{repr(v)[:77]}..." for v in (saved, now)]
    return [f"{prefix.rstrip('.')}: {short[0]!r} in the checkpoint, {short[1]!r} now"]


def _jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def finetune(
    model: nn.Module,
    config: FinetuneConfig,
    out_dir: str | os.PathLike,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    data: FinetuneData | None = None,
    data_dir: str | os.PathLike | None = None,
    accelerator: Accelerator | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    fsdp: bool = False,
) -> FinetuneResult:
    """Adapt a converted model with LoRA + its kernel parameters (App. F.2), resuming ``out_dir`` if it holds a
    checkpoint of the same run.

    Args:
        model: a transformers causal LM, kernels attached with :func:`oal.models.attach_kernel` (none: the
            LoRA-adapted softmax reference). It is wrapped with LoRA **in place**.
        config: the protocol (:func:`oal.training.preset`).
        out_dir: the run directory.
        tokenizer: used to cut the valid split into blocks (:func:`prepare_data`) unless ``data`` is given.
        data: ready training/validation blocks of ``config.block_len`` tokens.
        accelerator: an ``accelerate.Accelerator`` whose mixed precision matches the config (default: a new one).
        on_step: called after every update (on every process) with that update's log record; validation points
            add ``val_nll``. An exception raised here stops the run as a kill would.
        fsdp: shard the model over the processes (FSDP2, :func:`fsdp_shard`) instead of replicating it (DDP);
            needs at least 2 processes. accelerate's own FSDP mode is refused: use this instead.

    Returns:
        :class:`FinetuneResult` with the best checkpoint's weights loaded into the returned model.
    """
    if not isinstance(config, FinetuneConfig):
        raise ValueError(f"config: expected a FinetuneConfig, got {type(config).__name__}")
    if data is None:
        if tokenizer is None:
            raise ValueError("tokenizer: needed to build the training blocks when data is not given")
        data = prepare_data(tokenizer, config, data_dir=data_dir)
    if data.train.shape[1] != config.block_len or data.val.shape != (config.val_blocks, config.block_len):
        raise ValueError(
            f"data: expected blocks of {config.block_len} tokens and {config.val_blocks} validation blocks, got "
            f"train {tuple(data.train.shape)}, val {tuple(data.val.shape)}"
        )
    acc = accelerator if accelerator is not None else Accelerator(mixed_precision=config.mixed_precision)
    if str(acc.mixed_precision) != config.mixed_precision:
        raise ValueError(
            f"accelerator: mixed precision {acc.mixed_precision!r} differs from config.mixed_precision "
            f"{config.mixed_precision!r}"
        )
    launched = launched_world_size()
    if acc.num_processes != launched:
        # e.g. torchrun on a machine without GPUs and without ACCELERATE_USE_CPU: every process would train alone
        # and all of them would write the same run directory
        raise ValueError(
            f"accelerator: the launcher started {launched} processes but accelerate joined {acc.num_processes}; "
            "on CPUs set ACCELERATE_USE_CPU=1 (docs/distributed.md)"
        )
    if acc.distributed_type == DistributedType.FSDP:
        raise ValueError(
            "accelerator: accelerate's FSDP mode wraps the model its own way; launch with a plain multi-process "
            "config and pass fsdp=True (`oal finetune --fsdp`), which shards with torch FSDP2 (docs/distributed.md)"
        )
    if fsdp and acc.num_processes < 2:
        raise ValueError(f"fsdp: sharding needs at least 2 processes, got {acc.num_processes}")
    if config.mixed_precision == "bf16" and acc.device.type == "cpu":
        logger.warning("bf16 autocast on a CPU: without native bf16 matmuls it is several times slower than fp32")
    out = Path(out_dir)
    rank, world, accum = acc.process_index, acc.num_processes, config.grad_accum

    kernels = attached_kernels(model)
    fingerprint = model_fingerprint(model)
    # what `oal eval --model <run>` loads the adapter onto (a name, a directory or a Hub id)
    base_model = str(getattr(model.config, "_name_or_path", "") or "")
    set_seed(config.seed)  # LoRA A initialisation
    peft_model = apply_lora(model, config)
    if fsdp:
        fsdp_shard(peft_model, list(get_decoder_layers(peft_model)), acc.device)
    params = trainable_parameters(peft_model)
    order = training_order(data.train.shape[0], config.updates, config.seed, world * accum)
    identity = {
        "protocol": config.protocol(),
        # the token hashes identify the data; the source label may name a path that moved between restarts
        "data": {k: v for k, v in data.description.items() if k != "source"},
        "order_sha256": tensor_sha256(order),
        "num_processes": world,
        "model_fingerprint": fingerprint,
        "kernels_sha256": _sha(kernel_configs(kernels)),
        "trainable": sorted(params),
        **({"fsdp": True} if fsdp else {}),  # sharded optimizer states are saved in another layout
    }

    raw_optimizer = build_optimizer(params.values(), config)
    scheduler = build_scheduler(raw_optimizer, config)
    # The scheduler is stepped here once per global update; accelerate would step it once per process.
    if fsdp:  # already sharded: accelerate must not wrap it in DDP
        train_model, optimizer, forward_context = peft_model, acc.prepare(raw_optimizer), acc.autocast
    else:
        train_model, optimizer = acc.prepare(peft_model, raw_optimizer)
        forward_context = nullcontext

    state: dict[str, Any] = {
        "step": 0,
        "best": None,
        "train_log": [],
        "val_log": [],
        "train_seconds": 0.0,
        "resumed_at": [],
    }
    best_state = None
    ckpt = latest_checkpoint(out / CHECKPOINTS)
    if ckpt is not None:
        loaded = load_training_state(ckpt)
        diff = _differences(loaded.state.get("identity"), identity)
        if diff:
            raise CheckpointError(
                f"{ckpt}: belongs to a different run ({'; '.join(diff)}); use another output directory"
            )
        load_trainable_state(peft_model, loaded.trainable)
        if fsdp:
            set_optimizer_state_dict(
                peft_model, raw_optimizer, loaded.optimizer, options=StateDictOptions(full_state_dict=True)
            )
        else:
            optimizer.load_state_dict(loaded.optimizer)
        scheduler.load_state_dict(loaded.state["scheduler"])
        state = {k: loaded.state[k] for k in state}
        state["resumed_at"].append(state["step"])
        best_state = loaded.best
        logger.info("resuming %s from update %d of %d", out, state["step"], config.updates)

    if acc.is_main_process:
        write_json(out / "config.json", {"config": config.to_dict(), **identity})
        write_text(out / "train_log.jsonl", _jsonl(state["train_log"]))
        write_text(out / "val.jsonl", _jsonl(state["val_log"]))
    acc.wait_for_everyone()

    def info(best: dict[str, Any]) -> dict[str, Any]:
        return {
            **best,
            "config": config.to_dict(),
            "data": data.description,
            "model_fingerprint": fingerprint,
            "base_model": base_model,
        }

    segment_start = time.perf_counter()
    for step in range(state["step"], config.updates):
        t0 = time.perf_counter()
        train_model.train()
        loss = torch.zeros((), device=acc.device)
        for j in range(accum):
            slot = rank * accum + j
            ids = data.train[int(order[step, slot])][None].to(acc.device)
            torch.manual_seed(dropout_seed(config.seed, step, slot))
            # DDP all-reduces the gradients once, in the last micro-step's backward
            with acc.no_sync(train_model) if j < accum - 1 and not fsdp else nullcontext(), forward_context():
                micro = train_model(input_ids=ids, labels=ids, use_cache=False).loss / accum
                acc.backward(micro)
            loss += micro.detach()
        grad_norm = full_tensor(acc.clip_grad_norm_(list(params.values()), config.max_grad_norm))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        record = {
            "step": step + 1,
            "loss": float(acc.reduce(loss.detach().float(), "mean")),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "blocks": order[step].tolist(),
            "time": time.perf_counter() - t0,  # the update alone; validation is timed in val.jsonl
        }
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            raise FloatingPointError(f"update {step + 1}: non-finite loss or gradient norm ({record})")
        if config.is_validation_step(step + 1):
            tv = time.perf_counter()
            with forward_context():
                nll, tokens = validation_nll(train_model, data.val, acc, lockstep=fsdp)
            val = {"step": step + 1, "nll": nll, "ppl": math.exp(nll), "tokens": tokens}
            val["time"] = time.perf_counter() - tv
            state["val_log"].append(val)
            record["val_nll"] = nll
            if state["best"] is None or nll < state["best"]["val_nll"]:
                state["best"] = {"step": step + 1, "val_nll": nll, "val_ppl": math.exp(nll)}
                best_state = trainable_state(peft_model)  # every process: gathers FSDP shards
                exported = export_state(peft_model, kernels, best_state)
                if acc.is_main_process:
                    export_finetuned(peft_model, kernels, out / "best", info(state["best"]), exported)
            if acc.is_main_process:
                with open(out / "val.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps(val) + "\n")
        state["train_log"].append(record)
        state["step"] = step + 1
        if acc.is_main_process:
            with open(out / "train_log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        if config.is_checkpoint_step(step + 1):
            trainable = trainable_state(peft_model)  # every process: gathers FSDP shards
            if fsdp:
                opt_state = get_optimizer_state_dict(
                    peft_model, raw_optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                )
            else:
                opt_state = optimizer.state_dict()
            if acc.is_main_process:
                save_training_state(
                    out / CHECKPOINTS,
                    step + 1,
                    trainable=trainable,
                    best=best_state,
                    optimizer=opt_state,
                    state={
                        **state,
                        "train_seconds": state["train_seconds"] + time.perf_counter() - segment_start,
                        "scheduler": scheduler.state_dict(),
                        "identity": identity,
                    },
                )
            acc.wait_for_everyone()
        if on_step is not None:
            on_step(record)

    state["train_seconds"] += time.perf_counter() - segment_start
    load_trainable_state(peft_model, best_state)
    n_kernel = sum(p.numel() for name, p in params.items() if is_kernel_parameter(name))
    summary = {
        "config": config.to_dict(),
        "data": {**data.description, "order_sha256": identity["order_sha256"], "global_batch": world * accum},
        "model": {
            "name_or_path": str(getattr(getattr(model, "config", None), "_name_or_path", "")),
            "fingerprint": fingerprint,
            "converted_layers": sorted(kernels),
            "kernels": {str(layer): k.name for layer, k in sorted(kernels.items())},
            "trainable_parameters": {"lora": sum(p.numel() for p in params.values()) - n_kernel, "kernel": n_kernel},
        },
        "best": state["best"],
        "final_val": state["val_log"][-1],
        "updates": config.updates,
        "train_tokens": config.updates * world * accum * config.block_len,
        "train_seconds": state["train_seconds"],
        "resumed_at": state["resumed_at"],
        "num_processes": world,
        "mixed_precision": config.mixed_precision,
        "provenance": provenance(device=str(acc.device)),
    }
    exported = export_state(peft_model, kernels, best_state)
    if acc.is_main_process:
        export_finetuned(peft_model, kernels, out / "best", info(state["best"]), exported)
        write_json(out / "summary.json", summary)
    acc.wait_for_everyone()
    return FinetuneResult(peft_model, summary, out)
