"""The Q/K/V capture cache: one early-stopped forward per block equals a full forward, files are reused only for
the same tokens and data, missing layers are recaptured, and layers stream across blocks."""

from __future__ import annotations

import pytest
import torch

from oal.fidelity.capture import CacheKey, QKVCache, capture_sequence, format_indices, parse_indices
from oal.models import capture_qkv, exact_attention


def _key(**kw) -> CacheKey:
    base = dict(model="tiny", model_source="local:x", text_source="local:t", split="valid", block_len=16, tokenizer="f")
    return CacheKey(**{**base, **kw})


@pytest.fixture
def model(tiny_model):
    return tiny_model


@pytest.fixture
def ids():
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def test_capture_sequence_matches_full_forward(model, ids):
    states = capture_sequence(model, ids[:1], [0, 1])
    with torch.no_grad(), capture_qkv(model, [0, 1, 2], outputs=True) as rec:
        model(ids[:1], use_cache=False)
    for i in (0, 1):
        for name in ("q", "k", "v", "o"):
            assert torch.equal(getattr(states[i], name), getattr(rec[i], name)), (i, name)
        # the captured output is exact softmax attention of the captured q, k, v
        st = states[i]
        torch.testing.assert_close(exact_attention(st.q, st.k, st.v, scale=st.scale), st.o, rtol=0, atol=0)
    assert states[0].q.shape == (1, 6, 16, 8) and states[0].k.shape == (1, 2, 16, 8)


def test_capture_stops_after_last_layer(model, ids):
    calls = []
    hook = model.model.layers[2].register_forward_hook(lambda *a: calls.append(1))
    try:
        capture_sequence(model, ids[:1], [1])
    finally:
        hook.remove()
    assert calls == []


def test_cache_ensure_reuse_and_stream(model, ids, tmp_path):
    cache = QKVCache(tmp_path, _key(), ids)
    stats = cache.ensure(model, [1, 3], [0, 2], progress=False)
    assert stats.captured == [1, 3] and stats.reused == []
    assert cache.stored_layers(1) == {0, 2} and cache.stored_layers(0) is None
    again = cache.ensure(model, [1, 3], [2], progress=False)
    assert again.captured == [] and again.reused == [1, 3]
    st = cache.layer(2, [3, 1], outputs=True)
    ref = capture_sequence(model, ids[3:4], [2])[2]
    assert st.q.shape == (2, 6, 16, 8) and torch.equal(st.q[0], ref.q[0]) and torch.equal(st.o[0], ref.o[0])
    assert st.scale == pytest.approx(8**-0.5)
    assert cache.layer(0, [1]).o is None


def test_missing_layer_recaptures_with_union(model, ids, tmp_path):
    cache = QKVCache(tmp_path, _key(), ids)
    cache.ensure(model, [0], [2], progress=False)
    stats = cache.ensure(model, [0], [1], progress=False)
    assert stats.captured == [0] and cache.stored_layers(0) == {1, 2}
    with pytest.raises(ValueError, match="no captured layer 0"):
        cache.layer(0, [0])


def test_mismatches_raise(model, ids, tmp_path):
    cache = QKVCache(tmp_path, _key(), ids)
    cache.ensure(model, [0], [0], progress=False)
    with pytest.raises(ValueError, match="different data.*text_source"):
        QKVCache(tmp_path, _key(text_source="local:other"), ids)
    other = ids.clone()
    other[0, 3] += 1
    with pytest.raises(ValueError, match="other tokens than block 0"):
        QKVCache(tmp_path, _key(), other).stored_layers(0)
    with pytest.raises(ValueError, match=r"block indices in \[0, 4\)"):
        cache.ensure(model, [4], [0], progress=False)
    with pytest.raises(ValueError, match="blocks of shape"):
        QKVCache(tmp_path, _key(), ids[:, :8])


def test_interrupted_write_leaves_no_file(model, ids, tmp_path, monkeypatch):
    import safetensors.torch

    cache = QKVCache(tmp_path, _key(), ids)

    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(RuntimeError):
        cache.ensure(model, [0], [0], progress=False)
    assert not cache.path(0).exists() and list(cache.dir.glob("*.tmp")) == []


def test_parse_and_format_indices():
    assert parse_indices("3-5, 9", "layers") == [3, 4, 5, 9]
    assert parse_indices("4,12,20", "layers") == [4, 12, 20]
    assert format_indices([3, 4, 5, 9, 11, 12]) == "3-5,9,11-12"
    for bad in ("", "5-3", "a", "1,1", "-2"):
        with pytest.raises(ValueError, match="layers"):
            parse_indices(bad, "layers")
