"""Text generation with timing, for `oal generate`: ``model.generate`` with the default cache (converted layers
keep their recurrent kernel state, see :mod:`oal.models.state_cache`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer


@dataclass(frozen=True)
class GenerationResult:
    """Generated text and timing: ``first_token_s`` covers the prompt's prefill and the first new token,
    ``total_s`` the whole ``generate`` call."""

    text: str
    prompt_tokens: int
    new_tokens: int
    total_s: float
    first_token_s: float

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first (the decode steps alone); NaN with fewer than two new tokens."""
        decode_s = self.total_s - self.first_token_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else float("nan")


class _Clock(BaseStreamer):
    """Time stamps of the prompt (first ``put``) and of every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> GenerationResult:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens: greedy for ``temperature = 0``, sampled otherwise
    (seeded). Batch size 1, no padding."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt: expected a non-empty string")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature: expected a number ≥ 0, got {temperature!r}")
    enc = tokenizer(prompt, return_tensors="pt").to(model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    clock = _Clock()
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad, streamer=clock, **sampling)
    total = time.perf_counter() - start
    n_prompt = enc["input_ids"].shape[1]
    new = out[0, n_prompt:]
    first = clock.times[1] - start if len(clock.times) > 1 else total
    return GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=n_prompt,
        new_tokens=int(new.numel()),
        total_s=total,
        first_token_s=first,
    )
