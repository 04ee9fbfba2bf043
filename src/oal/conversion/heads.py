"""Which KV heads does in-context retrieval need? Scores from the original model's attention on synthetic
retrieval prompts, and the conversion step that keeps the best-scoring heads exact
(:class:`oal.kernels.ExactHeadsKernel`).

Score of (layer, KV head): on passkey / multi-key prompts teacher-forced with their answer, the softmax
attention mass that the positions predicting the answer digits put on the needle's digit tokens, averaged over
prompts and positions, maximised over the KV head's query heads (one query head that copies is enough to need
the group's exact cache). Heads that copy the key from the needle score near 1, heads that look locally near 0.
This is the "retrieval head" criterion of the literature (attention on the copied token), measured with a
haystack of natural text (the calibration split), not the filler the retrieval evaluation uses.

Copy scores miss the heads whose *approximation* fails at long range: :func:`approximation_error_scores`
measures, on one long block of natural text, how far each converted layer's kernel output is from the softmax
output it replaces, per KV head. On SmolLM2 the heads of layers 3–10 are copied from by nobody and yet,
converted, lose 8k retrieval (docs/results/conversion).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import torch
from rich.progress import track
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..evaluation.retrieval import build_prompt
from ..kernels import AttentionKernel, ExactHeadsKernel, OALKernel, SinkWindowKernel, repeat_kv
from ..models import attach_kernel, attached_kernels, attention_spec, capture_qkv

__all__ = [
    "add_exact_heads",
    "approximation_error_scores",
    "gate_gradient_scores",
    "output_errors",
    "rank_heads",
    "retrieval_head_scores",
    "set_exact_decode_budget",
    "set_exact_kv_dtype",
]


@torch.inference_mode()
def retrieval_head_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    haystack: Sequence[str],
    *,
    lengths: Sequence[int] = (1024, 2048),
    prompts: int = 8,
    tasks: Sequence[str] = ("passkey", "multikey"),
    seed: int = 1,
    target: str = "digits",
    progress: bool = True,
) -> torch.Tensor:
    """``(num_layers, Hkv)`` retrieval scores in [0, 1] of the (unconverted) ``model``; see the module doc.

    ``prompts`` per (task, length); ``haystack``: sentences of text the evaluation never uses. ``target``:
    ``"digits"`` scores the mass that the answer-predicting positions put on the needle's answer digits,
    ``"needle"`` the mass that the question's and the answer-predicting positions put on the whole needle
    sentence (also the heads that find the needle, not only those that copy it)."""
    if target not in ("digits", "needle"):
        raise ValueError(f"target: expected 'digits' or 'needle', got {target!r}")
    spec = attention_spec(model)
    if attached_kernels(model):
        raise ValueError("model: score heads on the original model (it has kernels attached)")
    g = spec.num_heads // spec.num_kv_heads
    total = torch.zeros(spec.num_layers, spec.num_heads, dtype=torch.float64)
    count = 0
    jobs = [(t, n, i) for t in tasks for n in lengths for i in range(prompts)]
    device = next(model.parameters()).device
    for task, n, i in track(jobs, description="retrieval head scores", disable=not progress):
        p = build_prompt(tokenizer, n, random.Random(f"heads/{seed}/{task}/{n}/{i}"), task=task, haystack=haystack)
        answer = tokenizer(" " + p.answer, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p.ids + answer], device=device)
        first = len(p.ids) - 1 if target == "digits" else p.question
        rows = torch.arange(first, len(p.ids) + len(answer) - 1, device=device)
        span = p.needle if target == "digits" else p.sentence
        with capture_qkv(model, device=None) as rec:
            model(input_ids=ids, use_cache=False)
        future = torch.arange(ids.shape[1], device=device)[None, None, :] > rows[None, :, None]
        for layer in range(spec.num_layers):
            q, k, _, _, scale = rec[layer]
            logits = (q[0, :, rows].double() @ repeat_kv(k, spec.num_heads)[0].double().mT) * scale
            logits = logits.masked_fill(future, float("-inf"))
            mass = logits.softmax(-1)[..., span[0] : span[1]].sum(-1)  # (Hq, P)
            total[layer] += mass.mean(-1).cpu()
        count += 1
    per_q = total / count
    return per_q.view(spec.num_layers, spec.num_kv_heads, g).amax(-1).float()


@torch.inference_mode()
def approximation_error_scores(
    model: PreTrainedModel, kernels: Mapping[int, AttentionKernel], ids: torch.Tensor, *, skip: int = 1024
) -> torch.Tensor:
    """``(num_layers, Hkv)``: for each layer in ``kernels`` and KV head, the relative error
    ``‖o_kernel − o_softmax‖ / ‖o_softmax‖`` of the attention output over the positions ``skip …`` of ``ids``
    ``(1, N)``, maximised over the KV head's query heads; both outputs from the q, k, v of the *unconverted*
    ``model`` (so the errors of earlier layers do not enter). Layers without a kernel score 0.

    The positions before ``skip`` are left out because there a sinks + window kernel is (nearly) exact; the
    score asks what the kernel part does with the far context. ``kernels`` are the converted layers' kernels
    (e.g. ``attached_kernels(converted)``); ``model`` must have none attached."""
    spec = attention_spec(model)
    if attached_kernels(model):
        raise ValueError("model: score the kernels on the original model's q/k/v (it has kernels attached)")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids: expected shape (1, N), got {tuple(ids.shape)}")
    if not 0 <= skip < ids.shape[1]:
        raise ValueError(f"skip: expected 0 <= skip < N = {ids.shape[1]}, got {skip}")
    bad = sorted(set(kernels) - set(range(spec.num_layers)))
    if bad:
        raise ValueError(f"kernels: layers {bad} do not exist (the model has {spec.num_layers})")
    g = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(spec.num_layers, spec.num_heads)
    device = next(model.parameters()).device
    with capture_qkv(model, layers=sorted(kernels), device=None) as rec:
        model(input_ids=ids.to(device), use_cache=False)
    for layer, kernel in sorted(kernels.items()):
        q, k, v, _, scale = rec[layer]
        out[layer] = output_errors(kernel, q, k, v, scale, skip=skip).cpu()
    return out.view(spec.num_layers, spec.num_kv_heads, g).amax(-1)


@torch.inference_mode()
def output_errors(
    kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, skip: int = 0
) -> torch.Tensor:
    """``(Hq,)``: ``‖o_kernel − o_softmax‖ / ‖o_softmax‖`` per query head over the positions ``skip …`` of one
    sequence, q ``(1, Hq, N, d)``, k, v ``(1, Hkv, N, d)`` as :func:`oal.models.capture_qkv` records them."""
    exact = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )[0, :, skip:]
    approx = kernel(q, k, v)[0][0, :, skip:]
    return (approx - exact).float().norm(dim=(-1, -2)) / exact.float().norm(dim=(-1, -2)).clamp_min(1e-30)


def rank_heads(scores: torch.Tensor, layers: Iterable[int]) -> list[tuple[int, int]]:
    """(layer, KV head) pairs of ``layers``, best retrieval score first (ties: lower layer, lower head)."""
    pairs = [(layer, h) for layer in layers for h in range(scores.shape[1])]
    return sorted(pairs, key=lambda lh: (-float(scores[lh[0], lh[1]]), lh[0], lh[1]))


def add_exact_heads(
    model: PreTrainedModel,
    heads: Mapping[int, Sequence[int]],
    *,
    kv_dtype: torch.dtype | None = None,
    product_dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Keep the KV heads ``heads[layer]`` of converted layers exact: each such layer's kernel (OAL, global, or
    either with sinks + window) is wrapped in an :class:`ExactHeadsKernel` (storing the exact keys and values in
    ``kv_dtype``, None: the model's dtype; ``product_dtype`` bf16: their products on bf16 numbers), in place; the
    conversion record lists them under ``exact_heads``. Returns the model."""
    from .convert import CONFIG_KEY, conversion_info

    info = conversion_info(model)
    kernels = attached_kernels(model)
    if info is None:
        raise ValueError("model: not a converted model (no config.oal_conversion); call convert_model first")
    wrapped = {}
    for layer, kv in sorted(heads.items()):
        if not kv:
            continue
        if layer not in kernels:
            raise ValueError(f"heads: layer {layer} is not converted (converted layers: {sorted(kernels)})")
        inner = kernels[layer]
        if not isinstance(inner, (OALKernel, SinkWindowKernel)):
            raise ValueError(
                f"heads: layer {layer} has a {type(inner).__name__}; exact heads wrap OAL / global kernels with or "
                "without sinks and a window"
            )
        wrapped[layer] = ExactHeadsKernel(inner, list(kv), kv_dtype, product_dtype)
    for layer, kernel in wrapped.items():
        attach_kernel(model, layer, kernel)
    record = {str(layer): list(k.exact_kv_heads) for layer, k in wrapped.items()}
    setattr(model.config, CONFIG_KEY, {**info, "exact_heads": record})
    return model


