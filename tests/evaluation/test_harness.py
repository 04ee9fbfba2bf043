"""lm-eval integration; skipped when lm-eval is not installed (it is an optional dependency)."""

from __future__ import annotations

import json
import textwrap

import pytest

from oal.evaluation import MultipleChoiceItem, accuracy_metrics, loglikelihoods, score_items

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from oal.evaluation.harness import OALLM  # noqa: E402


@pytest.fixture
def oal_lm(model, tokenizer):
    calls = []

    def loader(name, *, dtype, device):
        calls.append((name, dtype, device))
        return model, tokenizer

    lm = OALLM(pretrained="my-converted-model", dtype="bfloat16", device="cpu", batch_size=2, loader=loader)
    assert calls == [("my-converted-model", "bfloat16", "cpu")]
    return lm


def test_registered_without_hiding_lm_evals_models():
    assert get_model("oal") is OALLM
    assert get_model("hf").__name__ == "HFLM"


def test_loglikelihood_matches_ours(oal_lm, model, tokenizer):
    requests = [
        ("Question: How do I boil water?\nAnswer:", " Put it in a pot."),
        ("Question: How do I boil water?\nAnswer:", " 42"),
        ("the dog ", "sat on a mat"),
    ]
    instances = [Instance("loglikelihood", {}, req, i) for i, req in enumerate(requests)]
    theirs = oal_lm.loglikelihood(instances, disable_tqdm=True)
    ours = loglikelihoods(model, tokenizer, requests, progress=False)
    for (lp, greedy), mine in zip(theirs, ours, strict=True):
        assert lp == pytest.approx(mine.logprob, rel=1e-5, abs=1e-5) and greedy == mine.is_greedy
    assert oal_lm.add_bos_token is False
    assert oal_lm.get_model_info()["model_name"] == "my-converted-model"


@pytest.mark.slow
def test_simple_evaluate_on_a_local_task(oal_lm, model, tokenizer, tmp_path):
    """An lm-eval run end to end, offline: a custom multiple-choice task over a local jsonl."""
    from lm_eval.tasks import TaskManager

    rows = [
        {"question": "How do I boil water?", "choices": ["Put it in a pot.", "Use the mat."], "label": 0},
        {"question": "Which gas do plants take in?", "choices": ["neon", "carbon dioxide", "tin"], "label": 1},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "toy.yaml").write_text(
        textwrap.dedent(f"""\
            task: oal_toy
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {tmp_path / "data.jsonl"}
            test_split: test
            output_type: multiple_choice
            doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
            doc_to_choice: "{{{{choices}}}}"
            doc_to_target: label
            metric_list:
              - metric: acc
              - metric: acc_norm
            """)
    )
    out = lm_eval.simple_evaluate(
        model=oal_lm, tasks=["oal_toy"], task_manager=TaskManager(include_path=str(tmp_path)), num_fewshot=0
    )
    res = out["results"]["oal_toy"]
    items = [MultipleChoiceItem(f"Question: {r['question']}\nAnswer:", tuple(r["choices"]), r["label"]) for r in rows]
    ours = accuracy_metrics(score_items(model, tokenizer, items, progress=False), "chars")
    assert res["acc,none"] == ours["acc"] and res["acc_norm,none"] == ours["acc_norm_chars"]
    assert res["acc_stderr,none"] == pytest.approx(ours["acc_stderr"])
    assert out["n-samples"]["oal_toy"] == {"original": 2, "effective": 2}
