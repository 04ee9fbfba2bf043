"""Chunked prefill of a converted model: a long prompt runs through the model in chunks of ``prefill_chunk``
tokens, each chunk through all layers, the cache carrying what the chunks before it left.

A converted layer's cache is a fixed-size state (or the kept keys below the crossover) and its softmax parts read
the cache's keys, so prompt tokens ``[s, e)`` after the cache holds ``[0, s)`` give the same outputs as one call
over the whole prompt (the same sums in another order: fp32 rounding). What changes is the memory: the
activations of one call are proportional to its length (the MLP's three ``N × intermediate`` products, the
projections, the attention's temporaries: ~50 MB per 2k tokens for SmolLM2 in fp32), and so are the freed
blocks the allocator keeps between layers; a chunk bounds both. transformers runs the original model's prompt in
one call (``generate`` included), so its prefill peak grows with the prompt beyond its KV cache.

A prompt of at most one chunk runs in one call, and so does an fp32 model's prompt of at most :data:`ONE_CALL_CHUNKS`
chunks, with its MLPs in row pieces (:func:`mlp_in_pieces`: the MLP is position-wise, so the pieces give the same rows;
its three ``N × intermediate`` products are a layer's largest transients) of a chunk's rows, at most
:data:`MLP_PIECE_ROWS`: SmolLM2's 1k fp32 prompt in two 512-token chunks ran 0.89–0.90× the original's speed side by
side, in one call with MLP pieces 0.98–1.03× (its weights streamed once, the second MLP piece reading what the first
left in the cache), its peak 1.3–1.7 MB above the chunks' (stop 47). A bf16 model keeps the chunks: there the recipe's
one call peaked 8 MB above them, at the original's. Longer prompts run in chunks. No chunk folds keys into a state:
below the kept form's limit a later chunk's queries are evaluated over the kept and the new keys
(:func:`oal.kernels.kept.extend`: the logits of one call; a 1k bf16 prompt in two chunks took 1.21–1.29 s against the
original's one call's 1.24–1.35 s and held 5–11 MB less live data than one call, stop 42), and a converted layer told
that the prompt will outgrow its kept form (:func:`oal.kernels.kept.prompt_end`) builds its state from the first chunk.

It applies where nothing else can tell the difference: inference (no autograd), no labels, no attention or
hidden-state outputs, a 2-D (or no) attention mask, and a cache to carry the chunks (a :class:`DynamicCache` is
created as the model itself would create one when ``use_cache`` allows it). ``config.oal_prefill_chunk`` sets the
chunk length (0 or None: one call, as the base model); unset, it is 512 tokens, 1024 for prompts beyond 4k.

The peak resident memory of a CPU prefill is reached at its end, when the output layer runs: by then glibc's malloc
holds the freed blocks of the decoder's activations (tens of MB at 1k tokens, how much depending on the order of
past allocations, not on what the model holds) and the output layer adds its weight's pages. So before the output
layer of an inference prompt of at least :data:`RELEASE_MIN_TOKENS` tokens on CPU the freed heap is returned to the
operating system (glibc's ``malloc_trim(0)``: one call per prompt, 4 ms at 1k tokens; decode steps and training
never call it; a no-op without glibc), and so it is before every chunk after the first of a prompt in chunks: a
later chunk's transients do not all fit in the holes its predecessor's left between the blocks that stay (the
cache's), so its first layers take fresh memory while the freed blocks stay resident (SmolLM2's 1k fp32 prompt:
+23–30 MB of arena in its second chunk's first three layers; without the release 3 of 7 traces peaked in that chunk
(5.6 and 6.0 MB above the prompt's end in the two whose end was kept), with it none of 9, stop 47).
``config.oal_release_prompt_heap = False`` turns both off. transformers' own
models do not do this; :func:`heap_released_before_output` applies the same to any model, e.g. as the control of a
benchmark. Buffers the decode steps allocate afterwards take memory from the system again (docs/models.md); a
decode step (any inference call below the prompt threshold) in which the cache replaced a buffer by a larger one
(the kept keys every 16 tokens, a softmax layer's or the exact heads' keys every 64, the fold into the state)
returns the freed smaller ones after it once the buffers replaced since the last release hold
:data:`oal.kernels.kept.STEP_RELEASE_BYTES` (one ``malloc_trim`` then: without it each growth kept its predecessor's
memory resident, ~12 MB at the kept keys' first growth after a 1k prompt; a release after every such step, nearly every
step after SmolLM2's 1k prompt, walked malloc's free chunks for 0.3–1.6 ms each time, stop 56).

A prompt in one call into a :class:`~oal.models.KernelCache` finds the buffers its cache will keep (kept keys and
values, the exact heads' buffers, the softmax layers' keys and values) allocated for every layer before the first
layer runs (:func:`oal.models.state_cache.reserved_for_prompt`): allocated amid each layer's transients they pinned
the freed blocks around them, and the heap grew layer after layer (SmolLM2's 1k fp32 prompt after a first one:
peak 1,093–1,103 MB with 25–33 MB of freed heap kept, reserved 1,085–1,090 MB, the original 1,092–1,129; stop 51).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from ..kernels import kept as kept_form
from .state_cache import reserved_for_prompt

__all__ = [
    "CONFIG_CHUNK_KEY",
    "CONFIG_RELEASE_KEY",
    "DEFAULT_PREFILL_CHUNK",
    "MLP_PIECE_ROWS",
    "ONE_CALL_CHUNKS",
    "RELEASE_MIN_TOKENS",
    "chunked_forward",
    "heap_released_before_output",
    "mlp_in_pieces",
    "prefill_chunk",
    "release_freed_heap",
    "releases_prompt_heap",
]

#: the config attribute that sets the chunk length
CONFIG_CHUNK_KEY = "oal_prefill_chunk"
#: the default chunk length: GEMMs of 512 rows run at the full speed of larger ones on CPU, and SmolLM2's
#: activations for 512 tokens are ~12 MB in fp32
DEFAULT_PREFILL_CHUNK = 512
#: prompts longer than this take chunks twice the default length (when the chunk length is the default): past 4k
#: tokens a chunk's activations are small beside the cache (and beside the original's one-call activations), and
#: 1024-token chunks ran SmolLM2's 8k prompt 3–5 % (the recipe) and 10 % (plain OAL) faster on a Xeon (stop 35),
#: while a 2k prompt in one call of two 1024-token chunks peaked above the original's there
LONG_PROMPT = 4096
#: an fp32 model's prompts of at most this many chunks run in one call, their MLPs in pieces of a chunk's rows
ONE_CALL_CHUNKS = 2
#: ... and of at most this many rows: a piece's transients (SmolLM2: 3 × rows × 1536 fp32, 4.7 MB at 256 rows) are what
#: a one-call prompt's peak rises by above what it keeps. At 1k tokens 256-row pieces peaked 7 MB (the recipe) and 6 MB
#: (plain OAL, mean) below 512-row ones, plain OAL below the original's warm peak in 4 of 4 rounds instead of 2 of 4,
#: at 0.99× (the recipe) and 0.95× (plain OAL) the 512-row prompts' speed, medians of 8 rounds side by side (stop 52)
MLP_PIECE_ROWS = 256
#: the config attribute that switches the release of the freed heap before the output layer (default on)
CONFIG_RELEASE_KEY = "oal_release_prompt_heap"
#: prompts (batch × length) below this skip the release: their freed activations are a few MB
RELEASE_MIN_TOKENS = 256


def prefill_chunk(config: object, n: int = 0) -> int:
    """The chunk length of an ``n``-token prompt: ``config.oal_prefill_chunk`` if set (0: none), else
    :data:`DEFAULT_PREFILL_CHUNK`, twice that for prompts longer than :data:`LONG_PROMPT`."""
    if not hasattr(config, CONFIG_CHUNK_KEY):
        return DEFAULT_PREFILL_CHUNK * (2 if n > LONG_PROMPT else 1)
    value = getattr(config, CONFIG_CHUNK_KEY)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.{CONFIG_CHUNK_KEY}: expected an int ≥ 0 (0: no chunking), got {value!r}")
    return value


def releases_prompt_heap(config: object) -> bool:
    """Whether ``config.oal_release_prompt_heap`` asks for the heap release of a prompt (default True)."""
    value = getattr(config, CONFIG_RELEASE_KEY, True)
    if not isinstance(value, bool):
        raise ValueError(f"config.{CONFIG_RELEASE_KEY}: expected True or False, got {value!r}")
    return value


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` from the C library already loaded in this process, or None (another libc)."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to open by None (Windows)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_heap() -> bool:
    """Return the heap that malloc holds freed to the operating system (``malloc_trim(0)``); whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _release_hook(module: torch.nn.Module, args: tuple) -> None:
    release_freed_heap()


