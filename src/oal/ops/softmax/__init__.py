"""Exact softmax attention of queries that are the last ``n`` of ``N`` positions (causal aligned at the end: a
prompt's later chunk over the keys the cache holds before it, :mod:`oal.models.prefill`). ``naive.py`` is the
ground truth (the masked softmax); ``chunk.py`` the path the softmax layers of a converted model take on CPU
(and its exact heads, :mod:`oal.kernels.hybrid`, where the fused prompt kernel does not run them: on AMX tiles, or
without the fused kernels): the keys before the chunk and the chunk's own keys in two mask-free flash calls, merged by
their log-sum-exps. :func:`causal_softmax` is a whole causal segment (``n = N``): the sink/window operator on a
fresh segment no longer than its sinks and window, where every key is exact."""

from .chunk import causal_softmax, softmax_at_end
from .naive import naive_softmax_at_end

__all__ = ["causal_softmax", "naive_softmax_at_end", "softmax_at_end"]
