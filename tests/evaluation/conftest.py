"""Tiny byte-level BPE tokenizer and randomly initialised Llama model for the evaluation tests."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_causal_lm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "Question: How do I boil water?\nAnswer: Put it in a pot and heat it.",
    "Question: Which gas do plants take in?\nAnswer: carbon dioxide",
    "Roof shingle removal: A man is sitting on a roof. He starts pulling up roofing.",
    " = Robert Boulter = \n Robert Boulter is an English film and television actor.",
    "the cat sat on the mat; the dog ate 42 bones.",
]


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE like SmolLM2's (any text encodes), 300 tokens; adds no special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def make_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """2 layers, hidden 32, GQA 4:2 of head_dim 8; a large init range so the next-token distributions are far from
    uniform. Seeds torch's global generator (not a forked one)."""
    torch.manual_seed(seed)
    return tiny_causal_lm(
        vocab_size=vocab_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layers=2,
        hidden_size=32,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )


@pytest.fixture(scope="session")
def model(tokenizer) -> LlamaForCausalLM:
    return make_model(len(tokenizer))


@pytest.fixture(scope="session")
def model_factory():
    return make_model


def _prefix_logprob(model: LlamaForCausalLM, ids: list[int], j: int) -> float:
    """log p(ids[j] | ids[:j]) from a separate forward over the prefix, log-softmax written out in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:j]])).logits[0, -1].double().tolist()
    top = max(logits)
    log_z = top + torch.tensor([x - top for x in logits], dtype=torch.float64).exp().sum().log().item()
    return logits[ids[j]] - log_z


@pytest.fixture(scope="session")
def prefix_logprob():
    """Hand reference: one forward per scored token, so shifting/padding/batching are not shared with the code."""
    return _prefix_logprob
