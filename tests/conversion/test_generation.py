"""Cached generation (recurrent kernel state in converted layers, keys and values elsewhere) against greedy decoding
that recomputes the whole sequence every step."""

import pytest
import torch
from transformers import DynamicCache

from oal.conversion import convert_model
from oal.kernels import AttentionKernel
from oal.kernels.base import model_layer, spare_slots
from oal.kernels.decode import GROWTH, softmax_decode_step
from oal.kernels.kept import KEPT_GROWTH
from oal.models import KernelCache, KernelStateLayer, attach_kernel, cache_nbytes, detach_kernel
from oal.models.state_cache import ExactKVLayer, layer_nbytes

KERNELS = ["oal", "global", "performer", "spectraformer", "dijiang", "taylorshift", "softmax"]


def prompt(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    # token 0 is the pad token: keep it out of prompts, or generate() would infer a padding mask
    return torch.randint(1, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def convert(model, kernel, layers="1-2", **kw):
    if kernel == "oal":
        g = torch.Generator().manual_seed(0)
        kw["groups"] = {i: torch.randint(0, 3, (model.config.num_attention_heads, 8), generator=g) for i in range(4)}
    return convert_model(model, kernel, layers=layers, **kw)


def recompute_greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and per-step last-position logits, re-running the full sequence without a cache."""
    seq, steps_logits = ids, []
    with torch.no_grad():
        for _ in range(steps):
            last = model(seq, use_cache=False).logits[:, -1]
            steps_logits.append(last)
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(steps_logits, 1)


def cached_greedy(model, ids: torch.Tensor, steps: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True, output_logits=True, **kw
        )
    return out.sequences, torch.stack(out.logits, 1)


def assert_same_generation(model, ids, steps=10, **kw):
    want, want_logits = recompute_greedy(model, ids, steps)
    got, got_logits = cached_greedy(model, ids, steps, **kw)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_cached_generation_equals_recomputation(make_model, kernel):
    model = convert(make_model("llama", num_kv_heads=2), kernel, seed=1)
    # 70 prompt tokens: the prefill spans two chunks of the chunked kernels
    assert_same_generation(model, prompt(1, 70))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("kv", [6, 2])
@pytest.mark.parametrize("kernel", ["oal", "performer"])
def test_cached_generation_families(make_model, arch, kv, kernel):
    model = convert(make_model(arch, num_kv_heads=kv), kernel, layers=[0, 2])
    assert_same_generation(model, prompt(2, 13), steps=6)


def test_generation_with_an_explicit_kernel_cache(make_model):
    model = convert(make_model(), "oal")
    cache = KernelCache(model)
    assert [type(layer).__name__ for layer in cache.layers] == [
        "ExactKVLayer",
        "KernelStateLayer",
        "KernelStateLayer",
        "ExactKVLayer",
    ]
    ids = prompt(1, 9)
    want, _ = recompute_greedy(model, ids, 5)
    got, _ = cached_greedy(model, ids, 5, cache=cache)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 13 and cache.layers[1].get_seq_length() == 13
    assert cache.layers[1].keys is None  # converted layers store no keys or values


def test_multi_token_continuation_matches_one_pass(make_model):
    model = convert(make_model(), "performer")
    ids = prompt(2, 40)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 17), (17, 18), (18, 40))]
    assert isinstance(cache.layers[1], KernelStateLayer)  # the fresh DynamicCache's entry was taken over
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kernel", ["oal", "performer", "dijiang"])
def test_state_size_does_not_grow_with_the_context(make_model, kernel):
    model = convert(make_model(), kernel)
    sizes = {}
    for n in (8, 96):
        cache = KernelCache(model, keep_keys=False)  # the state from the first token (test_kept_keys_... below)
        with torch.no_grad():
            model(prompt(1, n), cache=cache)
        sizes[n] = [(type(layer).__name__, layer_nbytes(layer)) for layer in cache.layers]
        assert cache_nbytes(cache) == sum(b for _, b in sizes[n])
    converted = [b for (name, b) in sizes[8] if name == "KernelStateLayer"]
    assert converted == [b for (name, b) in sizes[96] if name == "KernelStateLayer"] and all(converted)
    softmax = [i for i, (name, _) in enumerate(sizes[8]) if name == "ExactKVLayer"]
    # softmax layers hold keys and values of every token and, after a prompt, their layer's spare slots
    spare = {i: (41 * i) % GROWTH for i in softmax}
    per_token = {n: [sizes[n][i][1] / (n + spare[i]) for i in softmax] for n in (8, 96)}
    assert len(softmax) == 2 and per_token[8] == per_token[96] and len(set(spare.values())) == 2


@pytest.mark.parametrize(
    ("kernel", "shape"),
    [
        ("oal", (1, 2, 1 + 8 + 36, 9)),  # per KV head, packed quadratic state (B, Hkv, 1 + d + d(d+1)/2, dv + 1)
        ("global", (1, 2, 1 + 8 + 36, 9)),
        ("taylorshift", (1, 2, 1 + 8 + 36, 9)),
        ("dijiang", (1, 2, 8, 9)),  # LinearState per KV head, m = d features
        ("performer", (1, 6, 16, 9)),  # LinearState per query head, m = num_features
        ("spectraformer", (1, 6, 9, 9)),  # per query head, m = d + 1
    ],
)
def test_state_per_kv_or_query_head(make_model, kernel, shape):
    kw = {"num_features": 16} if kernel == "performer" else {}
    model = convert(make_model(num_kv_heads=2), kernel, layers=[1], **kw)
    cache = KernelCache(model, keep_keys=False)
    with torch.no_grad():
        model(prompt(1, 5), cache=cache)
    state = cache.layers[1].state
    assert tuple(getattr(state, "kv", state).shape) == shape


@pytest.mark.parametrize("kernel", ["oal", "performer"])
def test_beam_search_reorders_kernel_states(make_model, kernel):
    model = convert(make_model(), kernel)
    ids = prompt(2, 11)
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, use_cache=False, **kw)
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_bf16_model_generates_with_fp32_kernels_and_states(make_model):
    model = convert(make_model(), "oal").to(torch.bfloat16)
    cache = KernelCache(model)
    with torch.no_grad():
        out = model.generate(prompt(1, 9), max_new_tokens=4, do_sample=False, cache=cache)
    assert out.shape == (1, 13)
    assert model.model.layers[1].self_attn.oal_kernel.L.dtype == torch.float32
    # 13 tokens: the converted layer keeps its keys and values in the model's bf16 (exactly what the kernel read,
    # widened), the state it folds into is fp32
    state = cache.layers[1].state
    assert state.k.dtype == state.v.dtype == torch.bfloat16 and cache.layers[0].keys.dtype == torch.bfloat16
    cache = KernelCache(model, keep_keys=False)
    with torch.no_grad():
        model.generate(prompt(1, 9), max_new_tokens=4, do_sample=False, cache=cache)
    assert cache.layers[1].state.dtype == torch.float32


def test_stale_caches_are_refused(make_model):
    model = convert(make_model(), "taylorshift")
    ids = prompt(1, 6)
    cache = KernelCache(model)
    with torch.no_grad():
        model(ids, cache=cache)
        detach_kernel(model, 2)
        with pytest.raises(ValueError, match="no kernel is attached to it any more"):
            model(ids[:, :1], cache=cache)
    model = convert(make_model(), "taylorshift")
    cache = KernelCache(model)
    with torch.no_grad():
        model(ids, cache=cache)
        padded = torch.ones(1, 8, dtype=torch.long)
        padded[0, 0] = 0
        with pytest.raises(ValueError, match="does not match what the cached state holds"):
            model(ids[:, :2], attention_mask=padded, cache=cache)  # fails after layer 1's cache update
        with pytest.raises(ValueError, match="the previous 2 tokens of this layer never reached its kernel"):
            model(ids[:, :1], cache=cache)


def test_kernel_without_state_cannot_continue(make_model):
    class NoState(AttentionKernel):
        def forward(self, q, k, v, *, mode="chunk", initial_state=None, output_final_state=False):
            return torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype), None

    model = make_model()
    attach_kernel(model, 1, NoState(6, 2, 8))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(1, 5), cache=cache)  # a prompt alone works
        with pytest.raises(ValueError, match="returned no recurrent state for the first 5 tokens"):
            model(prompt(1, 1), cache=cache)


def test_softmax_layers_decode_through_the_fused_step(make_model, monkeypatch):
    import oal.models.hooks as hooks

    calls = []

    def spy(q, k_buf, v_buf, length, scale):
        out = softmax_decode_step(q, k_buf, v_buf, length, scale)
        calls.append((length, out is not None))
        return out

    monkeypatch.setattr(hooks, "softmax_decode_step", spy)
    model = convert(make_model("llama", num_kv_heads=2), "oal")
    ids = prompt(2, 21)
    assert_same_generation(model, ids, steps=8)  # fresh DynamicCache of generate(): its softmax entries taken over
    # layers 0 and 3 keep softmax: 7 one-token steps each (the first new token comes from the prefill)
    assert sorted(calls) == sorted((n, True) for n in range(22, 29) for _ in range(2))
    calls.clear()
    cache = KernelCache(model)
    assert [type(layer).__name__ for layer in cache.layers] == [
        "ExactKVLayer",
        "KernelStateLayer",
        "KernelStateLayer",
        "ExactKVLayer",
    ]
    assert_same_generation(model, ids, steps=3, cache=cache)
    assert len(calls) == 4 and all(ok for _, ok in calls)


def test_exact_kv_layer_writes_in_place_and_keeps_dynamic_layer_semantics():
    layer = ExactKVLayer()
    gen = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 3, 10, 4, generator=gen), torch.randn(2, 3, 10, 5, generator=gen)
    keys, values = layer.update(k0, v0)
    assert torch.equal(keys, k0) and torch.equal(values, v0) and layer.get_seq_length() == 10
    kbuf, _ = layer.buffers(keys)
    assert kbuf.shape == (2, 3, 10, 4)  # a prompt: no spare slots
    assert layer.nbytes == 2 * 3 * 10 * (4 + 5) * 4
    new = [(torch.randn(2, 3, 1, 4, generator=gen), torch.randn(2, 3, 1, 5, generator=gen)) for _ in range(GROWTH + 2)]
    layer.update(*new[0])
    kbuf, _ = layer.buffers(layer.keys)
    assert kbuf.shape == (2, 3, 11 + GROWTH, 4)  # the first step adds GROWTH spare slots
    assert layer.nbytes == 2 * 3 * (11 + GROWTH) * (4 + 5) * 4  # the spare slots count
    for i, (k, v) in enumerate(new[1:]):
        keys, values = layer.update(k, v)
        same_buffer = layer.buffers(keys)[0].data_ptr() == kbuf.data_ptr()
        assert same_buffer == (i < GROWTH)  # in place until the buffer is full, then one grown copy
    want_k = torch.cat([k0] + [k for k, _ in new], dim=2)
    assert torch.equal(keys, want_k) and layer.get_seq_length() == 12 + GROWTH
    assert layer.buffers(keys.clone()) is None  # only the views it returned
    layer.crop(-3)
    keys, _ = layer.update(*new[0])
    assert torch.equal(keys, torch.cat([want_k[:, :, :-3], new[0][0]], dim=2))
    layer.reorder_cache(torch.tensor([1, 0]))  # a copy: the next update starts a new buffer
    assert layer.buffers(layer.keys) is None
    keys, _ = layer.update(*new[1])
    assert layer.buffers(keys) is not None and torch.equal(keys[0, :, -1:], new[1][0][0])
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes == 0


def test_exact_kv_layers_after_a_prompt_grow_at_different_steps():
    """A softmax layer's prompt leaves its layer's spare slots (41 · layer mod GROWTH), so the layers' buffers
    fill up at different decode steps instead of all growing at the first one."""
    grown_at = {}
    for idx in (1, 2, 3):
        layer = ExactKVLayer(idx)
        k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
        layer.update(k, v)
        assert layer.buffers(layer.keys)[0].shape[2] == 10 + (41 * idx) % GROWTH
        start = layer.buffers(layer.keys)[0].data_ptr()
        for step in range(1, GROWTH + 1):
            keys, _ = layer.update(k[:, :, :1], v[:, :, :1])
            if layer.buffers(keys)[0].data_ptr() != start:
                grown_at[idx] = step
                break
        assert torch.equal(keys[:, :, :10], k)
    assert grown_at == {i: (41 * i) % GROWTH + 1 for i in (1, 2, 3)}


@pytest.mark.parametrize("kernel", ["oal", "global"])
def test_kept_keys_below_the_crossover_then_the_state(make_model, kernel):
    """A converted layer's cache holds its fp32 keys and values while they are smaller than the state (d = 8:
    25 tokens), then the state; generation equals recomputation across the switch and equals the cache that keeps
    the state from the first token."""
    model = convert(make_model(), kernel)
    ids = prompt(2, 9)
    want, want_logits = recompute_greedy(model, ids, 24)
    caches = {keep: KernelCache(model, keep_keys=keep) for keep in (True, False)}
    seen = []
    with torch.no_grad():
        seq, cache = ids, caches[True]
        out = model(seq, cache=cache)
        for _ in range(24):
            seen.append(type(cache.layers[1].state).__name__)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            out = model(nxt, cache=cache)
        got_state, _ = cached_greedy(model, ids, 24, cache=caches[False])
    assert torch.equal(seq[:, :-1], want[:, :-1]) and torch.equal(got_state, want)
    # prompt 9 .. 26 tokens kept (18 entries: the limit, 25, plus layer 1's place in the folds' spread), then folded
    assert seen == ["KeptKV"] * 18 + ["Tensor"] * 6
    state_bytes = 2 * 2 * (1 + 8 + 36) * 9 * 4  # batch 2, 2 KV heads
    assert layer_nbytes(caches[True].layers[1]) == layer_nbytes(caches[False].layers[1]) == state_bytes


def test_kept_keys_hold_less_than_the_state_and_reorder_in_beam_search(make_model):
    model = convert(make_model(), "oal")
    cache = KernelCache(model)
    with torch.no_grad():
        model(prompt(1, 5), cache=cache)
    # 5 tokens of fp32 keys and values and layer 1's spare slots, 2 KV heads, d = dv = 8
    with model_layer(1):
        spare = spare_slots(KEPT_GROWTH)
    assert 0 < spare < KEPT_GROWTH
    assert layer_nbytes(cache.layers[1]) == 2 * (5 + spare) * (8 + 8) * 4 < 2 * (1 + 8 + 36) * 9 * 4
    with torch.no_grad():  # the steps fill the spare slots; the one after them grows the buffers
        for _ in range(spare):
            model(prompt(1, 1), cache=cache)
        assert layer_nbytes(cache.layers[1]) == 2 * (5 + spare) * (8 + 8) * 4
        model(prompt(1, 1), cache=cache)
    assert layer_nbytes(cache.layers[1]) > 2 * (5 + spare) * (8 + 8) * 4
    ids = prompt(2, 11)
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))
