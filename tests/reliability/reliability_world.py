"""Helpers of the reliability tests (a module of its own: ``conftest`` is not importable by name when several
test directories are collected). The tiny offline world: a random Llama and a GPT-2 (no RoPE: unsupported for
conversion) saved with a byte tokenizer, a small WikiText-like data directory, group files for the Llama and for
another geometry, a chi file, and broken inputs (empty, non-UTF-8, missing)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
from tiny import byte_tokenizer, tiny_causal_lm, word_text

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 6, 2, 8, 3
N = 64  # block length of the tiny runs
# few updates: the point is the machinery, not the fit
CALIBRATE_FAST = ["--max-updates", "12", "--patience", "6", "--train-pool", "32", "--val-positions", "16"]


def small_llama():
    """A random 2-layer Llama in memory (vocab 64, 4 query heads of 8 dims, 2 KV heads)."""
    return tiny_causal_lm(
        vocab_size=64, num_heads=4, num_kv_heads=2, head_dim=8, layers=2, hidden_size=32, intermediate_size=32,
        max_position_embeddings=64, seed=0,
    )  # fmt: skip


def _task_files(root: Path) -> None:
    """Two-item PIQA / HellaSwag / ARC-Easy files in the shared data folder's layout (`oal reproduce` wants them)."""
    import json

    (root / "piqa").mkdir(parents=True, exist_ok=True)
    pairs = [("boil water", "heat it in a pot", "freeze it"), ("dry hands", "use a towel", "use a river")]
    (root / "piqa" / "valid.jsonl").write_text(
        "".join(json.dumps({"goal": g, "sol1": a, "sol2": b}) + "\n" for g, a, b in pairs)
    )
    (root / "piqa" / "valid-labels.lst").write_text("0\n0\n")
    (root / "hellaswag").mkdir(exist_ok=True)
    items = [["Music: a man plays", "1", "and sleeps.", "and plays on.", "of stone.", "north beta."]] * 2
    (root / "hellaswag" / "hellaswag_val_full.txt").write_text("".join(x + "\n" for item in items for x in item))
    (root / "arc-easy").mkdir(exist_ok=True)
    question = {
        "stem": "Which is a liquid?",
        "choices": [{"text": t, "label": c} for t, c in zip(["stone", "water"], "AB", strict=True)],
    }
    (root / "arc-easy" / "ARC-Easy-Test.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "question": question, "answerKey": "B"}) + "\n" for i in range(2))
    )


def make_env(root: Path) -> dict[str, Path]:
    """Write the tiny world under ``root`` (see the module docstring) and return its paths."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from oal.grouping import group_heads

    root.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # one seeded stream: the GPT-2 draws after the Llama
        torch.manual_seed(0)
        # qk_gain 4: larger logits than the default init, so kernels differ visibly from softmax
        llama = tiny_causal_lm(
            vocab_size=256, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS,
            max_position_embeddings=512, qk_gain=4.0,
        )  # fmt: skip
        gpt2 = GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        )
    paths = {"root": root, "model": root / "tiny-llama", "gpt2": root / "tiny-gpt2", "data": root / "data"}
    for key, model in (("model", llama), ("gpt2", gpt2)):
        model.save_pretrained(paths[key])
        byte_tokenizer().save_pretrained(paths[key])
    (paths["data"] / "wikitext-2-raw").mkdir(parents=True)
    (paths["data"] / "wikitext-2-raw" / "wiki.valid.raw").write_text(word_text(1, 26 * N + 300))
    (paths["data"] / "wikitext-2-raw" / "wiki.test.raw").write_text(word_text(2, 20 * N + 300))
    _task_files(paths["data"])
    for name, content in (("empty_data", b""), ("binary_data", bytes(range(128, 256)) * 40)):
        paths[name] = root / name
        (paths[name] / "wikitext-2-raw").mkdir(parents=True)
        for split in ("valid", "test", "train"):
            (paths[name] / "wikitext-2-raw" / f"wiki.{split}.raw").write_bytes(content)
        _task_files(paths[name])
    gen = torch.Generator().manual_seed(3)
    for key, heads, dim in (("groups", HEADS, HEAD_DIM), ("groups_other", 4, 16)):
        chi = torch.rand(LAYERS, 12, heads, dim, generator=gen, dtype=torch.float64)
        chi[..., 0] *= 8  # a clear outlier dimension in every head
        paths[key] = root / f"{key}.json"
        group_heads(chi, model_id=key, alpha=0.5, gamma=0.5, n_boot=50).save(paths[key])
    from oal.analysis.pipeline import ContributionAnalysis
    from oal.io import write_json

    paths["chi"] = root / "analyze" / "chi.safetensors"
    P = 12
    ContributionAnalysis(
        list(range(LAYERS)),
        torch.rand(LAYERS, P, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
        torch.rand(LAYERS, P, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
        torch.rand(LAYERS, P, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
        [16] * P,
        "tiny",
    ).save(paths["chi"])
    write_json(paths["chi"].with_name("analysis.json"), {"provenance": {"data": "random"}})
    paths["empty_file"] = root / "empty.json"
    paths["empty_file"].write_bytes(b"")
    paths["binary_file"] = root / "binary.json"
    paths["binary_file"].write_bytes(bytes(range(128, 256)))
    paths["missing"] = root / "does-not-exist"
    return paths


def subprocess_env(world: dict[str, Path], **extra: str) -> dict[str, str]:
    """Environment of a child ``python -m oal …``: this checkout's sources, the world's token cache, one thread."""
    env = {k: v for k, v in os.environ.items() if k != "OAL_DATA_DIR"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]),
        OAL_CACHE_DIR=str(world["root"] / "oal-cache"),
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def without_times(obj):
    """A JSON-like value with every ``seconds`` / ``timings`` / ``time`` entry removed (they differ run to run)."""
    if isinstance(obj, dict):
        return {k: without_times(v) for k, v in obj.items() if k not in ("seconds", "timings", "time")}
    if isinstance(obj, list):
        return [without_times(v) for v in obj]
    return obj


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OAL = [sys.executable, "-m", "oal"]
