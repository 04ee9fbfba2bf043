"""Chunked prefill of converted models: the same logits and cache as one call, reached by ``model(...)`` and
``generate``, and one call wherever chunks could be told apart."""

import contextlib
import functools
import inspect

import pytest
import torch
from tiny import convert_tiny
from transformers import DynamicCache

from oal.conversion import convert_model
from oal.conversion.heads import add_exact_heads
from oal.kernels.base import GROWTH
from oal.kernels.kept import KeptKV
from oal.models import KernelCache, prefill
from oal.models.prefill import (
    CONFIG_CHUNK_KEY,
    CONFIG_RELEASE_KEY,
    DEFAULT_PREFILL_CHUNK,
    LONG_PROMPT,
    RELEASE_MIN_TOKENS,
    heap_released_before_output,
    prefill_chunk,
    releases_prompt_heap,
)


def prompt(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 101, (batch, n), generator=torch.Generator().manual_seed(seed))


def model_of(make_model, kind: str):
    model = make_model("llama", num_heads=6, num_kv_heads=2)
    if kind == "oal":
        g = torch.Generator().manual_seed(0)
        groups = {i: torch.randint(0, 3, (6, 8), generator=g) for i in range(3)}
        return convert_model(model, "oal", layers="1-2", groups=groups)
    if kind == "performer":
        return convert_model(model, "performer", layers="0-1", seed=1)
    model = convert_tiny(model, window=5 if kind.startswith("sink_window") else None)
    if kind.endswith("exact_heads"):
        add_exact_heads(model, {1: [1], 2: [0]})
    return model


def base_calls(model, monkeypatch) -> list[int]:
    """Lengths of the decoder's calls (every chunk runs the decoder; the last also the output layer)."""
    calls = []
    decoder = type(model.base_model)
    base = decoder.forward

    @functools.wraps(base)
    def spy(self, *args, **kwargs):
        source = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        source = args[0] if source is None and args else source
        calls.append(source.shape[1])
        return base(self, *args, **kwargs)

    monkeypatch.setattr(decoder, "forward", spy)
    return calls


def run(model, ids, chunk, steps=4, **kw):
    """Prefill logits (all positions), then ``steps`` greedy one-token steps' logits."""
    model.config.oal_prefill_chunk = chunk
    cache = KernelCache(model)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, **kw)
        logits, nxt = [out.logits], out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(input_ids=nxt, cache=cache)
            logits.append(out.logits)
            nxt = out.logits[:, -1:].argmax(-1)
    return logits, cache


@pytest.mark.parametrize("kind", ["oal", "performer", "sink_window", "oal_exact_heads", "sink_window_exact_heads"])
def test_chunked_prefill_equals_one_call(make_model, monkeypatch, kind):
    model = model_of(make_model, kind)
    ids = prompt(2, 70)
    want, want_cache = run(model, ids, 0)
    calls = base_calls(model, monkeypatch)
    got, cache = run(model, ids, 16)
    assert calls[:5] == [16, 16, 16, 16, 6]  # the prompt in chunks through the base forward, then one per step
    assert cache.get_seq_length() == want_cache.get_seq_length() == 74
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-5)


def test_chunked_prefill_keeps_the_last_logits_only_when_asked(make_model):
    model = model_of(make_model, "oal")
    ids = prompt(1, 40)
    (want, *_), _ = run(model, ids, 0, steps=0, logits_to_keep=3)
    (got, *_), _ = run(model, ids, 16, steps=0, logits_to_keep=3)
    assert got.shape == (1, 3, 101)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)


def test_generate_with_left_padding_reaches_the_chunks(make_model, monkeypatch):
    model = model_of(make_model, "sink_window_exact_heads")
    ids = prompt(2, 50)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.config.oal_prefill_chunk = 0
        want = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
        calls = base_calls(model, monkeypatch)
        model.config.oal_prefill_chunk = 16
        got = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
    assert calls[:4] == [16, 16, 16, 2]
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=5e-5)


