"""``reproduce.json`` and ``report.md`` of an ``oal reproduce`` run, assembled from the files its stages wrote.

``reproduce.json`` is ``{"methods": {method: {"ppl", "piqa", "hellaswag", "arc_easy"}}, "config": {...}}``: PPL is
``results.wikitext["perplexity,none"]`` of :func:`oal.evaluation.evaluate`, the accuracies are its
``acc_norm,none`` (F.3's length-normalised accuracy: per continuation token for PIQA and HellaSwag, per option
character for ARC-Easy) as fractions in [0, 1]. It holds no timings or dates, so a resumed run writes the same file
as an uninterrupted one; those are in ``report.md`` and the stage records.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..io import provenance, read_json, write_json, write_text

if TYPE_CHECKING:
    from .pipeline import Reproduction

#: reproduce.json key -> (evaluation task, metric key of :func:`oal.evaluation.evaluate`).
METRICS = {
    "ppl": ("wikitext", "perplexity,none"),
    "piqa": ("piqa", "acc_norm,none"),
    "hellaswag": ("hellaswag", "acc_norm,none"),
    "arc_easy": ("arc_easy", "acc_norm,none"),
}
METRIC_NOTES = {
    "ppl": "WikiText test perplexity: exp(mean next-token NLL) over independent blocks (F.3), lower is better",
    "piqa": "acc_norm,none: log-likelihood / continuation token count (F.3), fraction in [0, 1]",
    "hellaswag": "acc_norm,none: log-likelihood / continuation token count (F.3), fraction in [0, 1]",
    "arc_easy": "acc_norm,none: log-likelihood / option character count (F.3), fraction in [0, 1]",
}
LABELS_TASKS = {"piqa": "PIQA", "hellaswag": "HellaSwag", "arc_easy": "ARC-Easy"}
LABELS = {
    "softmax": "Softmax (LoRA)",
    "performer": "Performer",
    "spectraformer": "SpectraFormer",
    "dijiang": "DiJiang",
    "taylorshift": "TaylorShift",
    "global": "Learned global",
    "oal": "OAL",
}


def data_protocol(run: Reproduction) -> list[str]:
    """The data each stage reads, and where it departs from the paper (the train splits are absent offline)."""
    p = run.preset
    ft = p.finetune_config()
    return [
        "Adaptation text (F.2): the WikiText-2 raw **valid** split, because no train split (WikiText-2 or "
        "WikiText-103) exists offline (shared/data/SOURCES.md); the paper adapts on WikiText-103 train. Its last "
        f"{ft.val_blocks} blocks of {ft.block_len} tokens select the checkpoint, the earlier blocks are trained on.",
        f"Calibration (Eq. 20, App. B): valid-split blocks {_ranges(p.calib_train_blocks)} (fit) / "
        f"{_ranges(p.calib_val_blocks)} (validation) of N = {p.calib_seq_len} tokens; the paper uses train blocks "
        "16-23 / 24-25. Calibration and adaptation both read the valid split; nothing reads the test split but "
        "the evaluations.",
        f"Frozen-attention fidelity (Table 2): test-split blocks {_ranges(p.fidelity_blocks)} of N = "
        f"{p.fidelity_seq_len} tokens, layers {list(p.fidelity_layers)}, all query heads.",
        f"Perplexity (Table 3): WikiText-2 raw test split in blocks of {p.eval_block_len} tokens "
        f"({'all blocks' if p.eval_max_blocks is None else f'the first {p.eval_max_blocks}'}); the paper's "
        "WikiText-103 raw test split is, per SOURCES.md, very probably byte-identical to it (not verified).",
        f"Zero-shot tasks (F.3): {'all items' if p.eval_limit is None else f'the first {p.eval_limit} items'} of "
        "PIQA validation, HellaSwag validation and ARC-Easy test.",
    ]


def _ranges(idx) -> str:
    from ..fidelity.capture import format_indices

    return format_indices(list(idx))


def method_metrics(result: dict) -> dict[str, float]:
    """The four Table 3 numbers from one :func:`oal.evaluation.evaluate` result."""
    return {key: float(result["results"][task][metric]) for key, (task, metric) in METRICS.items()}


def reproduce_json(run: Reproduction) -> dict[str, Any]:
    """``{"methods": {...}, "config": {...}}`` (see the module docstring) from the evaluation files."""
    evals = {m: read_json(run.eval_path(m), what=f"evaluation of {m}") for m in run.preset.methods}
    first = evals[run.preset.methods[0]]
    n = first["n-samples"]
    return {
        "methods": {m: method_metrics(r) for m, r in evals.items()},
        "config": {
            **run.config(),
            "metrics": METRIC_NOTES,
            "evaluation": {
                "ppl_blocks": first["results"]["wikitext"]["n_blocks"],
                "ppl_block_len": run.preset.eval_block_len,
                "ppl_tokens": first["results"]["wikitext"]["n_tokens"],
                "items": {t: n[t]["effective"] for t in ("piqa", "hellaswag", "arc_easy")},
                "items_available": {t: n[t]["original"] for t in ("piqa", "hellaswag", "arc_easy")},
                "sources": first["config"]["data_source"],
                "protocol": first["config"]["protocol"],
            },
            "finetune": run.preset.finetune_config().protocol(),
            "calibration": run.preset.calibration_config().to_dict(),
            "data_protocol": data_protocol(run),
        },
    }


def _rel(path: str | os.PathLike, root: Path) -> str:
    return os.path.relpath(Path(path).resolve(), root.resolve())


def _in_run(run: Reproduction, stage: str, recorded: str | os.PathLike) -> Path:
    """A figure a stage recorded, found in that stage's folder of the run: the recorded path is relative to the
    directory the stage ran from, and the run directory may have moved since."""
    return run.out / stage / Path(recorded).name


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _table3(run: Reproduction, data: dict) -> list[str]:
    lines = [
        "| Method | PPL ↓ | PIQA ↑ | HellaSwag ↑ | ARC-E ↑ | best update | val PPL | kernel params | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, v in data["methods"].items():
        s = read_json(run.finetune_dir(m) / "summary.json", what=f"finetune summary of {m}")
        lines.append(
            f"| {LABELS.get(m, m)} | {v['ppl']:.2f} | {_pct(v['piqa'])} | {_pct(v['hellaswag'])} | "
            f"{_pct(v['arc_easy'])} | {s['best']['step']} | {s['best']['val_ppl']:.2f} | "
            f"{s['model']['trainable_parameters']['kernel']} | {s['train_seconds']:.0f} |"
        )
    return lines


def _table2(run: Reproduction) -> list[str]:
    from ..fidelity.evaluate import markdown_table

    path = run.out / "fidelity" / "fidelity.json"
    if not path.is_file():
        return ["No converted method in this run, hence no fidelity table."]
    fid = read_json(path, what="fidelity.json")
    cfg = fid["config"]
    rows = {LABELS.get(m, m): v for m, v in fid["methods"].items() if m != "softmax"}
    lines = [
        f"Layers {cfg['layers']}, all {cfg['num_heads']} query heads; {cfg['data']}. Metric: {cfg['metric']}.",
        "",
        markdown_table(rows),
        "",
    ]
    for name, fig in fid.get("figures", {}).items():
        lines.append(f"![{name}]({_rel(_in_run(run, 'fidelity', fig), run.out)})")
    return lines


def _figures(run: Reproduction) -> list[str]:
    lines = []
    analysis = run.out / "analyze" / "analysis.json"
    if analysis.is_file():
        for name, fig in read_json(analysis, what="analysis.json").get("figures", {}).items():
            link = _rel(_in_run(run, "analyze", fig), run.out)
            lines.append(f"- analysis, {name.replace('_', ' ')}: [{Path(fig).name}]({link})")
    for fig in sorted((run.out / "group").glob("*.png")):
        lines.append(f"- grouping: [{fig.name}]({_rel(fig, run.out)})")
    for fig in sorted((run.out / "fidelity").glob("*.png")):
        lines.append(f"- fidelity: [{fig.name}]({_rel(fig, run.out)})")
    return lines or ["(none)"]


def _timings(run: Reproduction) -> list[str]:
    records = run.records()
    lines = ["| stage | wall s | CPU s | finished (UTC) | load average (1 min) at end |", "|---|---:|---:|---|---:|"]
    for name, r in records.items():
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['finished_utc']} | {r['load_average_1_5_15'][0]} |"
        )
    total = sum(r["wall_s"] for r in records.values())
    lines += [
        f"| **total** | **{total:.1f}** | | | |",
        "",
        "Wall times are those of the run that finished each stage (a stage resumed after an interruption counts "
        "only its last segment; stages skipped on a rerun keep their first time). CPU time is this process's "
        "(all threads). The machine is shared, so wall times depend on its load.",
    ]
    return lines


def _fixed_note(run: Reproduction) -> str:
    if not run.fixed:
        return ""
    names = ", ".join(LABELS.get(m, m) for m in sorted(run.fixed))
    return (
        f"; {names}: no trainable kernel parameters (F.1), converted with the seeded fixed features, "
        "without a calibration stage"
    )


def report_markdown(run: Reproduction, data: dict) -> str:
    """The human-readable report: Table 3 and Table 2 analogues, figures, data protocol, timings, config."""
    p = run.preset
    invocations = read_json(run.out / "run.json", what="run.json")["invocations"]
    now = provenance()
    groups = read_json(run.out / "group" / "groups_summary.json", what="groups_summary.json")
    ev = data["config"]["evaluation"]
    ft = p.finetune_config()
    lines = [f"# OAL reproduction on {run.model}: Table 2 and Table 3 analogues", ""]
    if p.name == "demo":
        lines += [
            "> **Demo run.** Every stage ran, on budgets far below the paper's (short calibration, a few LoRA "
            "updates, a handful of evaluation items). The numbers only show that the pipeline works; they say "
            "nothing about the methods.",
            "",
        ]
    lines += [
        f"Preset **{p.name}**. Command: `{now['command']}`  ",
        f"Run started {invocations[0]['time_utc']} with `{invocations[0]['command']}`"
        + (f"; resumed {len(invocations) - 1} time(s)" if len(invocations) > 1 else "")
        + f"; report written {now['time_utc']}.  ",
        f"Machine: {now['machine']}; Python {now['python']}, torch {now['torch']}.  ",
        f"Model: {run.model} ({run.model_source}); converted layers {_ranges(run.layers)} "
        f"({len(run.layers)} layers, the same for every converted method); groups: "
        f"{groups['groups_per_head_histogram']} heads per group count (App. B, α={groups['params']['alpha']}, "
        f"γ={groups['params']['gamma']}).",
        "",
        "## Table 3 analogue: quality after LoRA adaptation",
        "",
        *_table3(run, data),
        "",
        f"PPL over {ev['ppl_blocks']} blocks of {ev['ppl_block_len']} tokens ({ev['ppl_tokens']} scored tokens). "
        "Accuracies in %, `acc_norm,none` (per-token normalisation for PIQA and HellaSwag, per-character for "
        "ARC-Easy, F.3) on "
        + ", ".join(f"{LABELS_TASKS[t]} {ev['items'][t]}/{ev['items_available'][t]}" for t in LABELS_TASKS)
        + " items. Sources: "
        + "; ".join(f"{t} `{src}`" for t, src in ev["sources"].items())
        + ".",
        "",
        f"Adaptation (F.2): LoRA r={ft.lora_rank}, α={ft.lora_alpha:g}, dropout {ft.lora_dropout} on "
        f"{', '.join(ft.lora_targets)} of every layer, kernel parameters trained jointly; AdamW lr {ft.lr:g}, "
        f"{ft.updates} updates × {ft.block_len} tokens, batch 1, warmup {ft.warmup_ratio:.0%} then cosine; "
        f"validation every {ft.val_every} updates on {ft.val_blocks} blocks, best checkpoint evaluated; seed "
        f"{ft.seed}. Softmax (LoRA) is the unconverted model with the same budget. Kernel parameters start from "
        "their calibration (stage 3); the learned global quadratic is OAL's G = 1 stage" + _fixed_note(run) + ".",
        "",
        "## Table 2 analogue: frozen-attention fidelity",
        "",
        *_table2(run),
        "",
        "## Figures",
        "",
        *_figures(run),
        "",
        "## Data protocol",
        "",
        *(f"- {line}" for line in data_protocol(run)),
        "",
        "## Wall time per stage",
        "",
        *_timings(run),
        "",
        "## Configuration",
        "",
        "| field | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in p.to_dict().items()),
        "",
        "Machine-readable results: [reproduce.json](reproduce.json); per-stage outputs in the stage directories.",
        "",
    ]
    return "\n".join(lines)


def write_report(run: Reproduction) -> dict[str, Any]:
    """Write ``reproduce.json`` then ``report.md`` into the run directory; returns the former's content."""
    data = reproduce_json(run)
    write_json(run.out / "reproduce.json", data)
    write_text(run.out / "report.md", report_markdown(run, data))
    return data
