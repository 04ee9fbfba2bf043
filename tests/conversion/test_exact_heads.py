"""Exact heads inside converted layers: the model's logits, cached generation = one pass, cache contents,
save/load round trip, head ranking and retrieval-head scores on a tiny model."""

import pytest
import torch
from tiny import byte_tokenizer, convert_tiny

from oal.conversion import conversion_info, convert_model, load_converted, save_converted
from oal.conversion.heads import add_exact_heads, approximation_error_scores, rank_heads, retrieval_head_scores
from oal.kernels import ExactHeadsKernel, ExactHeadsState, OALKernel, SinkWindowKernel
from oal.kernels.base import model_layer, spare_slots
from oal.kernels.decode import GROWTH
from oal.models import KernelCache, attached_kernels, capture_qkv, detach_kernel
from oal.models.state_cache import layer_nbytes
from oal.ops.quadratic import cpu as cpu_kernel


def converted(make_model, kernel="oal", model=None):
    model = make_model("llama", num_heads=6, num_kv_heads=2) if model is None else model
    return convert_tiny(model, window=5 if kernel == "sink_window" else None)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("kernel", ["oal", "sink_window"])
def test_exact_heads_change_only_their_heads_and_all_exact_is_softmax(make_model, kernel):
    model = converted(make_model, kernel)
    ids = torch.randint(0, 256, (2, 30))
    before = logits(model, ids)
    add_exact_heads(model, {1: [0], 2: []})
    ks = attached_kernels(model)
    assert isinstance(ks[1], ExactHeadsKernel) and ks[1].exact_kv_heads == (0,)
    assert not isinstance(ks[2], ExactHeadsKernel)
    assert conversion_info(model)["exact_heads"] == {"1": [0]}
    mid = logits(model, ids)
    assert not torch.allclose(mid, before)
    # layer 1 with every KV head exact and layer 2 back to softmax: the original model's logits
    with capture_qkv(model, layers=[1], outputs=True) as rec:
        model(ids, use_cache=False)
    q, k, v, o, scale = rec[1]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    torch.testing.assert_close(o[:, :3], ref[:, :3], rtol=1e-5, atol=1e-6)  # KV head 0 = query heads 0-2
    assert not torch.allclose(o[:, 3:], ref[:, 3:], atol=1e-4)


@pytest.mark.parametrize("kernel", ["oal", "sink_window"])
def test_cached_decoding_equals_one_pass_and_cache_holds_exact_kv(make_model, kernel):
    model = converted(make_model, kernel)
    add_exact_heads(model, {1: [1], 2: [0]})
    ids = torch.randint(0, 256, (1, 40))
    full = logits(model, ids)
    with torch.no_grad():
        # the kernel heads' state from the first token (below the crossover the cache would keep their keys)
        cache = KernelCache(model, keep_keys=False)
        out = model(ids[:, :25], cache=cache, use_cache=True)
        steps = [out.logits]
        after_prefill = layer_nbytes(cache.layers[1])
        for t in range(25, 40):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    state = cache.layers[1].state
    # the prompt leaves layer 1's exact buffer its spare slots (41 of GROWTH): the fused decode step writes the 15
    # new tokens into them without growing it (25 + 41 slots); without the extension the torch step copies the
    # buffer per token, each time with the same spare room (40 + 41)
    with model_layer(1):
        spare = spare_slots(GROWTH)
    assert spare == 41
    slots = 25 + spare if cpu_kernel.load("decode") is not None else 40 + spare
    assert isinstance(state, ExactHeadsState) and state.offset == 40 and state.k.shape == (1, 1, slots, 8)
    # only the exact KV head's cache may grow: x (k, v) x 8 dims x 4 bytes; the kernel state stays the same
    assert layer_nbytes(cache.layers[1]) - after_prefill == (slots - 25 - spare) * 2 * 8 * 4


def test_save_load_round_trip_is_bit_identical(make_model, tmp_path):
    model = converted(make_model, "sink_window")
    add_exact_heads(model, {2: [0, 1]})
    ids = torch.randint(0, 256, (2, 19))
    ref = logits(model, ids)
    loaded = load_converted(save_converted(model, tmp_path / "m", tokenizer=byte_tokenizer()))
    assert torch.equal(logits(loaded, ids), ref)
    k = attached_kernels(loaded)[2]
    assert isinstance(k, ExactHeadsKernel) and k.exact_kv_heads == (0, 1) and isinstance(k.inner, SinkWindowKernel)
    assert conversion_info(loaded)["exact_heads"] == {"2": [0, 1]}