def set_exact_kv_dtype(model: PreTrainedModel, kv_dtype: torch.dtype | None) -> int:
    """Store the exact heads' keys and values of every :class:`ExactHeadsKernel` of ``model`` in ``kv_dtype`` (None:
    the model's dtype, ``torch.bfloat16`` or ``torch.int8``, the 8-bit exact cache) from now on, in place; their
    products keep their dtype. Nothing else changes (the dtype is what a recipe applies when it saves, after every
    stage). Returns the number of layers changed; raises where a kernel's bf16 products would lose the bf16 or int8
    keys they need."""
    kernels = [k for k in attached_kernels(model).values() if isinstance(k, ExactHeadsKernel)]
    if not kernels:
        raise ValueError("model: no layer has exact heads (ExactHeadsKernel) whose keys and values could be re-stored")
    for kernel in kernels:  # the constructor's checks, before any kernel changes
        ExactHeadsKernel(kernel.inner, kernel.exact_kv_heads, kv_dtype, kernel.product_dtype)
    for kernel in kernels:
        kernel.kv_dtype = kv_dtype
    return len(kernels)


def set_exact_decode_budget(model: PreTrainedModel, budget: int | None, page: int = 64) -> int:
    """Give every :class:`ExactHeadsKernel` of ``model`` a decode budget (``budget`` keys in pages of ``page``; None:
    every decode step attends to all keys), in place: a one-token step over more keys than the budget attends to
    the pages :func:`oal.ops.page_select.select_pages` picks. Prompts, and so perplexity over whole texts, are
    unchanged. Returns the number of layers changed; raises on a budget the kernels refuse, before any changes."""
    from ..ops.page_select import check_budget

    kernels = [k for k in attached_kernels(model).values() if isinstance(k, ExactHeadsKernel)]
    if not kernels:
        raise ValueError("model: no layer has exact heads (ExactHeadsKernel) that a decode budget could apply to")
    check_budget(budget, page)
    for kernel in kernels:
        kernel.decode_budget, kernel.decode_page = budget, page
    return len(kernels)