@contextmanager
def heap_released_before_output(model: PreTrainedModel) -> Iterator[None]:
    """Within the block, every call of ``model``'s output layer (``get_output_embeddings()``) first returns the
    freed heap to the operating system (:func:`release_freed_heap`). A no-op for a model without an output layer."""
    head = model.get_output_embeddings()
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(_release_hook)
    try:
        yield
    finally:
        handle.remove()


def _in_pieces(forward, rows: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``forward(x)`` for ``x (..., N, H)`` in pieces of ``rows`` rows along N, written into one output."""
    n = x.shape[-2] if x.dim() >= 2 else 0
    if n <= rows or args or kwargs:
        return forward(x, *args, **kwargs)
    out = None
    for start in range(0, n, rows):
        y = forward(x[..., start : start + rows, :])
        if out is None:
            out = y.new_empty(*x.shape[:-2], n, y.shape[-1])
        out[..., start : start + rows, :] = y
    return out


@contextmanager
def mlp_in_pieces(model: PreTrainedModel, rows: int) -> Iterator[None]:
    """Within it, the MLP (``layer.mlp``) of every decoder layer of ``model`` (``model.base_model.layers``) runs an
    input of more than ``rows`` positions in pieces of ``rows`` (the same rows: an MLP is position-wise). Layers
    without an ``mlp`` module, or whose MLP has its own per-instance forward already, are left as they are."""
    patched = []
    for layer in getattr(model.base_model, "layers", None) or ():
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, torch.nn.Module) and "forward" not in vars(mlp):
            mlp.forward = functools.partial(_in_pieces, type(mlp).forward.__get__(mlp), rows)
            patched.append(mlp)
    try:
        yield
    finally:
        for mlp in patched:
            del mlp.forward


def _releases(model: PreTrainedModel, source: torch.Tensor) -> bool:
    """Whether this call is an inference prompt on CPU whose freed heap is released before the output layer."""
    return (
        source.shape[0] * source.shape[1] >= RELEASE_MIN_TOKENS
        and not torch.is_grad_enabled()
        and source.device.type == "cpu"
        and releases_prompt_heap(model.config)
    )


def _chunkable(
    n: int,
    chunk: int,
    past: int,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
    labels: torch.Tensor | None,
    use_cache: bool | None,
    logits_to_keep: object,
    kwargs: dict,
) -> bool:
    if chunk <= 0 or n <= chunk or torch.is_grad_enabled() or labels is not None or not use_cache:
        return False
    if cache is not None and not isinstance(cache, Cache):
        return False
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("return_dict") is False:
        return False
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):  # per-token inputs this wrapper does not know
        return False
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != past + n):
        return False
    if position_ids is not None and position_ids.shape[-1] != n:
        return False
    last = n - (n - 1) // chunk * chunk
    return isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep <= last


@functools.cache
def _parameter_names(fn) -> tuple[str, ...]:
    """The names ``fn`` binds positional arguments to after ``self``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)[1:]


