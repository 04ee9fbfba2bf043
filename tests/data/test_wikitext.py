import logging

import datasets
import pytest

from oal.data import SPLITS, load_text, read_wikitext_rows, wikitext_file
from oal.data import text as text_module

SAMPLE = " \n = Title = \n \n First paragraph , with @-@ tokens .\n\n = = Section = = \n Second one .\n"
# The Hub rows for SAMPLE (the builder keeps each line's "\n" and blanks whitespace-only lines).
SAMPLE_ROWS = [
    "",
    " = Title = \n",
    "",
    " First paragraph , with @-@ tokens .\n",
    "",
    " = = Section = = \n",
    " Second one .\n",
]


def test_rows_and_text_follow_the_hub_layout(make_data_dir):
    root = make_data_dir({"test": SAMPLE})
    assert read_wikitext_rows(wikitext_file(root, "test")) == SAMPLE_ROWS
    text = load_text("test", data_dir=root)
    assert text.entries == SAMPLE_ROWS
    assert text.text == "\n\n".join(SAMPLE_ROWS)
    assert text.source == f"local:{root}/wikitext-2-raw/wiki.test.raw"


def test_crlf_copy_gives_the_same_text(make_data_dir):
    lf = load_text("valid", data_dir=make_data_dir({"valid": SAMPLE}, "lf"))
    crlf = load_text("valid", data_dir=make_data_dir({"valid": SAMPLE.replace("\n", "\r\n")}, "crlf"))
    assert crlf.text == lf.text


def test_shared_wikitext_test_split(data_dir):
    text = load_text("test", data_dir=data_dir)
    raw = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    # Independent reconstruction of the 4,358 Hub rows from the file's "\n"-separated lines.
    lines = raw.split("\n")
    assert lines[-1] == ""
    rows = [line + "\n" if line.strip() else "" for line in lines[:-1]]
    assert len(rows) == 4358 == len(text.entries)
    assert text.entries[:2] == ["", " = Robert Boulter = \n"]
    assert text.text == "\n\n".join(rows)


def test_hub_rows_give_the_same_string_as_the_file(make_data_dir, monkeypatch):
    calls = []

    def fake_load_dataset(path, name, split):
        calls.append((path, name, split))
        return {"text": SAMPLE_ROWS}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(text_module, "_hub_reachable", lambda timeout=3.0: True)
    hub = load_text("valid")
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "validation")]
    assert hub.source == "hf:Salesforce/wikitext/wikitext-2-raw-v1/valid"
    assert hub.text == load_text("valid", data_dir=make_data_dir({"valid": SAMPLE})).text


def test_env_dir_and_fallbacks(make_data_dir, monkeypatch, caplog):
    root = make_data_dir({"test": SAMPLE})
    monkeypatch.setenv("OAL_DATA_DIR", str(root))
    assert load_text("test").source.startswith("local:")
    with caplog.at_level(logging.INFO, logger="oal.data.text"):
        train = load_text("train")  # not under $OAL_DATA_DIR, Hub unreachable: the offline stand-in
    assert train.source == "pydoc:pydoc_data.topics/train"
    assert "no 'train' split" in caplog.text and "not WikiText-2" in caplog.text
    with pytest.raises(FileNotFoundError, match="wiki.train.raw"):
        load_text("train", source="local")
    with pytest.raises(ConnectionError, match="not reachable"):
        load_text("test", source="hf")


def test_explicit_dir_never_falls_back(make_data_dir):
    root = make_data_dir({"test": SAMPLE})
    with pytest.raises(FileNotFoundError, match=r"data_dir: no WikiText-2 raw 'valid' split at .*wiki\.valid\.raw"):
        load_text("valid", data_dir=root)


def test_bad_files_and_arguments(make_data_dir, tmp_path):
    root = make_data_dir({"test": "", "valid": " \n\n \n", "train": b"caf\xe9\n"})
    with pytest.raises(ValueError, match=r"data_dir: .*wiki\.test\.raw is empty"):
        load_text("test", data_dir=root)
    with pytest.raises(ValueError, match=r"data_dir: .*wiki\.valid\.raw is empty"):
        load_text("valid", data_dir=root)
    with pytest.raises(ValueError, match=r"data_dir: .*wiki\.train\.raw is not valid UTF-8"):
        load_text("train", data_dir=root)
    with pytest.raises(ValueError, match="split: expected one of"):
        load_text("dev", data_dir=root)
    with pytest.raises(ValueError, match="source: expected one of"):
        load_text("test", source="web")
    with pytest.raises(ValueError, match="data_dir: only read with source 'auto' or 'local'"):
        load_text("test", data_dir=root, source="pydoc")
    with pytest.raises(ValueError, match="data_dir: source='local' needs"):
        load_text("test", source="local")


def test_pydoc_fallback_splits_are_disjoint_and_complete():
    from pydoc_data.topics import topics

    texts = {split: load_text(split, source="pydoc") for split in SPLITS}
    for split, text in texts.items():
        assert text.source == f"pydoc:pydoc_data.topics/{split}"
        assert text.text == "\n\n".join(text.entries)
    entries = [e for split in SPLITS for e in texts[split].entries]
    assert sorted(entries) == sorted(topics.values())
    assert texts["test"].entries[0] == topics[sorted(topics)[0]]
    assert texts["valid"].entries[0] == topics[sorted(topics)[1]]
    assert load_text("test", source="pydoc") == texts["test"]
