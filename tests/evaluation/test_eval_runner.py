from __future__ import annotations

import json
import math

import pytest
import typer
from typer.testing import CliRunner

from oal.cli import app
from oal.data import blocks as wikitext_blocks
from oal.evaluation import accuracy_metrics, evaluate, load_task, perplexity, score_items
from oal.evaluation.utils import mean_stderr, write_json_atomic


@pytest.fixture
def tiny_data(tmp_path):
    """The shared data layout with a few items per task."""
    root = tmp_path / "data"
    (root / "piqa").mkdir(parents=True)
    goals = ["How do I boil water?", "How do I dry a cat?", "Open a jar", "Cool soup"]
    rows = [{"goal": g, "sol1": f"use a pot {i}", "sol2": "use the mat"} for i, g in enumerate(goals)]
    (root / "piqa/valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "piqa/valid-labels.lst").write_text("0\n1\n1\n0\n")
    (root / "hellaswag").mkdir()
    (root / "hellaswag/hellaswag_val_full.txt").write_text(
        "Roofing: A man is on a roof. he\n3\nsits.\nis ripping tiles off.\nholds a cube.\nstarts pulling up roofing.\n"
        "Cats: The cat sat on the mat. it\n0\nsleeps.\nflies.\nswims away.\nreads 42 books.\n"
    )
    (root / "arc-easy").mkdir()
    arc = [
        {
            "id": "x1",
            "question": {
                "stem": "Which gas do plants take in?",
                "choices": [
                    {"text": "carbon dioxide", "label": "1"},
                    {"text": "neon", "label": "2"},
                    {"text": "tin", "label": "3"},
                ],
            },
            "answerKey": "1",
        },
        {
            "id": "x2",
            "question": {
                "stem": "What is 42?",
                "choices": [
                    {"text": t, "label": k}
                    for t, k in zip(["a number", "a cat", "a mat", "a roof", "water"], "ABCDE", strict=True)
                ],
            },
            "answerKey": "A",
        },
    ]
    (root / "arc-easy/ARC-Easy-Test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    (root / "wikitext-2-raw").mkdir()
    lines = [" \n", " = Robert Boulter = \n", " \n"] + [
        f" Robert Boulter is an English actor number {i} . \n" for i in range(6)
    ]
    (root / "wikitext-2-raw/wiki.test.raw").write_text("".join(lines))
    return root


def test_evaluate_output_shape_and_values(model, tokenizer, tiny_data):
    out = evaluate(
        model,
        tokenizer,
        ["wikitext", "piqa", "hellaswag", "arc_easy"],
        limit=3,
        block_len=16,
        max_blocks=2,
        data_dir=tiny_data,
        batch_size=3,
        progress=False,
        model_name="tiny",
    )
    assert set(out) == {"results", "config", "n-samples"}
    assert out["n-samples"]["piqa"] == {"original": 4, "effective": 3}
    assert out["n-samples"]["arc_easy"] == {"original": 2, "effective": 2}
    assert out["config"]["headline"] == {
        "wikitext": "perplexity,none",
        "piqa": "acc_norm,none",
        "hellaswag": "acc_norm,none",
        "arc_easy": "acc_norm,none",
    }
    assert out["config"]["limit"] == 3 and out["config"]["data_source"]["piqa"].startswith("local:")
    for task, norm in (("piqa", "tokens"), ("hellaswag", "tokens"), ("arc_easy", "chars")):
        res = out["results"][task]
        assert res["alias"] == task
        data = load_task(task, data_dir=tiny_data, limit=3)
        expected = accuracy_metrics(score_items(model, tokenizer, data.items, progress=False), norm)
        for key, value in expected.items():
            assert res[f"{key},none"] == pytest.approx(value)
        assert res["acc_norm,none"] == res[f"acc_norm_{norm},none"]
    blocks = wikitext_blocks(tokenizer, "test", 16, data_dir=tiny_data, cache=False).ids
    ppl = perplexity(model, blocks[:2], progress=False)
    wt = out["results"]["wikitext"]
    assert wt["perplexity,none"] == pytest.approx(ppl["ppl"]) and wt["n_tokens"] == 2 * 15
    assert out["n-samples"]["wikitext"] == {"original": blocks.shape[0], "effective": 2}


def test_evaluate_bad_input(model, tokenizer, tiny_data):
    with pytest.raises(ValueError, match="tasks"):
        evaluate(model, tokenizer, ["piqa", "mmlu"], data_dir=tiny_data)
    with pytest.raises(ValueError, match="limit"):
        evaluate(model, tokenizer, ["piqa"], limit=0, data_dir=tiny_data)
    with pytest.raises(ValueError, match="block_len"):
        evaluate(model, tokenizer, ["wikitext"], block_len=1, data_dir=tiny_data)


def test_mean_stderr_is_lm_evals():
    values = [1.0, 0.0, 1.0, 1.0]
    mu = 0.75
    assert mean_stderr(values) == pytest.approx(math.sqrt(mu * (1 - mu) / 3))
    assert math.isnan(mean_stderr([1.0]))


def test_write_json_atomic(tmp_path):
    path = write_json_atomic(tmp_path / "sub" / "r.json", {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def _cli() -> typer.Typer:
    return app


def test_cli_eval_writes_results(model, tokenizer, tiny_data, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "res" / "results.json"
    args = [
        "eval",
        "--model",
        str(model_dir),
        "--tasks",
        "piqa,wikitext",
        "--data",
        str(tiny_data),
        "--limit",
        "2",
        "--block-len",
        "16",
        "--max-blocks",
        "1",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--no-progress",
    ]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == {"piqa", "wikitext"}
    assert saved["n-samples"]["piqa"]["effective"] == 2 and saved["config"]["model"] == str(model_dir)
    assert saved["config"]["model_dtype"] == "torch.float32"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "0"], "limit"),
        (["--tasks", "piqa,mmlu"], "tasks"),
        (["--dtype", "int8"], "dtype"),
        (["--block-len", "1"], "block_len"),
        (["--tasks", "passkey", "--lengths", "8"], "lengths"),
        (["--tasks", "passkey", "--lengths", "1k"], "integers"),
        (["--tasks", "passkey", "--trials", "0"], "trials"),
        (["--text", "no/such/file.txt"], "no such file"),
    ],
)
def test_cli_rejects_bad_options_before_loading(args, message, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("oal.evaluation.cli.load_model_and_tokenizer", fail)
    result = CliRunner().invoke(_cli(), ["eval", *args])
    assert result.exit_code != 0 and message in result.output


def test_cli_eval_retrieval_and_text(model, tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    text = tmp_path / "notes.txt"
    text.write_text("the cat sat on the mat; the dog ate 42 bones. " * 20)
    out = tmp_path / "res.json"
    args = ["eval", "--model", str(model_dir), "--tasks", "passkey", "--lengths", "220,240", "--trials", "2"]
    args += ["--text", str(text), "--block-len", "16", "--max-blocks", "2", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(_cli(), [*args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == {"passkey", "text:notes"}
    assert saved["config"]["retrieval"] == {"lengths": [220, 240], "trials": 2, "n_keys": 4, "seed": 0}
    assert {"acc@220,none", "acc@240,none", "cache_mib@240,none"} <= set(saved["results"]["passkey"])
    assert len(saved["samples"]["passkey"]) == 4 and saved["results"]["text:notes"]["n_blocks"] == 2