def test_a_fresh_cache_is_created_as_the_model_would(make_model, monkeypatch):
    model = model_of(make_model, "oal")
    ids = prompt(1, 40)
    with torch.no_grad():
        model.config.oal_prefill_chunk = 0
        want = model(ids).logits
        calls = base_calls(model, monkeypatch)
        model.config.oal_prefill_chunk = 16
        out = model(ids)
    assert calls == [16, 16, 8]
    assert isinstance(out.cache, DynamicCache) and out.cache.get_seq_length() == 40
    torch.testing.assert_close(out.logits, want, rtol=0, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_of_two_chunks(make_model, monkeypatch, dtype):
    """An fp32 model runs a prompt of ONE_CALL_CHUNKS chunks in one call, every layer's MLP in pieces of a chunk's
    rows (restored after the call); a bf16 model in chunks. Both give one call's logits."""
    assert prefill.ONE_CALL_CHUNKS == 2
    model = model_of(make_model, "sink_window_exact_heads").to(dtype)
    ids = prompt(1, 32)
    want, _ = run(model, ids, 0, steps=2)
    calls, pieces = base_calls(model, monkeypatch), []
    in_pieces = prefill._in_pieces
    monkeypatch.setattr(
        prefill, "_in_pieces", lambda f, rows, x: pieces.append((x.shape[-2], rows)) or in_pieces(f, rows, x)
    )
    got, _ = run(model, ids, 16, steps=2)
    layers = len(model.base_model.layers)
    if dtype == torch.float32:  # the decode steps after it run the MLPs as they are
        assert calls[:2] == [32, 1] and pieces == [(32, 16)] * layers
    else:
        assert calls[:2] == [16, 16] and not pieces
    assert not any("forward" in vars(layer.mlp) for layer in model.base_model.layers)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-5 if dtype == torch.float32 else 5e-2)


def test_one_call_mlp_pieces_are_at_most_mlp_piece_rows(make_model, monkeypatch):
    """A chunk longer than MLP_PIECE_ROWS: the one call's MLPs run in pieces of MLP_PIECE_ROWS rows."""
    monkeypatch.setattr(prefill, "MLP_PIECE_ROWS", 8)
    model = model_of(make_model, "oal")
    ids = prompt(1, 40)
    want, _ = run(model, ids, 0, steps=1)
    calls, rows = base_calls(model, monkeypatch), []
    in_pieces = prefill._in_pieces
    monkeypatch.setattr(prefill, "_in_pieces", lambda f, r, x: rows.append(r) or in_pieces(f, r, x))
    got, _ = run(model, ids, 20, steps=1)
    assert calls[0] == 40 and rows == [8] * len(model.base_model.layers)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-5)


def test_mlp_in_pieces_gives_the_rows_of_one_call(make_model):
    model = model_of(make_model, "oal")
    mlp = model.base_model.layers[0].mlp
    x = torch.randn(2, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mlp(x)
        with prefill.mlp_in_pieces(model, 8):
            assert "forward" in vars(mlp)
            got = mlp(x)
    assert "forward" not in vars(mlp)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    ["grad", "labels", "no_cache", "hidden_states", "tuple", "mask_4d", "keep_more_than_last", "one_chunk"],
)
def test_one_call_where_chunks_could_be_told_apart(make_model, monkeypatch, case):
    model = model_of(make_model, "oal")
    model.config.oal_prefill_chunk = 16
    ids = prompt(1, 40)
    kw = {"input_ids": ids, "cache": KernelCache(model)}
    if case == "labels":
        kw["labels"] = ids
    elif case == "no_cache":
        kw = {"input_ids": ids, "use_cache": False}
    elif case == "hidden_states":
        kw["output_hidden_states"] = True
    elif case == "tuple":
        kw["return_dict"] = False
    elif case == "mask_4d":
        kw["attention_mask"] = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
    elif case == "keep_more_than_last":
        kw["logits_to_keep"] = 9  # the last chunk has 8 tokens
    elif case == "one_chunk":
        kw["input_ids"] = ids[:, :16]
    calls = base_calls(model, monkeypatch)
    with torch.set_grad_enabled(case == "grad"):
        model(**kw)
    assert calls == [kw["input_ids"].shape[1]]


