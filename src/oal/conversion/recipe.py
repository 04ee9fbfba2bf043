"""Conversion recipes: every stage from a pretrained model to the converted model users run, as one call.

``retrieval`` (the default recipe; beyond the paper; docs/results/conversion):

1. **Calibrate** (Eq. 20 on frozen Q/K/V, WikiText-2 *valid* blocks 16–25 at N = 1024) ``oal+sink+window`` with
   4 exact sinks and a 256-token exact window in *every* layer. Layers with a committed plain-OAL calibration
   (``docs/results/calibration/oal_3-26``) start from it, the others from the Taylor kernel.
2. **Kernel scale for long contexts:** every head's log-scale β is lowered by ``beta_offset`` (5 nats). β is
   fitted at N ≤ 1024, where the kernel part covers at most ~770 keys; its mass grows with the number of keys,
   and on long repetitive contexts the calibrated β lets the averaged far context outweigh the exact window and
   heads (the converted model then continues the filler instead of retrieving). Chosen on retrieval prompts
   that the evaluation does not use; the held-out perplexity hardly moves (docs/results/conversion).
3. **Retrieval heads:** the ``exact_heads`` KV heads with the highest copy score on the original model
   (:func:`oal.conversion.heads.retrieval_head_scores`, WikiText-2 valid text as haystack) keep exact softmax
   attention with a full KV cache (:class:`oal.kernels.ExactHeadsKernel`).
4. **Heads the kernel approximates worst at long range:** the ``error_heads`` further KV heads whose converted
   output (β offset applied) is furthest from softmax on one ``error_len``-token block of WikiText-2 valid
   (tokens ``error_offset …``, after the calibration blocks) are kept exact too
   (:func:`oal.conversion.heads.approximation_error_scores`). Nobody copies from them, yet with them converted
   the model loses 8k retrieval (on SmolLM2 they are the heads of layers 3–10).
5. The exact heads' keys and values are stored in bf16 (``exact_kv_dtype``): half the part of the cache that
   grows with the context and of what a decode step reads from it; perplexity moves by ≤ 0.001 and passkey
   answers not at all (docs/results/conversion).
6. Their products take bf16 operands (``exact_product_dtype``; :class:`oal.kernels.ExactHeadsKernel`
   ``product_dtype``): the scaled queries and softmax weights rounded to bf16, fp32 sums; on a core with
   AVX512_BF16 the prompt's exact heads run ~1.6× faster. Applied when the model is saved, after every stage
   above (none of which runs the exact heads).
7. A decode step of the exact heads attends to at most ``exact_decode_budget`` (1024) of their keys once the
   context is longer: page 0, the two recent pages and the 64-key pages whose key bounds promise the highest scores
   (:class:`oal.kernels.ExactHeadsKernel` ``decode_budget``; Quest-style, :mod:`oal.ops.page_select`), so that the
   step reads about as much at 8k as at 1k. Prompts stay exact; passkey and multikey answers on the evaluation
   prompts are those of every key (docs/results/conversion). Applied when the model is saved.

``retrieval-fp32products`` is the default with fp32 products, ``retrieval-int8kv`` with int8 exact keys and
values (an 8-bit exact cache, one fp32 scale per token and head), ``retrieval-fp32kv`` with fp32 exact keys and
values (and products), ``retrieval-fulldecode`` without the decode budget (every decode step reads every exact
key: the default until stop 40). ``retrieval-copy`` is the recipe of stops
19–21 (the 20 copy-score heads only, fp32), ``retrieval-bf16kv`` the same with bf16 exact keys and values;
both keep 1k–4k retrieval and lose 8k. ``kernel-only`` keeps no exact head and no β offset.

The result is written with :func:`save_converted` as a kernels-only directory (``base_weights``) when the base
model is given by name (the embedded ``smollm2-135m`` or a Hub id), so it is a few MB and loads with
:func:`oal.models.load_model`; a base given as a local directory is copied in full.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..io import write_json

logger = logging.getLogger(__name__)

__all__ = ["KEEP", "RECIPES", "Recipe", "restore_converted", "run_recipe"]

DEFAULT_INIT = Path("docs/results/calibration/oal_3-26")
DEFAULT_GROUPS = Path("docs/results/calibration/groups.json")


@dataclass(frozen=True)
class Recipe:
    """Every number of a recipe (see the module docstring)."""

    name: str
    kernel: str = "oal+sink+window"
    layers: str = "all"
    n_sink: int = 4
    window: int = 256
    seq_len: int = 1024
    max_updates: int = 300
    beta_offset: float = -5.0
    exact_heads: int = 20
    score_lengths: tuple[int, ...] = (1024, 2048)
    score_prompts: int = 6
    seed: int = 0
    exact_kv_dtype: str | None = "bfloat16"  # None: the exact heads' keys and values in the model's dtype
    exact_product_dtype: str | None = "bfloat16"  # None: their products in the model's dtype (needs bf16 or int8 kv)
    error_heads: int = 28
    error_len: int = 8192
    error_offset: int = 32768
    # None: every decode step of the exact heads reads all their keys; N: a step over more keys attends to N of
    # them, pages of exact_decode_page keys (ExactHeadsKernel decode_budget; applied when the model is saved)
    exact_decode_budget: int | None = None
    exact_decode_page: int = 64


BUDGET = 1024  # the default recipe's exact_decode_budget

RECIPES = {
    "retrieval": Recipe("retrieval", exact_decode_budget=BUDGET),
    "retrieval-fulldecode": Recipe("retrieval-fulldecode"),
    "retrieval-fp32products": Recipe("retrieval-fp32products", exact_product_dtype=None, exact_decode_budget=BUDGET),
    # the 8-bit exact cache (ExactHeadsKernel kv_dtype int8: one fp32 scale per token and head)
    "retrieval-int8kv": Recipe("retrieval-int8kv", exact_kv_dtype="int8", exact_decode_budget=BUDGET),
    "retrieval-fp32kv": Recipe(
        "retrieval-fp32kv", exact_kv_dtype=None, exact_product_dtype=None, exact_decode_budget=BUDGET
    ),
    # stops 19–21: copy-score heads only (1k–4k retrieval, not 8k)
    "retrieval-copy": Recipe("retrieval-copy", exact_kv_dtype=None, exact_product_dtype=None, error_heads=0),
    "retrieval-bf16kv": Recipe("retrieval-bf16kv", exact_product_dtype=None, error_heads=0),
    # no exact heads and no β offset: what the kernel alone keeps
    "kernel-only": Recipe(
        "kernel-only", exact_heads=0, error_heads=0, beta_offset=0.0, exact_kv_dtype=None, exact_product_dtype=None
    ),
}


def with_exact_kv_dtype(record: dict, kv_dtype: str | None) -> dict:
    """A recipe record (``asdict(Recipe)``, as a converted model's config and ``recipe.json`` hold it) with its
    exact keys and values in ``kv_dtype`` (``"bfloat16"``, ``"int8"`` or None): named as the recipe of
    :data:`RECIPES` that gives exactly those fields, if one does (``retrieval`` with int8: ``retrieval-int8kv``),
    else ``"<name>+exact_kv_dtype=<kv_dtype>"``."""
    return with_recipe_fields(record, exact_kv_dtype=kv_dtype)


def with_recipe_fields(record: dict, **changes) -> dict:
    """A recipe record with ``changes`` applied (fields a record written before them lacks take the dataclass
    defaults), named as the recipe of :data:`RECIPES` that gives exactly those fields, if one does, else
    ``"<name>+field=value…"`` for the changed fields."""
    defaults = asdict(Recipe(""))
    fields = {**record, **changes}

    def norm(d: dict) -> dict:
        return {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k != "name"}

    full = norm({**defaults, **{k: v for k, v in fields.items() if k in defaults}})
    for name, recipe in RECIPES.items():
        if norm(asdict(recipe)) == full:
            return {**fields, "name": name}
    base = str(record.get("name")).split("+")[0]
    extra = "".join(f"+{k}={v}" for k, v in changes.items() if v != defaults.get(k))
    return {**fields, "name": base + extra}


# restore_converted's default for a setting it leaves as the model has it
KEEP = object()


def restore_converted(
    model: str,
    out: str | Path,
    *,
    kv_dtype: torch.dtype | None | object = KEEP,
    decode_budget: int | None | object = KEEP,
    decode_page: int = 64,
    overwrite: bool = False,
    measurements: list[dict] | None = None,
) -> int:
    """Re-store the converted ``model`` (a directory) at ``out`` with its exact heads' keys and values in
    ``kv_dtype`` (None: the model's dtype) and / or with a decode budget (None: every key), each left as it is when
    :data:`KEEP`: the recipe record in its config and in its ``recipe.json`` (read before anything is written, so
    ``out`` may be ``model`` with ``overwrite``) get the changed fields and the recipe name they make
    (:func:`with_recipe_fields`); ``measurements`` become the card's table. Returns the number of layers changed;
    raises ValueError for a model that is not converted or a setting its kernels refuse, before writing."""
    from ..io import read_json
    from ..models import load_model, load_tokenizer
    from .convert import conversion_info, save_converted
    from .heads import set_exact_decode_budget, set_exact_kv_dtype

    changes: dict = {}
    if kv_dtype is not KEEP:
        changes["exact_kv_dtype"] = None if kv_dtype is None else str(kv_dtype).removeprefix("torch.")
    if decode_budget is not KEEP:
        changes.update(exact_decode_budget=decode_budget, exact_decode_page=decode_page)
    record_path = Path(model) / "recipe.json"
    record = read_json(record_path) if record_path.is_file() else None
    base, tokenizer = load_model(model), load_tokenizer(model)
    info = conversion_info(base)
    if info is None:
        raise ValueError(f"model: {model} is not a converted model (no oal_conversion in its config)")
    layers = 0
    if kv_dtype is not KEEP:
        layers = set_exact_kv_dtype(base, kv_dtype)
    if decode_budget is not KEEP:
        layers = set_exact_decode_budget(base, decode_budget, decode_page)
    if info.get("recipe"):  # the record names the recipe that gives these fields (the card's command)
        base.config.oal_conversion = {**info, "recipe": with_recipe_fields(info["recipe"], **changes)}
    save_converted(
        base,
        out,
        tokenizer=tokenizer,
        overwrite=overwrite,
        base_weights=info.get("base_weights"),
        measurements=measurements,
    )
    if record is not None:
        record["recipe"] = with_recipe_fields(record["recipe"], **changes)
        if Path(out).resolve() != Path(model).resolve():
            record["restored_from"] = str(model)
        write_json(Path(out) / "recipe.json", record)
    return layers


@contextmanager
def _timed(stages: dict[str, float], name: str) -> Iterator[None]:
    """Record the wall seconds of one stage in ``stages[name]``."""
    logger.info("recipe stage %s ...", name)
    start = time.perf_counter()
    yield
    stages[name] = round(time.perf_counter() - start, 1)
    logger.info("recipe stage %s done in %.1f s", name, stages[name])


def run_recipe(
    recipe: str | Recipe,
    out: str | os.PathLike,
    *,
    model_name: str = "smollm2-135m",
    work_dir: str | os.PathLike | None = None,
    init_from: str | os.PathLike | None = DEFAULT_INIT,
    groups: str | os.PathLike = DEFAULT_GROUPS,
    data_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Run ``recipe`` (a name in :data:`RECIPES` or a :class:`Recipe`) on ``model_name`` and save the converted
    model to ``out``; returns the record also written to ``out/recipe.json`` (stages, seconds per stage, the
    chosen heads). ``work_dir`` holds the calibration (default ``<out>.work``); calibration resumes from it."""
    from ..data.text import load_text
    from ..data.tokens import tokenize
    from ..evaluation.retrieval import sentences_from_text
    from ..fidelity.cli import run_calibrate
    from ..models import attach_kernel, attached_kernels, detach_kernel, load_model, load_tokenizer
    from .convert import convert_model, parse_layers, save_converted
    from .heads import (
        add_exact_heads,
        approximation_error_scores,
        rank_heads,
        retrieval_head_scores,
        set_exact_decode_budget,
    )

    r = RECIPES.get(recipe) if isinstance(recipe, str) else recipe
    if r is None:
        raise ValueError(f"recipe: expected one of {sorted(RECIPES)} or a Recipe, got {recipe!r}")
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"out: {out} is not empty; choose another directory or pass overwrite=True")
    work = Path(work_dir) if work_dir is not None else out.with_name(out.name + ".work")
    stages: dict[str, float] = {}
    tokenizer = load_tokenizer(model_name)
    base = load_model(model_name)
    n_layers = base.config.num_hidden_layers
    layers = list(range(n_layers)) if r.layers == "all" else parse_layers(r.layers, n_layers)
    valid_text = load_text("valid", data_dir=data_dir).text if r.exact_heads or r.error_heads else None
    error_ids = None
    if r.error_heads:
        limit = getattr(base.config, "max_position_embeddings", None)
        if limit is not None and r.error_len > limit:
            raise ValueError(f"recipe.error_len: expected at most the model's {limit} positions, got {r.error_len}")
        valid = tokenize(tokenizer, valid_text)
        if valid.numel() < r.error_offset + r.error_len:
            raise ValueError(
                f"recipe.error_offset + error_len: WikiText-2 valid has {valid.numel()} tokens, "
                f"expected at least {r.error_offset + r.error_len}"
            )
        error_ids = valid[None, r.error_offset : r.error_offset + r.error_len]

    with _timed(stages, "calibrate"):
        run_calibrate(
            model_name,
            kernel=r.kernel,
            layers=layers,
            out=work / "calibrate",
            groups_path=Path(groups),
            seq_len=r.seq_len,
            data_dir=Path(data_dir) if data_dir is not None else None,
            cache=work / "qkv",
            seed=r.seed,
            n_sink=r.n_sink,
            window=r.window,
            init_from=Path(init_from) if init_from is not None else None,
            config_overrides={"max_updates": r.max_updates},
            progress=progress,
        )
    heads: dict[int, list[int]] = {}
    scores = None
    if r.exact_heads:
        with _timed(stages, "retrieval_heads"):
            haystack = sentences_from_text(valid_text)
            scores = retrieval_head_scores(
                base, tokenizer, haystack, lengths=r.score_lengths, prompts=r.score_prompts, progress=progress
            )
            for layer, h in rank_heads(scores, layers)[: r.exact_heads]:
                heads.setdefault(layer, []).append(h)
    with _timed(stages, "convert"):
        model = convert_model(base, r.kernel, layers=layers, calibrated=work / "calibrate", seed=r.seed)
        with torch.no_grad():
            for kernel in attached_kernels(model).values():
                kernel.beta.add_(r.beta_offset)
    errors = None
    if error_ids is not None:
        with _timed(stages, "error_heads"):
            kernels = {layer: detach_kernel(model, layer) for layer in sorted(attached_kernels(model))}
            try:
                errors = approximation_error_scores(model, kernels, error_ids)
            finally:
                for layer, kernel in kernels.items():
                    attach_kernel(model, layer, kernel)
            chosen = {(layer, h) for layer, hs in heads.items() for h in hs}
            extra = [lh for lh in rank_heads(errors, layers) if lh not in chosen][: r.error_heads]
            for layer, h in extra:
                heads.setdefault(layer, []).append(h)
    with _timed(stages, "save"):
        if heads:
            kv_dtype = None if r.exact_kv_dtype is None else getattr(torch, r.exact_kv_dtype)
            products = None if r.exact_product_dtype is None else getattr(torch, r.exact_product_dtype)
            add_exact_heads(
                model, {layer: sorted(hs) for layer, hs in heads.items()}, kv_dtype=kv_dtype, product_dtype=products
            )
            if r.exact_decode_budget is not None:
                set_exact_decode_budget(model, r.exact_decode_budget, r.exact_decode_page)
        info = model.config.oal_conversion
        model.config.oal_conversion = {**info, "recipe": {**asdict(r), "beta_offset_applied": r.beta_offset}}
        base_weights = model_name if not Path(model_name).exists() else None
        save_converted(model, out, tokenizer=tokenizer, overwrite=overwrite, base_weights=base_weights)
    record = {
        "recipe": asdict(r),
        "model": model_name,
        "init_from": None if init_from is None else str(init_from),
        "groups": str(groups),
        "exact_heads": {str(k): sorted(v) for k, v in sorted(heads.items())},
        "head_scores": None if scores is None else [[round(float(x), 5) for x in row] for row in scores],
        "error_scores": None if errors is None else [[round(float(x), 5) for x in row] for row in errors],
        "seconds": {**stages, "total": round(sum(stages.values()), 1)},
        "torch_threads": torch.get_num_threads(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(out / "recipe.json", record)
    logger.info("recipe %s: %s", r.name, json.dumps(record["seconds"]))
    return record
