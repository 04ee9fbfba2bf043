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


def test_batch_size_8_equals_batch_size_1_on_a_converted_model(model_factory, tokenizer, tmp_path):
    """`simple_evaluate(model="oal", model_args="pretrained=DIR", batch_size=8)` on a saved converted model (sinks,
    window and an exact head) equals batch_size=1: loglikelihoods (right padding, lm-eval passes no mask) and
    greedy generations (left padding with an attention mask)."""
    import torch
    from lm_eval.tasks import TaskManager

    from oal.conversion import convert_model, save_converted
    from oal.conversion.heads import add_exact_heads
    from oal.kernels import SinkWindowKernel
    from oal.models import attach_kernel, attached_kernels

    model = model_factory(len(tokenizer), seed=3)
    convert_model(model, "oal", layers="0-1", groups={i: torch.zeros(4, 8, dtype=torch.long) for i in range(2)})
    for i, k in attached_kernels(model).items():
        attach_kernel(model, i, SinkWindowKernel(k, n_sink=2, window=3))
    add_exact_heads(model, {1: [0]})
    out = save_converted(model, tmp_path / "m", tokenizer=tokenizer)
    rows = [
        {"question": q, "choices": c, "label": lab}
        for q, c, lab in [
            ("How do I boil water?", ["Put it in a pot.", "Use the mat.", "42"], 0),
            ("Which gas do plants take in?", ["neon", "carbon dioxide", "tin"], 1),
            ("Who is Robert Boulter?", ["an English film actor", "a roof"], 0),
            ("What did the dog eat?", ["42 bones", "the mat", "a pot of water"], 0),
            ("What sat on the mat?", ["the cat", "carbon"], 0),
        ]
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"""\
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tmp_path / "data.jsonl"}
        test_split: test
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        """
    (tmp_path / "mc.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""\
            task: oal_toy_mc
            output_type: multiple_choice
            doc_to_choice: "{{choices}}"
            doc_to_target: label
            metric_list:
              - metric: acc
            """)
    )
    (tmp_path / "gen.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""\
            task: oal_toy_gen
            output_type: generate_until
            doc_to_target: "{{choices[label]}}"
            generation_kwargs:
              until: ["\\n"]
              max_gen_toks: 6
              do_sample: false
            metric_list:
              - metric: exact_match
            """)
    )
    tm = TaskManager(include_path=str(tmp_path))
    runs = {
        bs: lm_eval.simple_evaluate(
            model="oal",
            model_args=f"pretrained={out}",
            tasks=["oal_toy_mc", "oal_toy_gen"],
            task_manager=tm,
            num_fewshot=0,
            batch_size=bs,
            log_samples=True,
        )
        for bs in (1, 8)
    }

    def samples(run, task):
        return [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in run["samples"][task]]

    for task in ("oal_toy_mc", "oal_toy_gen"):
        one, eight = samples(runs[1], task), samples(runs[8], task)
        assert [x[:1] for x in one] == [x[:1] for x in eight]
        if task == "oal_toy_gen":
            assert one == eight  # the same greedy strings, row by row
        else:
            for (_, r1, _), (_, r8, _) in zip(one, eight, strict=True):
                for (lp1, g1), (lp8, g8) in ((a[0], b[0]) for a, b in zip(r1, r8, strict=True)):
                    assert lp1 == pytest.approx(lp8, rel=1e-5, abs=1e-5) and g1 == g8
        assert runs[1]["results"][task] == runs[8]["results"][task]
