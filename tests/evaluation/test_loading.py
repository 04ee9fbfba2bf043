from __future__ import annotations

import pytest
import torch

from oal.evaluation import load_model_and_tokenizer, load_task


def test_loads_a_model_directory(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    net, tok = load_model_and_tokenizer(tmp_path, dtype="float32", device="cpu")
    ids = torch.tensor([tokenizer("the cat sat", add_special_tokens=False)["input_ids"]])
    assert not net.training and tok("the cat sat", add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(net(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer("x", dtype="int8")
    with pytest.raises(ValueError, match="name_or_path"):
        load_model_and_tokenizer("")


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_tokenizer_context_is_a_prefix(data_dir):
    """On SmolLM2's tokenizer the lm-eval split is exact: encode(context) is a prefix of encode(context + option)."""
    from oal.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    for task in ("piqa", "hellaswag", "arc_easy"):
        for item in load_task(task, data_dir=data_dir, limit=300).items:
            ctx = tok(item.context, add_special_tokens=False)["input_ids"]
            for choice in item.choices:
                whole = tok(item.context + " " + choice, add_special_tokens=False)["input_ids"]
                assert whole[: len(ctx)] == ctx, (task, item.id, choice)
