"""The causal linear-attention operator on hand-made feature maps: all modes against explicit references."""

from __future__ import annotations

import pytest
import torch

from oal.ops.linear import LinearState, linear_attention

B, HQ, HKV, D, DV = 2, 6, 2, 5, 3


def data(n, dtype=torch.float64):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(B, HQ, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, n, DV, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def elu1(x):
    return torch.nn.functional.elu(x) + 1


WQ = torch.rand(HQ, 1, 1, dtype=torch.float64) + 0.5  # per-query-head positive weights


def query_map(q, k):
    return elu1(q) * WQ.to(q.dtype)


def key_map_kv(q, k):  # depends on the KV head only
    return elu1(k)


def key_map_q(q, k):  # depends on the query head: uses that head's query at the same token
    return elu1(k).repeat_interleave(HQ // HKV, 1) * torch.sigmoid(q.sum(-1, keepdim=True))


def explicit(q, k, v, key_map, heads):
    fq, fk = query_map(q, k), key_map(q, k)
    out = torch.zeros(B, HQ, q.shape[2], DV, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            hk = h // (HQ // heads)
            for i in range(q.shape[2]):
                w = fk[b, hk, : i + 1] @ fq[b, h, i]
                out[b, h, i] = w @ v[b, h // (HQ // HKV), : i + 1] / w.sum()
    return out


@pytest.mark.parametrize("key_map,heads", [(key_map_kv, HKV), (key_map_q, HQ)])
@pytest.mark.parametrize("n,chunk", [(1, 4), (23, 4), (23, 64)])
def test_plain_features(key_map, heads, n, chunk):
    q, k, v = data(n)
    ref = explicit(q, k, v, key_map, heads)
    for mode in ("naive", "chunk", "recurrent"):
        o, state = linear_attention(
            q, k, v, query_map, key_map, key_heads=heads, mode=mode, chunk_size=chunk, output_final_state=True
        )
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
        fk = key_map(q, k)
        u = torch.cat([v, torch.ones_like(v[..., :1])], -1).repeat_interleave(heads // HKV, 1)
        torch.testing.assert_close(state.kv, fk.mT @ u)
        assert (state.shift == 0).all()


LOGW = torch.randn(HQ, D, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def log_key_map(q, k):
    return k.repeat_interleave(HQ // HKV, 1) @ LOGW.to(k.dtype)


def growing(k):
    """Key norms growing along the sequence, so exp() of the log-features overflows fp64 and the running
    maximum moves in every chunk."""
    return k * torch.linspace(1, 200, k.shape[2], dtype=k.dtype)[:, None]


def query_map_7(q, k):
    return torch.softmax(q @ LOGW.to(q.dtype), -1)


def test_log_keys_against_a_log_space_reference():
    n = 40
    q, k, v = data(n)
    k = growing(k)
    lk = log_key_map(q, k)
    assert lk.max() > 800  # exp(lk) is inf in fp64
    # log κ_ij = logsumexp_l(log φq_il + lk_jl), normalised over j ≤ i in log space
    logk = torch.logsumexp(torch.log(query_map_7(q, k))[..., :, None, :] + lk[..., None, :, :], -1)
    logk = logk.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.softmax(logk, -1) @ v.repeat_interleave(HQ // HKV, 1)
    for mode in ("naive", "chunk", "recurrent"):
        for chunk in (6, 64):
            o, state = linear_attention(
                q, k, v, query_map_7, log_key_map, key_heads=HQ, log_keys=True, mode=mode, chunk_size=chunk,
                output_final_state=True,
            )  # fmt: skip
            assert torch.isfinite(o).all()
            torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(state.shift, lk.amax(dim=(-2, -1)))
            # in the state's unit the largest key feature is exactly 1, so the normaliser column lies in [1, n]
            norm = state.kv[..., -1].amax(-1)
            assert (norm >= 1 - 1e-12).all() and (norm <= n).all()


def test_log_keys_continue_from_a_state():
    q, k, v = data(30)
    k = growing(k)
    kw = dict(key_heads=HQ, log_keys=True, output_final_state=True)
    full, fs = linear_attention(q, k, v, query_map_7, log_key_map, mode="naive", **kw)
    a, b = slice(0, 11), slice(11, 30)
    o1, s1 = linear_attention(q[:, :, a], k[:, :, a], v[:, :, a], query_map_7, log_key_map, chunk_size=4, **kw)
    for mode in ("naive", "chunk", "recurrent"):
        o2, s2 = linear_attention(
            q[:, :, b], k[:, :, b], v[:, :, b], query_map_7, log_key_map, mode=mode, chunk_size=5, initial_state=s1,
            **kw,
        )  # fmt: skip
        torch.testing.assert_close(torch.cat([o1, o2], 2), full, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s2.shift, fs.shift)
        torch.testing.assert_close(s2.kv, fs.kv, rtol=1e-10, atol=1e-12)


def test_bad_arguments():
    q, k, v = data(5)
    kw = dict(key_heads=HKV)
    with pytest.raises(ValueError, match="key_heads"):
        linear_attention(q, k, v, query_map, key_map_kv, key_heads=4)
    with pytest.raises(ValueError, match="key_map"):
        linear_attention(q, k, v, query_map, key_map_q, **kw)
    with pytest.raises(ValueError, match="query_map"):
        linear_attention(q, k, v, lambda q, k: query_map(q, k).float(), key_map_kv, **kw)
    with pytest.raises(ValueError, match="mode"):
        linear_attention(q, k, v, query_map, key_map_kv, mode="parallel", **kw)
    with pytest.raises(ValueError, match="q"):
        linear_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], query_map, key_map_kv, **kw)
    with pytest.raises(ValueError, match="dtype"):
        linear_attention(q, k, v, query_map, key_map_kv, dtype=torch.int32, **kw)
    _, state = linear_attention(q, k, v, query_map, key_map_kv, output_final_state=True, **kw)
    bad = LinearState(state.kv, state.shift + 1)
    for mode in ("naive", "chunk", "recurrent"):
        with pytest.raises(ValueError, match="initial_state"):
            linear_attention(q, k, v, query_map, key_map_kv, mode=mode, initial_state=bad, **kw)
        with pytest.raises(ValueError, match="initial_state"):
            linear_attention(q, k, v, query_map, key_map_kv, mode=mode, initial_state=state.kv, **kw)
        with pytest.raises(ValueError, match="initial_state"):
            small = LinearState(state.kv[:, :1], state.shift[:, :1])
            linear_attention(q, k, v, query_map, key_map_kv, mode=mode, initial_state=small, **kw)
