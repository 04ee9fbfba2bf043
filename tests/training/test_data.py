import pytest
import torch

from oal.training import FinetuneData, prepare_data, preset, training_order


def test_validation_blocks_are_the_last_and_disjoint():
    ids = torch.arange(7 * 5).view(7, 5)
    d = FinetuneData.from_blocks(ids, 3, source="arange")
    assert torch.equal(d.train, ids[:4]) and torch.equal(d.val, ids[4:])
    assert d.description["train_blocks"] == [0, 4] and d.description["val_blocks"] == [4, 7]
    assert "first 4 blocks of the valid split" in d.description["note"]
    assert "last 3 blocks" in d.description["note"]
    with pytest.raises(ValueError, match="val_blocks"):
        FinetuneData.from_blocks(ids, 7, source="arange")
    with pytest.raises(ValueError, match="ids"):
        FinetuneData.from_blocks(ids.float(), 2, source="arange")


def test_order_is_a_sequence_of_permutations():
    order = training_order(5, 13, seed=42)
    assert order.shape == (13, 1)
    flat = order.flatten().tolist()
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    assert set(flat[10:]) <= set(range(5)) and len(set(flat[10:])) == 3
    # a function of (num_blocks, updates, seed) only, and a prefix of longer runs
    assert torch.equal(order, training_order(5, 13, seed=42))
    assert torch.equal(order, training_order(5, 20, seed=42)[:13])
    assert not torch.equal(order, training_order(5, 13, seed=43))


def test_order_data_parallel():
    order = training_order(8, 6, seed=42, num_processes=2)
    assert order.shape == (6, 2)
    assert (order[:, 0] != order[:, 1]).all()  # the processes of one update read distinct blocks
    # global order is the same stream as single-process training, read two at a time
    assert torch.equal(order.flatten(), training_order(8, 12, seed=42).flatten())
    with pytest.raises(ValueError, match="num_processes"):
        training_order(8, 6, seed=42, num_processes=0)


def test_prepare_data_on_wikitext(data_dir, byte_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path))
    tok = byte_tokenizer
    config = preset("smoke", block_len=4096, val_blocks=32)
    d = prepare_data(tok, config, data_dir=data_dir)
    n = d.description["blocks"]
    assert d.train.shape == (n - 32, 4096) and d.val.shape == (32, 4096)
    assert d.description["source"].startswith("local:") and d.description["source"].endswith("wiki.valid.raw")