class _GatedKernel(AttentionKernel):
    """``α_h · softmax + (1 - α_h) · inner`` per KV head h (its query heads), for :func:`gate_gradient_scores`."""

    def __init__(self, inner: AttentionKernel, alpha: torch.Tensor) -> None:
        super().__init__(inner.num_heads, inner.num_kv_heads, inner.head_dim)
        self.inner = inner
        self.alpha = alpha

    def forward(self, q, k, v, *, mode="chunk", initial_state=None, output_final_state=False):
        if initial_state is not None or output_final_state:
            raise ValueError("initial_state: the gated kernel scores heads on whole sequences only")
        approx, _ = self.inner(q, k, v)
        exact = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        a = self.alpha.repeat_interleave(self.num_heads // self.num_kv_heads)[None, :, None, None].to(q.dtype)
        return a * exact + (1 - a) * approx, None


def gate_gradient_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    haystack: Sequence[str],
    *,
    lengths: Sequence[int] = (1024,),
    prompts: int = 4,
    tasks: Sequence[str] = ("passkey", "multikey"),
    seed: int = 2,
    progress: bool = True,
) -> torch.Tensor:
    """``(num_layers, Hkv)``: how much the log-likelihood of retrieval answers rises, to first order, when a KV
    head of a converted layer moves from its kernel towards exact softmax (DuoAttention's per-head gate, scored by
    its gradient instead of trained). Every converted layer's attention becomes ``α · softmax + (1 - α) · kernel``
    per KV head with α = 1 on heads already exact and 0 elsewhere; the score is ``∂ log p(answer) / ∂α`` summed
    over ``prompts`` teacher-forced retrieval prompts per (task, length). Layers that are not converted score 0.
    Unlike :func:`retrieval_head_scores` it sees the converted model's own errors (heads whose approximation
    misleads the copy), at the cost of a backward pass per prompt."""
    spec = attention_spec(model)
    kernels = attached_kernels(model)
    if not kernels:
        raise ValueError("model: expected a converted model (no kernels are attached)")
    gates: dict[int, torch.Tensor] = {}
    originals = dict(kernels)
    for layer, kernel in kernels.items():
        inner, exact = (kernel.inner, kernel.exact_kv_heads) if isinstance(kernel, ExactHeadsKernel) else (kernel, ())
        alpha = torch.zeros(spec.num_kv_heads, dtype=torch.float32, requires_grad=True)
        with torch.no_grad():
            alpha[list(exact)] = 1.0
        gates[layer] = alpha
        attach_kernel(model, layer, _GatedKernel(inner, alpha))
    total = torch.zeros(spec.num_layers, spec.num_kv_heads)
    device = next(model.parameters()).device
    jobs = [(t, n, i) for t in tasks for n in lengths for i in range(prompts)]
    try:
        for task, n, i in track(jobs, description="gate gradients", disable=not progress):
            p = build_prompt(tokenizer, n, random.Random(f"gates/{seed}/{task}/{n}/{i}"), task=task, haystack=haystack)
            answer = tokenizer(" " + p.answer, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p.ids + answer], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0, len(p.ids) - 1 : -1].float()
            logp = logits.log_softmax(-1).gather(-1, ids[0, len(p.ids) :, None]).sum()
            grads = torch.autograd.grad(logp, [gates[layer] for layer in sorted(gates)])
            for layer, g in zip(sorted(gates), grads, strict=True):
                total[layer] += g.detach().cpu()
    finally:
        for layer, kernel in originals.items():
            attach_kernel(model, layer, kernel)
    return total / len(jobs)
