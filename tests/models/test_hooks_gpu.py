"""The same hook guarantees on CUDA, where SDPA picks flash/efficient backends."""

import pytest
import torch

from oal.kernels import OALKernel, SoftmaxKernel
from oal.models import attach_kernel, capture_qkv, detach_kernel, exact_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_and_replacement_on_cuda(make_model, dtype):
    model = make_model("llama", num_heads=6, num_kv_heads=2, head_dim=16, qk_gain=4.0).to("cuda", dtype)
    ids = torch.randint(0, 101, (2, 70), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
        with capture_qkv(model, layers=[1], outputs=True, device=None) as rec:
            assert torch.equal(model(ids).logits, ref)
        q, k, v, o, scale = rec[1]
        assert q.device.type == "cuda" and q.dtype == dtype
        assert torch.equal(exact_attention(q, k, v, scale=scale), o)
        kernel = SoftmaxKernel(6, 2, 16)
        attach_kernel(model, 1, kernel)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=tol)
        attach_kernel(model, 1, OALKernel(torch.randint(0, 3, (6, 16)), num_kv_heads=2))
        out = model(ids).logits
        assert out.dtype == dtype and torch.isfinite(out).all() and (out - ref).abs().max() > 1e-3
        detach_kernel(model, 1)
        assert torch.equal(model(ids).logits, ref)