def test_add_exact_heads_refuses_bad_input(make_model):
    plain = make_model("llama", num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="not a converted model"):
        add_exact_heads(plain, {1: [0]})
    model = converted(make_model)
    with pytest.raises(ValueError, match="layer 0 is not converted"):
        add_exact_heads(model, {0: [0]})
    with pytest.raises(ValueError, match=r"exact_kv_heads: expected distinct KV head indices in \[0, 2\)"):
        add_exact_heads(model, {1: [2]})
    assert isinstance(detach_kernel(model, 1), OALKernel)


def test_rank_heads_orders_by_score_then_position():
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.9], [0.0, 0.2]])
    assert rank_heads(scores, [0, 1, 2]) == [(0, 1), (1, 1), (1, 0), (2, 1), (0, 0), (2, 0)]
    assert rank_heads(scores, [2]) == [(2, 1), (2, 0)]


def test_retrieval_head_scores_on_a_tiny_model(make_model):
    model = make_model("llama", num_heads=6, num_kv_heads=2)
    tok = byte_tokenizer()
    hay = ["A quiet day by the sea.", "Birds fly over the hills."]
    s = retrieval_head_scores(model, tok, hay, lengths=[400], prompts=2, tasks=("passkey",), progress=False)
    assert s.shape == (4, 2) and bool((s >= 0).all()) and bool((s <= 1).all()) and bool(s.sum() > 0)
    again = retrieval_head_scores(model, tok, hay, lengths=[400], prompts=2, tasks=("passkey",), progress=False)
    assert torch.equal(s, again)
    needle = retrieval_head_scores(
        model, tok, hay, lengths=[400], prompts=2, tasks=("passkey",), target="needle", progress=False
    )
    assert bool((needle >= s - 1e-6).all())  # the needle sentence holds the digits, the rows include theirs
    with pytest.raises(ValueError, match="target"):
        retrieval_head_scores(model, tok, hay, target="keys")
    convert_model(model, "global", layers=[1])
    with pytest.raises(ValueError, match="original model"):
        retrieval_head_scores(model, tok, hay, lengths=[400], prompts=1, tasks=("passkey",), progress=False)


def test_approximation_error_scores_by_hand(make_model):
    import copy

    base = make_model("llama", num_heads=6, num_kv_heads=2)
    kernels = attached_kernels(convert_tiny(copy.deepcopy(base), window=5))
    ids = torch.randint(0, 256, (1, 40))
    s = approximation_error_scores(base, kernels, ids, skip=12)
    assert s.shape == (4, 2) and torch.all(s[[0, 3]] == 0) and bool((s[1:3] > 0).all())
    # by hand: layer 2, KV head 1 = query heads 3..5, positions 12..39
    with torch.no_grad(), capture_qkv(base, layers=[2]) as rec:
        base(input_ids=ids, use_cache=False)
    q, k, v, _, scale = rec[2]
    kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    logits = (q @ kk.mT) * scale
    logits = logits.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    exact = logits.softmax(-1) @ vv
    with torch.no_grad():
        approx = kernels[2](q, k, v)[0]
    errs = [((approx - exact)[0, h, 12:].norm() / exact[0, h, 12:].norm()).item() for h in (3, 4, 5)]
    assert s[2, 1].item() == pytest.approx(max(errs), rel=1e-4)
    # a window that covers every key leaves nothing to approximate
    wide = attached_kernels(convert_tiny(copy.deepcopy(base), window=64))
    assert float(approximation_error_scores(base, wide, ids, skip=12).max()) < 1e-5
    with pytest.raises(ValueError, match="ids"):
        approximation_error_scores(base, kernels, ids[0])
    with pytest.raises(ValueError, match="skip"):
        approximation_error_scores(base, kernels, ids, skip=40)
    with pytest.raises(ValueError, match="layers \\[7\\]"):
        approximation_error_scores(base, {7: kernels[1]}, ids, skip=12)
    with pytest.raises(ValueError, match="original model"):
        approximation_error_scores(convert_tiny(copy.deepcopy(base)), kernels, ids, skip=12)