def test_chunk_setting(make_model):
    model = model_of(make_model, "oal")
    assert prefill_chunk(model.config) == DEFAULT_PREFILL_CHUNK == prefill_chunk(model.config, LONG_PROMPT)
    assert prefill_chunk(model.config, LONG_PROMPT + 1) == 2 * DEFAULT_PREFILL_CHUNK
    setattr(model.config, CONFIG_CHUNK_KEY, 300)
    assert prefill_chunk(model.config, 10 * LONG_PROMPT) == 300
    for off in (0, None):
        setattr(model.config, CONFIG_CHUNK_KEY, off)
        assert prefill_chunk(model.config) == 0
    for bad in (-1, 2.5, True, "512"):
        setattr(model.config, CONFIG_CHUNK_KEY, bad)
        with pytest.raises(ValueError, match=CONFIG_CHUNK_KEY):
            prefill_chunk(model.config)


def test_default_chunks_of_a_short_and_a_long_prompt(make_model, monkeypatch):
    """Unset, the chunk length is the default up to LONG_PROMPT tokens and twice it beyond."""
    model = model_of(make_model, "oal")
    calls = base_calls(model, monkeypatch)
    with torch.no_grad():
        model(prompt(1, 4 * DEFAULT_PREFILL_CHUNK), cache=KernelCache(model), logits_to_keep=1)
        assert calls == [DEFAULT_PREFILL_CHUNK] * 4
        calls.clear()
        model(prompt(1, LONG_PROMPT + 100), cache=KernelCache(model), logits_to_keep=1)
    assert calls == [2 * DEFAULT_PREFILL_CHUNK] * (LONG_PROMPT // (2 * DEFAULT_PREFILL_CHUNK)) + [100]


def test_signature_is_the_base_forwards(make_model):
    """generate decides from the signature whether to ask for the last logits only."""
    model = model_of(make_model, "oal")
    params = inspect.signature(model.forward).parameters
    assert "logits_to_keep" in params and "cache" in params


@pytest.mark.parametrize("kind", ["oal", "sink_window", "oal_exact_heads"])
def test_chunks_below_the_crossover_keep_keys_and_values(make_model, kind, monkeypatch):
    """d = 8: a kernel head's state is as large as 25 tokens' keys and values (more with sinks and a window), so a
    24-token prompt in chunks of 8 stays in the kept form (each chunk appended, oal.kernels.kept.extend), as one
    call would, and no chunk folds the kept keys (each chunk's queries over the kept and its own keys: the one
    call's logits); the decode steps after it cross the fold point."""
    import oal.kernels.kept as kept_module

    model = model_of(make_model, kind)
    ids = prompt(2, 24)
    want_logits, want_cache = run(model, ids, 0, steps=0)
    folded = []
    fold_inner = kept_module._fold_inner
    monkeypatch.setattr(kept_module, "_fold_inner", lambda *a: folded.append(1) or fold_inner(*a))
    got_logits, cache = run(model, ids, 8, steps=0)
    assert not folded
    torch.testing.assert_close(got_logits[0], want_logits[0], rtol=0, atol=1e-5)
    for entry, want in zip(cache.layers, want_cache.layers, strict=True):
        kept = getattr(entry, "state", None)
        kept = getattr(kept, "inner", kept)
        if isinstance(kept, KeptKV):
            ref = getattr(want.state, "inner", want.state)
            assert kept.length == ref.length == 24
            torch.testing.assert_close(kept.k[:, :, :24], ref.k[:, :, :24], rtol=0, atol=1e-6)
    assert any(
        isinstance(getattr(getattr(e, "state", None), "inner", getattr(e, "state", None)), KeptKV) for e in cache.layers
    )
    want, _ = run(model, ids, 0, steps=6)
    got, _ = run(model, ids, 8, steps=6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-5)


@pytest.mark.parametrize("kind", ["oal", "oal_exact_heads"])
def test_softmax_layers_take_room_for_the_whole_prompt_at_its_first_chunk(make_model, monkeypatch, kind):
    """The softmax layers' buffers (ExactKVLayer) of a prompt in chunks are allocated once, at the first chunk, for
    the whole prompt plus the layer's spare slots, and the later chunks write into them (a buffer per chunk left
    holes amid the freed activations); the decode steps after it grow them as before."""
    from oal.models.state_cache import ExactKVLayer

    model = model_of(make_model, kind)
    ids = prompt(2, 150)  # chunks of 64, 64, 22
    pointers: dict[int, set[int]] = {}
    update = ExactKVLayer.update

    def spy(self, k, v, *args, **kwargs):
        out = update(self, k, v, *args, **kwargs)
        pointers.setdefault(self.layer_idx, set()).add(self._kbuf.data_ptr())
        return out

    monkeypatch.setattr(ExactKVLayer, "update", spy)
    (want, *want_steps), _ = run(model, ids, 0, steps=GROWTH + 1)
    pointers.clear()
    model.config.oal_prefill_chunk = 64
    cache = KernelCache(model)
    with torch.no_grad():
        got = model(input_ids=ids, cache=cache).logits
    softmax = [i for i, e in enumerate(cache.layers) if isinstance(e, ExactKVLayer)]
    assert softmax and sorted(pointers) == softmax
    for i in softmax:
        entry = cache.layers[i]
        assert len(pointers[i]) == 1, f"layer {i}: {len(pointers[i])} buffers for one prompt"
        assert 150 <= entry._kbuf.shape[2] < 150 + GROWTH and entry.get_seq_length() == 150
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    (_, *got_steps), _ = run(model, ids, 64, steps=GROWTH + 1)  # the steps after it outgrow the spare slots
    for g, w in zip(got_steps, want_steps, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_layers_of_a_later_chunk_take_the_mask_free_path(make_model, monkeypatch, dtype):
    """The softmax layers' attention of every chunk after the first goes through oal.ops.softmax (no mask), not
    SDPA with transformers' mask; the logits equal one call's, and a padded batch keeps SDPA."""
    import oal.models.hooks as hooks

    model = model_of(make_model, "oal").to(dtype)
    ids = prompt(2, 150)  # chunks of 64, 64, 22; layer 0 is softmax
    want, _ = run(model, ids, 0, steps=0)
    chunks, sdpa = [], []
    at_end, forward = hooks.softmax_at_end, hooks.sdpa_attention_forward
    monkeypatch.setattr(hooks, "softmax_at_end", lambda q, *a: chunks.append(q.shape[2]) or at_end(q, *a))
    monkeypatch.setattr(
        hooks, "sdpa_attention_forward", lambda m, q, *a, **k: sdpa.append(q.shape[2]) or forward(m, q, *a, **k)
    )
    got, _ = run(model, ids, 64, steps=0)
    assert chunks == [64, 22] and sdpa == [64]  # the first chunk: one causal SDPA call without keys before it
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-5 if dtype == torch.float32 else 5e-2)
    chunks.clear()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: not plain causal
    model.config.oal_prefill_chunk = 64
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=KernelCache(model))
    assert chunks == []


