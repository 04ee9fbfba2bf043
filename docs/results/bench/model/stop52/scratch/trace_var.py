# prefill_trace.py with the prompt's heap also released before the decoder layers named in OAL_RELEASE_AT
# (run from the repository root: OAL_RELEASE_AT=29 python trace_var.py plain --n 1024 --dtype fp32 --first-prompt 64)
import os, sys, contextlib
sys.path.insert(0, "benchmarks")
import oal.models.prefill as prefill
at = [int(x) for x in os.environ.get("OAL_RELEASE_AT", "").split(",") if x]
orig = prefill.heap_released_before_output
@contextlib.contextmanager
def patched(model):
    hs = [model.base_model.layers[i].register_forward_pre_hook(prefill._release_hook) for i in at]
    try:
        with orig(model):
            yield
    finally:
        for h in hs: h.remove()
prefill.heap_released_before_output = patched
import prefill_trace
prefill_trace.main()
