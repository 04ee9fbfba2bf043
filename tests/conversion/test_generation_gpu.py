"""Cached generation on CUDA (skipped without a device): the same equality as on the CPU, fp32 and bf16 models."""

import pytest
import torch

from oal.conversion import convert_model
from oal.models import KernelCache, attached_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("kernel", ["oal", "performer", "taylorshift"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_generation_on_cuda(make_model, kernel, dtype):
    kw = {"groups": {i: torch.randint(0, 3, (6, 8)) for i in (1, 2)}} if kernel == "oal" else {}
    model = convert_model(make_model(), kernel, layers="1-2", **kw).to("cuda", dtype)
    assert all(
        k.state_dict()[n].dtype != torch.bfloat16 for k in attached_kernels(model).values() for n in k.state_dict()
    )
    ids = torch.randint(1, 256, (2, 70), device="cuda")
    cache = KernelCache(model)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        seq = ids
        for _ in range(8):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert cache.layers[1].state is not None
    if dtype == torch.float32:  # bf16 logits are too coarse for exact greedy agreement
        assert torch.equal(got, seq)
    else:
        assert got.shape == seq.shape and torch.equal(got[:, :70], ids)
