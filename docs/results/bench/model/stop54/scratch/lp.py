"""Stop 54: line_profiler over 30 decode steps of the recipe after an N-token prompt (decode_step, _kernel_attention,
_new_tokens; µs per line). Needs `pip install line_profiler` (not a dependency of the project).

    python docs/results/bench/model/stop54/scratch/lp.py 64
"""
import torch, time, sys
from line_profiler import LineProfiler
from oal.models import load_model, KernelCache
import oal.kernels.decode as dec
import oal.models.hooks as hooks
torch.set_num_threads(2)
m = load_model("docs/results/conversion/model").eval()
n = int(sys.argv[1])
ids = torch.randint(49152, (1, n), generator=torch.Generator().manual_seed(0))
lp = LineProfiler()
lp.add_function(dec.decode_step); lp.add_function(hooks._kernel_attention); lp.add_function(hooks._new_tokens)
with torch.no_grad():
    cache = KernelCache(m); tok = m(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    for _ in range(3): tok = m(tok, cache=cache).logits[:, -1:].argmax(-1)
    lp.enable_by_count()
    for _ in range(30): tok = m(tok, cache=cache).logits[:, -1:].argmax(-1)
    lp.disable_by_count()
lp.print_stats(output_unit=1e-6)