def chunked_forward(base_forward, model: PreTrainedModel, *args, **kwargs):
    """``base_forward(model, ...)`` over the prompt in chunks where that is equivalent (module docstring),
    otherwise one call; an inference prompt's freed heap released before the output layer (module docstring). The
    output is the last chunk's, with the logits of all chunks when ``logits_to_keep`` is 0.
    """
    if args:  # positional arguments by the base forward's parameter names (model(ids) is the common call)
        names = _parameter_names(base_forward)
        if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
            return base_forward(model, *args, **kwargs)  # let it raise as it would
        kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
    input_ids, inputs_embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    source = input_ids if input_ids is not None else inputs_embeds
    if source is None or source.dim() < 2:
        return base_forward(model, **kwargs)
    if _releases(model, source):
        with heap_released_before_output(model):
            out = _forward(base_forward, model, source, kwargs, release=True)
        kept_form.take_regrown()  # released before the output layer
        return out
    out = _forward(base_forward, model, source, kwargs)
    if kept_form.take_regrown(kept_form.STEP_RELEASE_BYTES) and _releases_after_step(model, source):
        release_freed_heap()
    return out


def _releases_after_step(model: PreTrainedModel, source: torch.Tensor) -> bool:
    """Whether an inference call on CPU whose cache replaced a buffer by a larger one returns the freed ones (the
    smaller buffers; module docstring)."""
    return not torch.is_grad_enabled() and source.device.type == "cpu" and releases_prompt_heap(model.config)


