"""Block perplexity (App. F.3): independent, non-overlapping token blocks, exp of the mean next-token NLL.

F.3: the text entries are joined in source order with two newlines, tokenised without BOS/EOS, cut into
non-overlapping blocks of ``block_len`` tokens (the incomplete final block is dropped), and each block is scored
as an independent sequence with ``block_len - 1`` next-token targets. PPL = exp(mean NLL over all targets).
"""

from __future__ import annotations

import math

import torch
from rich.progress import track
from transformers import PreTrainedModel

from ..data.tokens import split_blocks, tokenize
from .utils import model_device


def check_block_args(block_len: int, max_blocks: int | None = None) -> None:
    if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 2:
        raise ValueError(f"block_len: expected an int >= 2 (one context and one target token), got {block_len!r}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1):
        raise ValueError(f"max_blocks: expected None or an int >= 1, got {max_blocks!r}")


def text_blocks(tokenizer, text: str, block_len: int, *, what: str = "text") -> tuple[torch.Tensor, int]:
    """Any text as F.3 blocks: tokenised as one stream without BOS/EOS and cut into non-overlapping
    ``(n, block_len)`` blocks (the incomplete last one dropped); returns the blocks and n."""
    if not text.strip():
        raise ValueError(f"{what}: the text is empty")
    ids = tokenize(tokenizer, text, cache=False)
    try:
        out = split_blocks(ids, block_len)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return out, out.shape[0]


def block_nll(logits: torch.Tensor, ids: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Summed next-token NLL per block, float64 ``(B,)``.

    logits ``(B, L, V)`` (any float dtype), ids ``(B, L)``: position t predicts ids[:, t + 1]. The fp32
    log-softmax is taken ``chunk_size`` positions at a time, so no second full-size fp32 copy of the logits exists
    (a 4096 x 49152 block is 800 MB in fp32).
    """
    if logits.ndim != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"logits/ids: expected (B, L, V) and (B, L), got {tuple(logits.shape)} and {tuple(ids.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    total = torch.zeros(ids.shape[0], dtype=torch.float64, device=logits.device)
    n_targets = ids.shape[1] - 1
    for start in range(0, n_targets, chunk_size):
        stop = min(start + chunk_size, n_targets)
        logp = logits[:, start:stop].float().log_softmax(-1)
        target = ids[:, start + 1 : stop + 1].unsqueeze(-1)
        total -= logp.gather(-1, target).squeeze(-1).double().sum(-1)
    return total


@torch.inference_mode()
def perplexity(
    model: PreTrainedModel,
    blocks: torch.Tensor,
    *,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    chunk_size: int = 1024,
    progress: bool = True,
) -> dict:
    """Perplexity of ``model`` over independent token blocks ``(n, L)`` (F.3).

    Each block is one sequence (no BOS/EOS added, no state carried across blocks), contributing L - 1 targets.
    ``batch_size`` blocks go through one forward; ``device`` defaults to the model's. Returns
    ``{"ppl", "nll_mean", "n_tokens", "n_blocks"}`` where ``n_tokens`` counts the scored targets.
    """
    if not isinstance(blocks, torch.Tensor) or blocks.ndim != 2 or blocks.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"blocks: expected an integer tensor (n, L), got {_describe(blocks)}")
    n, length = blocks.shape
    if n < 1 or length < 2:
        raise ValueError(f"blocks: expected n >= 1 blocks of L >= 2 tokens, got shape {tuple(blocks.shape)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    device = torch.device(device) if device is not None else model_device(model)
    total = 0.0
    starts = range(0, n, batch_size)
    for start in track(starts, description="perplexity", disable=not progress, total=len(starts)):
        ids = blocks[start : start + batch_size].to(device=device, dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits
        total += block_nll(logits, ids, chunk_size=chunk_size).sum().item()
        del logits
    n_tokens = n * (length - 1)
    nll_mean = total / n_tokens
    return {"ppl": math.exp(nll_mean), "nll_mean": nll_mean, "n_tokens": n_tokens, "n_blocks": n}


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
