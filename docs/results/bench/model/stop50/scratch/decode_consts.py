import sys
sys.path.insert(0, "benchmarks")
import torch
from prefill_peak import build
from oal.models import KernelCache
from oal.models.hooks import attached_kernels
from oal.kernels import decode as dec
m = build("recipe", "fp32")
ids = torch.randint(49152, (1, 64))
with torch.no_grad():
    m(ids, cache=KernelCache(m), logits_to_keep=1)
tot = 0; per = {}
for i, k in attached_kernels(m).items():
    c = getattr(k, dec._CONSTANTS_ATTR, None)
    if c is None: continue
    nb = [t.numel() * t.element_size() for t in c[1]]
    per[i] = nb; tot += sum(nb)
print("total MB", tot / 2**20); print(per.get(0), per.get(11))
other = 0
for i, k in attached_kernels(m).items():
    for name, v in vars(k).items():
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter): other += v.numel() * v.element_size()
print("tensor attrs MB", other / 2**20)
