from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from oal.evaluation import (
    MultipleChoiceItem,
    hellaswag_preprocess,
    load_task,
    parse_arc,
    parse_hellaswag_text,
    parse_piqa,
)
from oal.evaluation import tasks as tasks_module
from oal.evaluation.tasks import hellaswag_item

# ---- the real files --------------------------------------------------------------------------------------------


def test_piqa_real_file(data_dir):
    data = load_task("piqa", data_dir=data_dir, source="local")
    assert data.n_original == len(data.items) == 1838
    assert Counter(i.gold for i in data.items) == {0: 910, 1: 928}
    first = data.items[0]
    assert first.context == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert first.choices[0].startswith("Provide the guinea pig with a cage full") and first.gold == 0
    assert data.source.startswith("local:") and "valid-labels.lst" in data.source


def test_hellaswag_real_file(data_dir):
    data = load_task("hellaswag", data_dir=data_dir, source="local")
    assert data.n_original == len(data.items) == 10042
    assert all(len(i.choices) == 4 for i in data.items)
    first = data.items[0]
    assert first.context == "Roof shingle removal: A man is sitting on a roof. he"  # ctx_b not capitalised here
    assert first.gold == 3 and first.choices[3] == "starts pulling up roofing on a roof."
    assert not any(re.search(r"\[.*?\]", c) for i in data.items for c in (i.context, *i.choices))


def test_arc_easy_real_file_and_label_mapping(data_dir):
    data = load_task("arc_easy", data_dir=data_dir, source="local")
    assert data.n_original == len(data.items) == 2376
    assert Counter(len(i.choices) for i in data.items) == {4: 2365, 3: 7, 5: 4}
    rows = {r["id"]: r for r in map(json.loads, (data_dir / "arc-easy/ARC-Easy-Test.jsonl").open())}
    numeric = [i for i in data.items if rows[i.id]["question"]["choices"][0]["label"] == "1"]
    assert numeric, "the test file mixes numeric labels in"
    for item in data.items:
        row = rows[item.id]
        labels = [c["label"] for c in row["question"]["choices"]]
        assert item.gold == labels.index(row["answerKey"])
        assert item.choices[item.gold] == row["question"]["choices"][item.gold]["text"]
        assert item.context == f"Question: {row['question']['stem']}\nAnswer:"


def test_limit_keeps_the_first_items(data_dir):
    full = load_task("piqa", data_dir=data_dir)
    part = load_task("piqa", data_dir=data_dir, limit=7)
    assert part.items == full.items[:7] and part.n_original == 1838
    assert len(load_task("arc_easy", data_dir=data_dir, limit=10**6).items) == 2376


@pytest.mark.parametrize("limit", [0, -3, True, 2.5])
def test_bad_limit(data_dir, limit):
    with pytest.raises(ValueError, match="limit"):
        load_task("piqa", data_dir=data_dir, limit=limit)


# ---- synthetic files and bad input -----------------------------------------------------------------------------


def _arc_row(id, labels, answer):
    choices = [{"text": f"option {label}", "label": label} for label in labels]
    return json.dumps({"id": id, "question": {"stem": f"q {id}?", "choices": choices}, "answerKey": answer})


def test_parse_arc_numeric_and_odd_choice_counts(tmp_path):
    path = tmp_path / "arc.jsonl"
    path.write_text("\n".join([_arc_row("a", "ABC", "C"), _arc_row("b", "1234", "2"), _arc_row("c", "ABCDE", "E")]))
    items = parse_arc(path)
    assert [i.gold for i in items] == [2, 1, 4]
    assert [len(i.choices) for i in items] == [3, 4, 5]
    assert items[1].choices[1] == "option 2" and items[0].context == "Question: q a?\nAnswer:"
    path.write_text(_arc_row("d", "ABCD", "5"))
    with pytest.raises(ValueError, match="answerKey"):
        parse_arc(path)


def test_parse_piqa_mismatch_and_bad_label(tmp_path):
    q, labels = tmp_path / "valid.jsonl", tmp_path / "valid-labels.lst"
    q.write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n")
    labels.write_text("1\n0\n")
    with pytest.raises(ValueError, match="1 questions but .* 2 labels"):
        parse_piqa(q, labels)
    labels.write_text("2\n")
    with pytest.raises(ValueError, match="label 0 or 1"):
        parse_piqa(q, labels)
    labels.write_text("1\n")
    assert parse_piqa(q, labels) == [MultipleChoiceItem("Question: g\nAnswer:", ("a", "b"), 1, "0")]


def test_parse_hellaswag_text_layout(tmp_path):
    path = tmp_path / "hs.txt"
    path.write_text("Act: ctx [title] more\n2\ne0\ne1 [step]\ne2\ne3\n")
    (item,) = parse_hellaswag_text(path)
    # as in lm-eval, text is stripped before the brackets go, so "e1 [step]" keeps its space
    assert item == MultipleChoiceItem("Act: ctx. more", ("e0", "e1 ", "e2", "e3"), 2, "0")
    path.write_text("Act: ctx\n2\ne0\ne1\ne2\n")
    with pytest.raises(ValueError, match="multiple of 6"):
        parse_hellaswag_text(path)
    path.write_text("Act: ctx\n4\ne0\ne1\ne2\ne3\n")
    with pytest.raises(ValueError, match="gold label 0-3"):
        parse_hellaswag_text(path)


def test_hellaswag_hub_row_processing():
    assert hellaswag_preprocess(" A [header] man [title] Step one") == "A man. Step one"
    item = hellaswag_item("Roof shingle removal", "A man is sitting on a roof.", "he", ["is [step] up."] * 4, "3")
    assert item.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert item.choices[0] == "is up." and item.gold == 3


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "piqa" / "valid.jsonl")):
        load_task("piqa", data_dir=tmp_path, source="local")
    with pytest.raises(FileNotFoundError, match="no such data folder"):
        load_task("piqa", data_dir=tmp_path / "nope")


def test_auto_falls_back_to_the_hub_and_reports_both(tmp_path, monkeypatch, caplog):
    def offline(*args):
        raise RuntimeError("could not load lighteval/piqa [validation] from the Hub: offline")

    monkeypatch.setattr(tasks_module, "_load_hf", offline)
    with pytest.raises(FileNotFoundError, match=r"valid.jsonl.*Hub fallback failed.*offline"):
        load_task("piqa", data_dir=tmp_path)
    monkeypatch.setattr(tasks_module, "_load_hf", lambda *a: [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}] * 3)
    data = load_task("piqa", data_dir=tmp_path, limit=2)
    assert data.source == "hf:lighteval/piqa[validation]" and len(data.items) == 2 and data.n_original == 3
    assert "holds 3 examples, not the 1838" in caplog.text


def test_bad_task_and_source(data_dir):
    with pytest.raises(ValueError, match="name"):
        load_task("winogrande", data_dir=data_dir)
    with pytest.raises(ValueError, match="source"):
        load_task("piqa", data_dir=data_dir, source="web")
    with pytest.raises(ValueError, match="gold"):
        MultipleChoiceItem("c", ("a", "b"), 2)