@pytest.mark.parametrize("way", ["tiles", "no_fused_kernel"])
def test_exact_heads_off_the_fused_kernel_take_the_mask_free_path_in_later_chunks(make_model, monkeypatch, way):
    """Exact heads that the fused prompt kernel does not run (on AMX tiles: torch's bf16 SDPA, forced here as it
    runs on any CPU; or without the fused kernels): every chunk after the first goes through oal.ops.softmax, not
    SDPA with a mask; the logits equal one call's."""
    import oal.kernels.hybrid as hybrid
    from oal.ops.quadratic import cpu as cpu_kernels

    model = convert_tiny(make_model("llama", num_heads=6, num_kv_heads=2), window=5)
    if way == "tiles":
        add_exact_heads(model, {1: [1], 2: [0]}, kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
        monkeypatch.setattr(cpu_kernels, "amx_bf16", lambda: True)
    else:
        add_exact_heads(model, {1: [1], 2: [0]})
    chunks = []
    at_end = hybrid.softmax_at_end

    def spy(q, *args):  # the chunks it evaluated (not those it declined)
        out = at_end(q, *args)
        if out is not None:
            chunks.append(q.shape[2])
        return out

    ids = prompt(1, 150)
    with cpu_kernels.disabled() if way == "no_fused_kernel" else contextlib.nullcontext():
        want, _ = run(model, ids, 0, steps=0)
        monkeypatch.setattr(hybrid, "softmax_at_end", spy)
        got, _ = run(model, ids, 64, steps=0)
    assert chunks == [64, 64, 22, 22]  # chunks 2 and 3 in the two layers with exact heads (1 and 2)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-2 if way == "tiles" else 5e-5)


def test_a_prompt_that_outgrows_the_kept_form_builds_the_state_from_the_first_chunk(make_model, monkeypatch):
    import oal.kernels.kept as kept

    folded = []
    fold_inner = kept._fold_inner
    monkeypatch.setattr(kept, "_fold_inner", lambda *a: folded.append(1) or fold_inner(*a))
    model = model_of(make_model, "oal")
    ids = prompt(2, 70)  # the limit is 25 tokens (d = 8)
    want, _ = run(model, ids, 0)
    got, cache = run(model, ids, 16, steps=0)
    assert not folded and isinstance(cache.layers[1].state, torch.Tensor)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-5)


