"""A tiny Llama saved as a local model directory (byte tokenizer), a small data folder in the shared data's layout
(WikiText-2 valid/test text, a few PIQA / HellaSwag / ARC-Easy items) and a micro preset, so the whole
``oal reproduce`` pipeline runs offline in well under a minute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import byte_tokenizer, tiny_causal_lm, word_text

from oal.reproduce import Reproduction, preset

#: Overrides of the demo preset: every stage on the smallest sizes the tiny model and data allow; layers 1-2 of
#: 4 are converted.
MICRO = {
    "layers": "1-2",
    "analyze_prompts": 8,
    "analyze_prompt_len": 16,
    "analyze_long_len": 64,
    "analyze_layer": 1,
    "group_n_boot": 50,
    "calib_seq_len": 64,
    "calib_train_blocks": (2, 3),
    "calib_val_blocks": (4,),
    "calib_max_updates": 4,
    "calib_patience": 4,
    "calib_val_every": 2,
    "calib_train_pool": 32,
    "calib_val_positions": 16,
    "calib_global_inits": ("taylor",),
    "calib_oal_inits": ("global",),
    "n_sink": 1,
    "window": 8,
    "fidelity_layers": (1, 2),
    "fidelity_blocks": (0, 1),
    "fidelity_seq_len": 64,
    "finetune_updates": 2,
    "finetune_block_len": 32,
    "finetune_val_every": 1,
    "finetune_val_blocks": 2,
    "eval_block_len": 64,
    "eval_max_blocks": 2,
    "eval_limit": None,
}


def tiny_llama() -> torch.nn.Module:
    """4 layers, GQA 6:2; qk_gain 4: larger attention logits, so the kernels differ visibly from softmax."""
    return tiny_causal_lm(
        vocab_size=256,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        layers=4,
        max_position_embeddings=512,
        qk_gain=4.0,
        seed=0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def write_data(root: Path) -> Path:
    """The shared data folder's layout with small contents."""
    (root / "wikitext-2-raw").mkdir(parents=True)
    (root / "wikitext-2-raw" / "wiki.valid.raw").write_text(word_text(1, 4000))
    (root / "wikitext-2-raw" / "wiki.test.raw").write_text(word_text(2, 3000))
    (root / "piqa").mkdir()
    piqa = [("boil water", "heat it in a pot", "freeze it"), ("dry hands", "use a towel", "use a river")]
    piqa += [("open a door", "push the stone", "turn the handle")]
    (root / "piqa" / "valid.jsonl").write_text(
        "".join(json.dumps({"goal": g, "sol1": a, "sol2": b}) + "\n" for g, a, b in piqa)
    )
    (root / "piqa" / "valid-labels.lst").write_text("0\n0\n1\n")
    (root / "hellaswag").mkdir()
    items = [
        ["Music: a man plays the drums", "1", "and sleeps.", "and the music goes on.", "of stone.", "north beta."],
        ["River: the water flows", "0", "to the sea.", "up the hill.", "into the alpha.", "as a gamma."],
    ]
    (root / "hellaswag" / "hellaswag_val_full.txt").write_text("".join(line + "\n" for it in items for line in it))
    (root / "arc-easy").mkdir()
    arc = [
        ("Which is a liquid?", ["stone", "water", "iron", "wood"], "B"),
        ("What flows to the sea?", ["a river", "a hill", "a star"], "A"),
    ]
    (root / "arc-easy" / "ARC-Easy-Test.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "question": {"stem": q, "choices": [{"text": t, "label": "ABCD"[j]} for j, t in enumerate(c)]},
                    "answerKey": k,
                }
            )
            + "\n"
            for i, (q, c, k) in enumerate(arc)
        )
    )
    return root


def micro_args() -> list[str]:
    """MICRO as ``oal reproduce`` options."""
    args = []
    for name, value in MICRO.items():
        text = "none" if value is None else ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        args += ["--" + name.replace("_", "-"), text]
    return args


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory):
    """``{"root", "model", "data", "cache_dir", "micro", "micro_args"}``: the tiny model directory, the data folder
    and the micro preset's overrides of the demo preset (as a dict and as command-line options), session-wide."""
    root = tmp_path_factory.mktemp("reproduce")
    model_dir = root / "tiny-llama"
    tiny_llama().save_pretrained(model_dir)
    byte_tokenizer(pad=True).save_pretrained(model_dir)
    return {
        "root": root,
        "model": model_dir,
        "data": write_data(root / "data"),
        "cache_dir": root / "oal-cache",
        "micro": dict(MICRO),
        "micro_args": micro_args(),
    }


@pytest.fixture(scope="session")
def reference(tiny_setup, tmp_path_factory):
    """One uninterrupted run of the micro preset with all seven methods: (its directory, reproduce.json)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OAL_CACHE_DIR", str(tiny_setup["cache_dir"]))
            data = Reproduction(
                preset("demo", **tiny_setup["micro"]),
                model=str(tiny_setup["model"]),
                out=out,
                data_dir=tiny_setup["data"],
                cache=tiny_setup["root"] / "qkv",
                progress=False,
            ).run()
    finally:
        torch.set_num_threads(threads)
    return out, data


@pytest.fixture(autouse=True)
def _private_cache_one_thread(tiny_setup, monkeypatch):
    """Token ids cached under the session's folder; one torch thread (fast for tiny models, fixed for exact
    comparisons)."""
    monkeypatch.setenv("OAL_CACHE_DIR", str(tiny_setup["cache_dir"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