def _forward(base_forward, model: PreTrainedModel, source: torch.Tensor, kwargs: dict, release: bool = False):
    """:func:`chunked_forward` with its arguments by name; ``release``: the freed heap is returned before every
    chunk after the first (module docstring)."""
    input_ids, inputs_embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    n = source.shape[1]
    chunk = prefill_chunk(model.config, n)
    named = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache", "past_key_values", "labels")
    rest = {k: v for k, v in kwargs.items() if k not in (*named, "use_cache", "logits_to_keep")}
    attention_mask, position_ids = kwargs.get("attention_mask"), kwargs.get("position_ids")
    cache = kwargs["cache"] if kwargs.get("cache") is not None else kwargs.get("past_key_values")
    use_cache, logits_to_keep = kwargs.get("use_cache"), kwargs.get("logits_to_keep", 0)
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    past = cache.get_seq_length() if isinstance(cache, Cache) else 0
    # a prompt finds its cache's buffers allocated before its first layer (state_cache.reserved_for_prompt)
    prompt = n > 1 and use_cache and (attention_mask is None or bool(attention_mask.all()))

    def reserved(cache):
        return reserved_for_prompt(model, cache, source.shape[0], n) if prompt else nullcontext()

    if not _chunkable(
        n, chunk, past, attention_mask, position_ids, cache, kwargs.get("labels"), use_cache, logits_to_keep, rest
    ):
        with reserved(cache):
            return base_forward(model, **kwargs)
    if n <= ONE_CALL_CHUNKS * chunk and model.dtype == torch.float32:
        with mlp_in_pieces(model, min(chunk, MLP_PIECE_ROWS)), reserved(cache):
            return base_forward(model, **kwargs)
    if cache is None:
        cache = DynamicCache(config=model.config)
    logits, out = [], None
    # the layers know where the prompt ends; its first chunk takes the buffers reserved for the whole prompt
    with kept_form.prompt_end(past + n), reserved(cache):
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            if start and release:
                release_freed_heap()
            piece = {
                "input_ids": None if input_ids is None else input_ids[:, start:end],
                "inputs_embeds": None if inputs_embeds is None else inputs_embeds[:, start:end],
                "attention_mask": None if attention_mask is None else attention_mask[:, : past + end],
                "position_ids": None if position_ids is None else position_ids[..., start:end],
                "cache": cache,
                "use_cache": True,
            }
            if end < n and logits_to_keep != 0:
                # only the decoder: no logits to keep here, and the output layer (for a tied embedding, a matrix
                # whose rows the prompt's lookup barely touched) is read once, after the last chunk's activations
                model.base_model(**piece, **rest)
                continue
            out = base_forward(model, **piece, logits_to_keep=logits_to_keep, **rest)
            if logits_to_keep == 0:
                logits.append(out.logits)
    if logits_to_keep == 0 and len(logits) > 1:
        out.logits = torch.cat(logits, dim=1)
    return out