def release_calls(model, monkeypatch) -> list[str]:
    """Records ``"release"`` for each heap release and ``"head"`` for each call of ``model``'s output layer."""
    events, head = [], model.get_output_embeddings()
    monkeypatch.setattr(prefill, "release_freed_heap", lambda: events.append("release") or True)
    base = torch.nn.Linear.forward

    def spy(self, x):
        if self is head:
            events.append("head")
        return base(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", spy)
    return events


@pytest.mark.parametrize("chunk", [0, 64])
def test_a_prompt_releases_the_freed_heap_before_each_later_chunk_and_the_output_layer(make_model, monkeypatch, chunk):
    import oal.kernels.kept as kept

    model = model_of(make_model, "sink_window_exact_heads")
    ids = prompt(2, 150)  # in chunks of 64, 64, 22
    assert ids.numel() >= RELEASE_MIN_TOKENS
    steps = GROWTH + 1  # long enough for every layer's exact buffer to outgrow its spare slots once
    model.config.oal_release_prompt_heap = False
    (want, *want_steps), _ = run(model, ids, chunk, steps=steps, logits_to_keep=1)
    model.config.oal_release_prompt_heap = True
    events, grew = release_calls(model, monkeypatch), []
    take = kept.take_regrown
    monkeypatch.setattr(kept, "take_regrown", lambda *at_least: grew.append(take(*at_least)) or grew[-1])
    monkeypatch.setattr(kept, "STEP_RELEASE_BYTES", 1)  # a step releases whatever it regrew
    (got, *got_steps), _ = run(model, ids, chunk, steps=steps, logits_to_keep=1)
    # before each chunk after the first and before the prompt's output layer; then after each decode step that grew
    # a buffer, and only after those (the layers' spare slots after the prompt differ, so they grow at different
    # steps)
    by_step = grew[1:]  # the first is the prompt's (cleared, its release came before the output layer)
    assert len(by_step) == steps and any(by_step) and not all(by_step)
    prompt_releases = 3 if chunk else 1
    assert events == ["release"] * prompt_releases + ["head"] + [
        e for g in by_step for e in ["head", "release"][: 1 + g]
    ]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_steps, want_steps, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not model.get_output_embeddings()._forward_pre_hooks  # the hook lives for the prompt's call only


@pytest.mark.parametrize("case", ["short", "batch_short", "grad", "off"])
def test_no_release_where_it_is_not_asked_for(make_model, monkeypatch, case):
    model = model_of(make_model, "oal")
    ids = {"short": prompt(1, 200), "batch_short": prompt(2, RELEASE_MIN_TOKENS // 2 - 1)}.get(case, prompt(2, 150))
    model.config.oal_release_prompt_heap = case != "off"
    events = release_calls(model, monkeypatch)
    with torch.set_grad_enabled(case == "grad"):
        model(ids, logits_to_keep=1)
    assert events == ["head"]


def test_release_setting(make_model):
    model = model_of(make_model, "oal")
    assert releases_prompt_heap(model.config) is True
    model.config.oal_release_prompt_heap = False
    assert releases_prompt_heap(model.config) is False
    for bad in (0, 1, "yes", None):
        setattr(model.config, CONFIG_RELEASE_KEY, bad)
        with pytest.raises(ValueError, match=CONFIG_RELEASE_KEY):
            releases_prompt_heap(model.config)


def test_the_control_hook_applies_to_any_model(make_model, monkeypatch):
    model = make_model("llama", num_heads=6, num_kv_heads=2)  # an original transformers model
    events = release_calls(model, monkeypatch)
    with torch.no_grad():
        with heap_released_before_output(model):
            model(prompt(1, 8))
        model(prompt(1, 8))
    assert events == ["release", "head", "head"]


def resident_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not prefill._malloc_trim(), reason="glibc's malloc_trim: the C library of Linux CI")
def test_release_returns_freed_heap_to_the_system():
    blocks = [torch.ones(16_000) for _ in range(1600)]  # 64 kB each: malloc's heap, not mmap
    del blocks[::2]  # 51 MB of holes between live blocks: free() alone cannot return them
    before = resident_mb()
    assert prefill.release_freed_heap() is True
    assert before - resident_mb() > 25
    del blocks


@pytest.mark.parametrize("release", [True, False])
def test_a_decode_step_that_grew_a_cache_buffer_releases_after_it(make_model, monkeypatch, release):
    """With a threshold of 1 byte, a decode step in which the cache replaced a buffer by a larger one (here the
    exact heads' and softmax layers' buffers, full after the prompt, and every GROWTH tokens) returns the freed heap
    after its output layer; the other steps do not, nor any step when the release is off, nor a call under
    autograd."""
    from oal.kernels import kept as kept_form

    model = model_of(make_model, "sink_window_exact_heads")
    model.config.oal_release_prompt_heap = release
    events = release_calls(model, monkeypatch)
    real = kept_form.note_regrown
    monkeypatch.setattr(kept_form, "note_regrown", lambda nbytes: events.append("grew") or real(nbytes))
    monkeypatch.setattr(kept_form, "STEP_RELEASE_BYTES", 1)  # a step releases whatever it regrew
    cache = KernelCache(model)
    with torch.no_grad():
        nxt = model(prompt(1, 20), cache=cache).logits[:, -1:].argmax(-1)  # below the prompt threshold
        per_step = []
        for _ in range(70):
            start = len(events)
            nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
            per_step.append([e for e in events[start:] if e != "head"])
    grew = [i for i, step in enumerate(per_step) if "grew" in step]
    assert grew and grew[0] == 0 and len(grew) < 10  # the first step, then every GROWTH (64) tokens
    for step in per_step:
        assert step.count("release") == (1 if release and "grew" in step else 0)
        if "release" in step:
            assert step[-1] == "release"  # after the layers grew their buffers
    with torch.enable_grad():
        events.clear()
        model(prompt(1, 4))
    assert "release" not in events


def test_a_decode_step_releases_once_the_regrown_bytes_reach_the_threshold(make_model, monkeypatch):
    """The steps' releases wait until the buffers replaced since the last one held ``STEP_RELEASE_BYTES``: each
    comes after the step whose regrown bytes reach it, the count then starts again, and the outputs are those of
    a release after every regrowing step."""
    from oal.kernels import kept as kept_form

    model = model_of(make_model, "sink_window_exact_heads")
    model.config.oal_prefill_chunk = 0
    ids = prompt(1, 20)  # below the prompt threshold: no release before the output layer
    freed, events = [], release_calls(model, monkeypatch)
    real = kept_form.note_regrown
    monkeypatch.setattr(kept_form, "note_regrown", lambda nbytes: freed.append(nbytes) or real(nbytes))

    def decode(threshold: int, count: int = 140) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Each step's logits and (bytes regrown, releases) after the prompt, under ``threshold``."""
        monkeypatch.setattr(kept_form, "STEP_RELEASE_BYTES", threshold)
        kept_form.take_regrown()  # nothing carried over from an earlier run
        cache, logits, per_step = KernelCache(model), [], []
        with torch.no_grad():
            nxt = model(ids, cache=cache).logits[:, -1:].argmax(-1)
            for _ in range(count):
                start, n_freed = len(events), len(freed)
                out = model(nxt, cache=cache)
                logits.append(out.logits)
                nxt = out.logits[:, -1:].argmax(-1)
                per_step.append((sum(freed[n_freed:]), events[start:].count("release")))
        return logits, per_step

    want, every = decode(1)
    assert all(r == int(nbytes > 0) for nbytes, r in every)
    threshold = max(nbytes for nbytes, _ in every) + 1  # no single step reaches it
    got, per_step = decode(threshold)
    assert [nbytes for nbytes, _ in per_step] == [nbytes for nbytes, _ in every]
    expected, pending = [], 0
    for nbytes, _ in per_step:
        pending += nbytes
        expected.append(int(pending >= threshold))
        pending = 0 if pending >= threshold else pending
    assert [r for _, r in per_step] == expected
    assert 0 < sum(expected) < sum(1 for nbytes, _ in every if nbytes)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("keep_keys", [True, False])
@pytest.mark.parametrize("kind", ["oal", "sink_window_exact_heads"])
def test_a_prompt_builds_the_decode_constants_the_steps_reuse(make_model, monkeypatch, kind, keep_keys):
    from oal.kernels import decode

    if decode.cpu_kernel.load("decode") is None:
        pytest.skip("the decode extension cannot be built here")
    model = model_of(make_model, kind)
    kernels = [m for m in model.modules() if isinstance(m, decode.ExactHeadsKernel | decode.OALKernel)]
    kernels = [m for m in kernels if not any(m in other.modules() for other in kernels if other is not m)]
    assert kernels
    cache = KernelCache(model, keep_keys=keep_keys)
    with torch.no_grad():
        out = model(input_ids=prompt(1, 12), cache=cache)
        assert all(getattr(m, decode._CONSTANTS_ATTR, None) is not None for m in kernels)
        # the state's query weights: built by a prompt that leaves a state, not by one that keeps its keys
        assert all((getattr(m, decode._STATE_WEIGHTS_ATTR, None) is None) == keep_keys for m in kernels)

        def built_again(*args, **kwargs):
            raise AssertionError("a decode step built the constants again")

        monkeypatch.setattr(decode, "query_weights", built_again)
        monkeypatch.setattr(decode, "oal_factor", built_again)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            nxt = model(input_ids=nxt, cache=cache).logits[:, -1:].argmax(-1)


def cache_buffers(cache) -> list[torch.Tensor]:
    """The buffers a cache keeps: softmax entries' keys and values, kept keys and values, exact heads' buffers."""
    from oal.kernels.hybrid import ExactHeadsState
    from oal.models.state_cache import ExactKVLayer, KernelStateLayer

    out = []
    for entry in cache.layers:
        if isinstance(entry, ExactKVLayer):
            out += [entry._kbuf, entry._vbuf]
        elif isinstance(entry, KernelStateLayer):
            state = entry.state
            if isinstance(state, ExactHeadsState):
                out += [t for t in (state.k, state.v, state.k_bounds) if t is not None]
                state = state.inner
            if isinstance(state, KeptKV):
                out += [state.k, state.v]
    return out


def spy_reserves(monkeypatch) -> list[torch.Tensor]:
    """Every buffer prefill reserves for a prompt (oal.models.state_cache.reserved_for_prompt), as it reserves them."""
    from oal.models import state_cache

    reserved = []
    real = state_cache.reserved_for_prompt

    @contextlib.contextmanager
    def spy(model, cache, batch, n):
        with real(model, cache, batch, n):
            reserved.extend(t for entry in cache.layers for t in (getattr(entry, "reserve", None) or ()))
            yield

    monkeypatch.setattr(prefill, "reserved_for_prompt", spy)
    return reserved


@pytest.mark.parametrize("kind", ["oal", "oal_exact_heads", "sink_window_exact_heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, chunk", [(20, 0), (20, 8), (40, 0), (40, 16)])  # kept keys below 25 tokens, states above
def test_a_prompt_keeps_the_buffers_reserved_before_its_first_layer(make_model, monkeypatch, kind, dtype, n, chunk):
    """A prompt into a KernelCache, in one call or in chunks: every buffer its cache keeps (softmax layers' keys and
    values, kept keys and values, exact heads' keys, values and page bounds) was allocated before the first layer
    ran, each reserved buffer is one of them (a later chunk writes into the room the first left, no buffer is
    regrown), and the logits and the decode steps after it equal those without reserving."""
    from oal.kernels.base import GROWTH as growth
    from oal.models.hooks import attached_kernels

    model = model_of(make_model, kind).to(dtype)
    if kind == "sink_window_exact_heads":
        for kernel in attached_kernels(model).values():
            kernel.decode_budget, kernel.decode_page = 32, 8  # page bounds too
    ids = prompt(2, n)
    monkeypatch.setattr(prefill, "reserved_for_prompt", lambda *a: contextlib.nullcontext())
    want, _ = run(model, ids, chunk, steps=growth + 1)
    monkeypatch.undo()
    reserved = spy_reserves(monkeypatch)
    model.config.oal_prefill_chunk = chunk
    cache = KernelCache(model)
    with torch.no_grad():
        got = model(input_ids=ids, cache=cache).logits
    kept = {t.data_ptr() for t in cache_buffers(cache)}
    assert reserved and {t.data_ptr() for t in reserved} == kept
    assert all(getattr(entry, "reserve", None) is None for entry in cache.layers)
    assert torch.equal(got, want[0])
    (_, *steps), _ = run(model, ids, chunk, steps=growth + 1)  # the steps after it outgrow the spare slots
    for g, w in zip(steps, want[1:], strict=True):
        assert torch.equal(g, w)


def test_no_buffers_are_reserved_where_a_prompt_would_not_keep_them(make_model, monkeypatch):
    """Nothing is reserved for a padded batch, under autograd, for a one-token step, nor for a prompt after tokens
    already cached (its entries are not empty)."""
    model = model_of(make_model, "sink_window_exact_heads")
    reserved = spy_reserves(monkeypatch)
    ids = prompt(2, 30)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    model.config.oal_prefill_chunk = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=KernelCache(model))
    model(input_ids=ids, cache=KernelCache(model))  # autograd on
    cache = KernelCache(model)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        assert reserved
        reserved.clear()
        model(input_ids=ids[:, :1], cache=cache)
        model(input_ids=ids[:, :7], cache=cache)
    assert reserved == []