def test_kernels_only_directory_loads_onto_the_named_base(make_model, tmp_path):
    base = make_model("llama", num_heads=6, num_kv_heads=2)
    base.save_pretrained(tmp_path / "base")
    model = converted(make_model, "sink_window", model=base)
    add_exact_heads(model, {1: [1]})
    ids = torch.randint(0, 256, (1, 23))
    ref = logits(model, ids)
    out = save_converted(model, tmp_path / "light", tokenizer=byte_tokenizer(), base_weights=str(tmp_path / "base"))
    files = sorted(p.name for p in out.iterdir())
    assert "kernels.safetensors" in files and "model.safetensors" not in files
    assert (out / "kernels.safetensors").stat().st_size < 20_000
    loaded = load_converted(out)
    assert torch.equal(logits(loaded, ids), ref)
    assert conversion_info(loaded)["base_weights"] == str(tmp_path / "base")
    other = make_model("llama", num_heads=6, num_kv_heads=2, layers=3)
    other.save_pretrained(tmp_path / "other")
    import json

    cfg = json.loads((out / "config.json").read_text())
    cfg["oal_conversion"]["base_weights"] = str(tmp_path / "other")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_converted(out)


def test_gate_gradient_scores_match_a_finite_difference(make_model):
    import random

    from oal.conversion import heads as heads_mod
    from oal.evaluation.retrieval import build_prompt
    from oal.models import attach_kernel

    model = converted(make_model, "sink_window")
    tok = byte_tokenizer()
    hay = ["A quiet day by the sea.", "Birds fly over the hills."]
    g = heads_mod.gate_gradient_scores(model, tok, hay, lengths=[300], prompts=1, tasks=("passkey",), progress=False)
    assert g.shape == (4, 2) and torch.all(g[[0, 3]] == 0) and bool(g[1:3].abs().sum() > 0)
    assert all(not isinstance(k, heads_mod._GatedKernel) for k in attached_kernels(model).values())
    # the same prompt, by hand: log p(answer) with KV head 0 of layer 2 moved by ±eps towards softmax
    p = build_prompt(tok, 300, random.Random("gates/2/passkey/300/0"), task="passkey", haystack=hay)
    answer = tok(" " + p.answer, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p.ids + answer])

    def logp(eps):
        kernels = dict(attached_kernels(model))
        for layer, k in kernels.items():
            alpha = torch.zeros(2, dtype=torch.float64)
            if layer == 2:
                alpha[0] = eps
            attach_kernel(model, layer, heads_mod._GatedKernel(k, alpha))
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False).logits[0, len(p.ids) - 1 : -1].double()
        for layer, k in kernels.items():
            attach_kernel(model, layer, k)
        return float(out.log_softmax(-1).gather(-1, ids[0, len(p.ids) :, None]).sum())

    eps = 1e-3
    assert g[2, 0].item() == pytest.approx((logp(eps) - logp(-eps)) / (2 * eps), rel=2e-2, abs=1e-4)


@pytest.mark.skipif(cpu_kernel.load("decode") is None, reason="the fused CPU decode kernel did not build")
@pytest.mark.parametrize("kernel, exact", [("oal", None), ("sink_window", None), ("sink_window", {1: [1], 2: [0]})])
def test_generate_reaches_the_fused_decode_step_and_matches_the_torch_step(make_model, kernel, exact, spy_fast_path):
    import oal.models.hooks as hooks

    model = converted(make_model, kernel)
    if exact:
        add_exact_heads(model, exact)
    ids = torch.randint(0, 256, (2, 12))
    calls = spy_fast_path(hooks, "decode_step")
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        fused = model.generate(ids, **kw)
        n_fused = len(calls)
        with cpu_kernel.disabled():
            plain = model.generate(ids, **kw)
    # 7 one-token steps through 2 converted layers, every one fused; none with the extension off
    assert n_fused == 14 and all(calls[:n_fused]) and not any(calls[n_fused:])
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("kernel", ["oal", "sink_window"])
def test_int8_exact_cache_decodes_as_one_pass_and_round_trips(make_model, kernel, tmp_path):
    """set_exact_kv_dtype(int8): cached decoding (prompt, then one token at a time, the fused steps) equals one
    pass over the same tokens (each token's key quantised the same way; bf16 products within their bound), the
    state holds int8 keys with their scales, and the dtype survives save / load; a model without exact heads or a
    bad dtype is refused."""
    from oal.conversion.heads import set_exact_kv_dtype

    model = converted(make_model, kernel)
    with pytest.raises(ValueError, match="no layer has exact heads"):
        set_exact_kv_dtype(model, torch.int8)
    add_exact_heads(model, {1: [1], 2: [0]}, kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"product_dtype: bf16 products need"):
        set_exact_kv_dtype(model, None)
    assert attached_kernels(model)[1].kv_dtype == torch.bfloat16  # refused before any kernel changed
    assert set_exact_kv_dtype(model, torch.int8) == 2
    ids = torch.randint(0, 256, (1, 40))
    full = logits(model, ids)
    with torch.no_grad():
        cache = KernelCache(model)
        out = model(ids[:, :25], cache=cache, use_cache=True)
        steps = [out.logits]
        for t in range(25, 40):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    # bf16 products: the prompt kernel rounds the dequantised values to bf16, the decode step folds their scales
    # into the weights (2^-9 · max |v| apart)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-3, atol=1e-3)
    state = cache.layers[1].state
    assert state.k.dtype == torch.int8 and state.k_scale.dtype == torch.float32 and state.offset == 40
    loaded = load_converted(save_converted(model, tmp_path / "m", tokenizer=byte_tokenizer()))
    assert attached_kernels(loaded)[2].kv_dtype == torch.int8
    assert torch.equal(logits(loaded, ids), full)


