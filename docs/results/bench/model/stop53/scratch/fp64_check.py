"""Stop 53: a 2048-token forward of plain OAL and of the recipe without a cache, with and without the parallel
prefix, and with a cache (chunked prefill), each against the same model in fp64 (max |logit difference|).

    python docs/results/bench/model/stop53/scratch/fp64_check.py
"""

import torch

import oal.ops.quadratic.chunk as chunk
from oal.bench.decode import DecodeConfig, build_model
from oal.models import KernelCache

torch.set_num_threads(2)
real = chunk.parallel_prefix
for which in ("plain", "docs/results/conversion/model"):
    m = build_model("converted", DecodeConfig(converted=None if which == "plain" else which, layers="3-26"))
    ids = torch.randint(m.config.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        for name, p in (("without", lambda *s: 0), ("with", real)):
            chunk.parallel_prefix = p
            out[name] = m(ids, use_cache=False).logits[0]
        chunk.parallel_prefix = real
        out["cached"] = m(ids, cache=KernelCache(m)).logits[0]
        out["fp64"] = m.double()(ids, use_cache=False).logits[0].float()
    for a in ("without", "with", "cached"):
        d = (out[a] - out["fp64"]).abs()
        print(which, a, "vs fp64: max", float(d.max()), "last-row max", float(d[-1].max()))
    print(which, "with vs without: max", float((out["with"] - out["without"]).abs().max()))
