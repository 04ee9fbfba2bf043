"""The main job (``make demo`` / ``oal demo``): the converted model against the original, side by side, with real
measurements — held-out perplexity, passkey retrieval, decode latency, prefill time, cache memory and greedy
continuations — in one report and one figure."""

from .run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
