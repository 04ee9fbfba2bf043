import numpy as np
import pytest
import torch
from tokenizers.processors import TemplateProcessing

import oal.data.tokens as tokens_module
from oal.cache import user_cache_dir
from oal.data import blocks, short_prompts, split_blocks, tokenize

WIKI = (
    " \n = Alpha = \n \n The first paragraph is long enough to be a prompt here .\n \n = = Part = = \n"
    " Short .\n The second paragraph is also long enough for one .\n \n = Beta = \n"
    " A third paragraph that easily passes the length bar .\n"
)


def test_split_blocks_drops_the_partial_block():
    ids = torch.arange(23)
    out = split_blocks(ids, 5)
    assert out.shape == (4, 5) and torch.equal(out.flatten(), ids[:20])
    assert split_blocks(ids, 5, max_blocks=2).shape == (2, 5)
    assert split_blocks(ids, 5, max_blocks=9).shape == (4, 5)
    assert split_blocks(ids, 23).shape == (1, 23)
    with pytest.raises(ValueError, match="block_len: the text has 23 tokens, fewer than one block of 24"):
        split_blocks(ids, 24)
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="block_len: expected a positive integer"):
            split_blocks(ids, bad)
    with pytest.raises(ValueError, match="max_blocks"):
        split_blocks(ids, 5, max_blocks=0)
    with pytest.raises(ValueError, match="ids: expected a 1-D"):
        split_blocks(ids.view(1, -1), 5)


def test_blocks_are_the_joined_text_tokenised(make_data_dir, byte_tokenizer):
    root = make_data_dir({"test": WIKI})
    out = blocks(byte_tokenizer, "test", 16, data_dir=root)
    joined = "\n\n".join(line if line.strip() else "" for line in WIKI.splitlines(keepends=True))
    n = len(joined.encode()) // 16  # one token per byte
    assert out.ids.shape == (n, 16) and out.ids.dtype == torch.long
    assert byte_tokenizer.decode(out.ids.flatten().tolist()) == joined.encode()[: n * 16].decode()
    assert out.source.startswith("local:")
    assert blocks(byte_tokenizer, "test", 16, data_dir=root, max_blocks=3).ids.shape == (3, 16)
    with pytest.raises(ValueError, match="block_len"):
        blocks(byte_tokenizer, "test", 0, data_dir=root)


def test_no_special_tokens_are_added(byte_tokenizer):
    bos = len(byte_tokenizer)
    byte_tokenizer.add_special_tokens({"bos_token": "<s>"})
    byte_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert byte_tokenizer("ab").input_ids[0] == bos  # the tokenizer would add one by default
    assert tokenize(byte_tokenizer, "ab", cache=False).tolist() == byte_tokenizer("ab").input_ids[1:]


def test_token_cache(byte_tokenizer, monkeypatch):
    text = "some text to cache " * 10
    ids = tokenize(byte_tokenizer, text)
    files = list((user_cache_dir() / "tokens").glob("*.npy"))
    assert len(files) == 1 and np.load(files[0]).tolist() == ids.tolist()

    def fail(*a, **k):
        raise AssertionError("tokenised again")

    encode = tokens_module._encode
    monkeypatch.setattr(tokens_module, "_encode", fail)
    assert torch.equal(tokenize(byte_tokenizer, text), ids)
    monkeypatch.setattr(tokens_module, "_encode", encode)
    # Another tokenizer or text gets its own entry; a corrupt entry is rebuilt; cache=False writes nothing.
    byte_tokenizer.backend_tokenizer.pre_tokenizer.add_prefix_space = True
    assert tokenize(byte_tokenizer, text).numel() == ids.numel() + 1
    assert len(list((user_cache_dir() / "tokens").glob("*.npy"))) == 2
    files[0].write_bytes(b"garbage")
    byte_tokenizer.backend_tokenizer.pre_tokenizer.add_prefix_space = False
    assert torch.equal(tokenize(byte_tokenizer, text), ids)
    tokenize(byte_tokenizer, "uncached text", cache=False)
    assert len(list((user_cache_dir() / "tokens").iterdir())) == 2
    with pytest.raises(ValueError, match="text: expected a non-empty string"):
        tokenize(byte_tokenizer, "")


def test_short_prompts(make_data_dir, byte_tokenizer):
    root = make_data_dir({"valid": WIKI})
    out = short_prompts(byte_tokenizer, n=2, length=20, data_dir=root)
    assert out.ids.shape == (2, 20) and out.source.endswith("wiki.valid.raw")
    texts = [byte_tokenizer.decode(row.tolist()) for row in out.ids]
    # Of the three long paragraphs, evenly spaced picks are the 1st and 2nd (indices 0 and 3 // 2).
    assert texts == ["The first paragraph ", "The second paragraph"]
    three = short_prompts(byte_tokenizer, n=3, length=20, data_dir=root)
    assert [byte_tokenizer.decode(r.tolist()) for r in three.ids][2] == "A third paragraph th"
    assert torch.equal(short_prompts(byte_tokenizer, n=3, length=20, data_dir=root).ids, three.ids)
    with pytest.raises(ValueError, match="n: .* has 3 paragraphs of at least length=20 tokens, fewer than n=4"):
        short_prompts(byte_tokenizer, n=4, length=20, data_dir=root)
    with pytest.raises(ValueError, match="length: expected a positive integer"):
        short_prompts(byte_tokenizer, n=2, length=0, data_dir=root)


def test_pydoc_blocks_and_prompts(byte_tokenizer):
    out = blocks(byte_tokenizer, "valid", 512, source="pydoc", max_blocks=4)
    assert out.ids.shape == (4, 512) and out.source == "pydoc:pydoc_data.topics/valid"
    prompts = short_prompts(byte_tokenizer, n=5, length=32, split="test", source="pydoc")
    assert prompts.ids.shape == (5, 32)


def test_shared_data_prompts(data_dir, byte_tokenizer):
    prompts = short_prompts(byte_tokenizer, data_dir=data_dir)
    assert prompts.ids.shape == (40, 64) and prompts.source.endswith("wiki.valid.raw")
    assert len({tuple(r.tolist()) for r in prompts.ids}) == 40
    assert byte_tokenizer.decode(prompts.ids[0].tolist()).startswith("Homarus gammarus , known as the European")


@pytest.mark.model
def test_smollm2_test_split(data_dir, smollm2_tokenizer):
    out = blocks(smollm2_tokenizer, "test", 4096, data_dir=data_dir)
    assert out.ids.shape == (74, 4096)  # 304,986 tokens
    assert smollm2_tokenizer.decode(out.ids[0, :8].tolist()).startswith("\n\n = Robert Boulter =")
    assert len(list((user_cache_dir() / "tokens").glob("*.npy"))) == 1
    assert torch.equal(blocks(smollm2_tokenizer, "test", 4096, data_dir=data_dir, max_blocks=3).ids, out.ids[:3])