@pytest.mark.skipif(cpu_kernel.load("decode") is None, reason="the fused CPU decode kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_budget_generates_alike_fused_and_torch_and_round_trips(make_model, dtype, spy_fast_path, tmp_path):
    """set_exact_decode_budget: generate() past the budget gives the same tokens through the fused step as through
    the torch path (fp32; a bf16 model through its own path, where only a near tie may flip a token), differs from
    the full exact heads' logits (pages were left out), and the budget survives save / load."""
    import oal.models.hooks as hooks
    from oal.conversion.heads import set_exact_decode_budget

    model = converted(make_model, "sink_window")
    add_exact_heads(model, {1: [1], 2: [0]}, kv_dtype=torch.bfloat16, product_dtype=torch.bfloat16)
    assert set_exact_decode_budget(model, 32, 8) == 2
    model = model.to(dtype)
    ids = torch.randint(1, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    calls = spy_fast_path(hooks, "decode_step")
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "output_logits": True}
    kw["return_dict_in_generate"] = True
    with torch.no_grad():
        fused = model.generate(ids, **kw)
        n_fused = len(calls)
        with cpu_kernel.disabled():
            plain = model.generate(ids, **kw)
    if dtype == torch.float32:  # 11 one-token steps through 2 converted layers, every one fused
        assert n_fused == 22 and all(calls[:n_fused])
    got, want = torch.stack(fused.logits, 1).float(), torch.stack(plain.logits, 1).float()
    atol = 2e-4 if dtype == torch.float32 else 5e-2
    differ = (fused.sequences != plain.sequences)[:, ids.shape[1] :]
    steps = differ.any(0).nonzero()
    first = int(steps[0]) if len(steps) else differ.shape[1]
    if first < differ.shape[1]:
        # in bf16 a greedy token may flip only at a near tie of the reference (its two best logits a rounding apart:
        # the fused step's and torch's bf16 roundings differ by an ulp, e.g. on AVX2 against AVX-512); after it the
        # rows see different tokens
        assert dtype == torch.bfloat16, f"fp32: the fused and torch paths chose different tokens at step {first}"
        best = want[:, first].topk(2, -1).values
        gap = (best[:, 0] - best[:, 1])[differ[:, first]]
        assert (gap <= atol).all(), f"step {first}: a token flipped where the reference's margin was {gap.tolist()}"
    torch.testing.assert_close(got[:, : first + 1], want[:, : first + 1], rtol=0, atol=atol)
    loaded = load_converted(save_converted(model, tmp_path / "m", tokenizer=byte_tokenizer()))
    assert [(k.decode_budget, k.decode_page) for k in attached_kernels(loaded).values()] == [(32, 8), (32, 8)]
    set_exact_decode_budget(model, None)
    with torch.no_grad():
        full = torch.stack(model.generate(ids, **kw).logits, 1)
    assert not torch.allclose(full[:, 1:].float(), got[:, 1:].float(), atol=1e-3)  # the first token is the prompt's
    with pytest.raises(ValueError, match="decode_budget"):
        set_exact_decode_budget(model, 20, 8)
