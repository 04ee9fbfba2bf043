"""Exact softmax attention of queries that are the last ``n`` of ``N`` positions (causal aligned at the end: a
prompt's later chunk over the keys the cache holds before it, :mod:`oal.models.prefill`). ``naive.py`` is the
ground truth (the masked softmax); ``chunk.py`` the path the softmax layers of a converted model take on CPU
(and its exact heads, :mod:`oal.kernels.hybrid`, where the fused prompt kernel does not run them: on AMX tiles, or
without the fused kernels): the keys before the chunk and the chunk's own keys in two mask-free flash calls, merged by
their log-sum-exps."""

from .chunk import softmax_at_end
from .naive import naive_softmax_at_end

__all__ = ["naive_softmax_at_end", "softmax_at_end"]
