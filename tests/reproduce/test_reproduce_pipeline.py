"""``oal reproduce`` end to end on a tiny Llama: outputs, consistency between stages, skipping finished stages,
recomputing only what is missing, and refusing a directory that holds another configuration."""

from __future__ import annotations

import json
import math
import re
import shutil
import time

import pytest

from oal.io import read_json
from oal.reproduce import PAPER_METHODS, ReproduceConflict, Reproduction, preset, run_reproduce


def make_run(setup, out, **overrides) -> Reproduction:
    """The micro preset (the setup's ``micro`` overrides of the demo preset) on the tiny model."""
    return Reproduction(
        preset("demo", **{**setup["micro"], **overrides}),
        model=str(setup["model"]),
        out=out,
        data_dir=setup["data"],
        cache=setup["root"] / "qkv",
        progress=False,
    )


def _records(out):
    return {p.name: p.read_bytes() for p in sorted((out / "stages").iterdir())}


def test_outputs(reference, tiny_setup):
    out, data = reference
    assert set(data) == {"methods", "config"}
    assert list(data["methods"]) == list(PAPER_METHODS)
    assert json.loads((out / "reproduce.json").read_text()) == data
    for method, metrics in data["methods"].items():
        assert set(metrics) == {"ppl", "piqa", "hellaswag", "arc_easy"}
        ev = read_json(out / "evaluate" / f"{method}.json")
        assert metrics["ppl"] == ev["results"]["wikitext"]["perplexity,none"] and 1 < metrics["ppl"] < 1e4
        for task in ("piqa", "hellaswag", "arc_easy"):
            assert metrics[task] == ev["results"][task]["acc_norm,none"] and 0 <= metrics[task] <= 1
        assert ev["results"]["wikitext"]["n_blocks"] == 2 and ev["n-samples"]["piqa"]["effective"] == 3
    cfg = data["config"]
    assert cfg["converted_layers"] == [1, 2] and cfg["preset"]["name"] == "demo"
    assert cfg["evaluation"]["ppl_tokens"] == 2 * 63 and cfg["finetune"]["updates"] == 2
    assert any("valid" in line and "no train split" in line for line in cfg["data_protocol"])
    # every stage recorded; Performer has nothing to calibrate (fixed features), the global quadratic comes from OAL
    stages = {p.stem for p in (out / "stages").iterdir()}
    assert {"analyze", "group", "fidelity", "report"} <= stages
    assert {s for s in stages if s.startswith("calibrate.")} == {
        f"calibrate.{k}" for k in ("oal", "spectraformer", "dijiang", "taylorshift")
    }
    assert {f"{kind}.{m}" for kind in ("finetune", "evaluate") for m in PAPER_METHODS} <= stages
    report = (out / "report.md").read_text()
    assert "Table 3 analogue" in report and "Table 2 analogue" in report and "**valid** split" in report
    assert "(fidelity/fidelity.png)" in report and "| finetune.oal |" in report and "| OAL |" in report
    fidelity = read_json(out / "fidelity" / "fidelity.json")
    assert set(fidelity["methods"]) == {"softmax", *PAPER_METHODS[1:]}
    assert fidelity["methods"]["softmax"]["mse_before_wo"] == 0


def test_methods_start_from_their_calibration(reference):
    """Fine-tuning converted the same layers for every method, with the calibrated kernels (OAL's groups from
    groups.json, the global quadratic from OAL's G = 1 stage)."""
    from oal.calibration import load_calibrated
    from oal.grouping import GroupAssignment

    out, _ = reference
    groups = GroupAssignment.load(out / "group" / "groups.json", num_heads=6, head_dim=8)
    kinds = {"oal": "oal", "global": "global", "performer": "performer", "dijiang": "dijiang"}
    for method, kind in kinds.items():
        summary = read_json(out / "finetune" / method / "summary.json")
        assert summary["model"]["converted_layers"] == [1, 2]
        assert set(summary["model"]["kernels"].values()) == {kind}
    kernels = read_json(out / "finetune" / "oal" / "best" / "kernels.json")["layers"]
    for layer in (1, 2):
        assert kernels[str(layer)]["groups"] == groups.group_ids(layer).tolist()
        assert load_calibrated(out / "calibrate" / "oal" / "global", layer).name == "global"
    assert read_json(out / "finetune" / "softmax" / "summary.json")["model"]["converted_layers"] == []


def test_rerun_skips_every_stage(reference, tiny_setup, monkeypatch):
    out, data = reference
    before, report = _records(out), (out / "report.md").read_bytes()

    def forbidden(*args, **kwargs):
        raise AssertionError("a finished stage was recomputed")

    for target in (
        "oal.analysis.cli.run_analyze",
        "oal.analysis.cli.run_group",
        "oal.fidelity.cli.run_calibrate",
        "oal.fidelity.cli.run_fidelity",
        "oal.training.cli.run_with_progress",
        "oal.evaluation.evaluate",
        "oal.reproduce.report.write_report",
    ):
        monkeypatch.setattr(target, forbidden)
    assert make_run(tiny_setup, out).run() == data
    assert _records(out) == before and (out / "report.md").read_bytes() == report
    assert len(read_json(out / "run.json")["invocations"]) >= 2


def test_missing_output_is_recomputed(reference, tiny_setup, tmp_path):
    """A stage whose output disappeared runs again (and only it and the report), with the same result."""
    out, data = reference
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / "evaluate" / "oal.json").unlink()
    (copy / "report.md").unlink()
    before = _records(copy)
    # records carry second-resolution time stamps: on an idle machine the tiny reference run can finish within the
    # same second as this rerun, and a rerun stage would then write the same bytes
    time.sleep(1.1)
    assert make_run(tiny_setup, copy).run() == data
    after = _records(copy)
    assert {k for k in before if before[k] != after[k]} == {"evaluate.oal.json", "report.json"}
    # the report written in the moved directory links to its own figures
    links = re.findall(r"\]\(([^)]+\.png)\)", (copy / "report.md").read_text())
    assert len(links) >= 3 and all((copy / link).is_file() for link in links), links


def test_other_configuration_is_refused(reference, tiny_setup, tmp_path):
    out, _ = reference
    with pytest.raises(ReproduceConflict, match=r"another configuration \(preset.finetune_updates: 2 -> 3\)"):
        make_run(tiny_setup, out, finetune_updates=3).prepare()
    with pytest.raises(ReproduceConflict, match="preset.methods"):
        make_run(tiny_setup, out, methods=("softmax", "oal")).prepare()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ReproduceConflict, match="holds no reproduction"):
        make_run(tiny_setup, foreign).prepare()


def test_stage_record_with_other_settings_is_refused(reference, tiny_setup, tmp_path):
    out, _ = reference
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    record = read_json(copy / "stages" / "group.json")
    record["depends"]["group"]["group_n_boot"] = 7
    (copy / "stages" / "group.json").write_text(json.dumps(record))
    with pytest.raises(ReproduceConflict, match="stage group .* other settings .*group_n_boot: 7 -> 50"):
        make_run(tiny_setup, copy).prepare()


def test_extra_methods_and_sink_window(tiny_setup, tmp_path):
    """Methods beyond Table 3: a sink/window kernel is calibrated from its calibrated plain kernel (init_from);
    the global quadratic needs OAL's calibration even when OAL itself is not a method."""
    out = tmp_path / "run"
    data = run_reproduce(
        preset("demo", **{**tiny_setup["micro"], "methods": ("softmax", "global+sink+window")}),
        model=str(tiny_setup["model"]),
        out=out,
        data_dir=tiny_setup["data"],
        cache=tiny_setup["root"] / "qkv",
        progress=False,
    )
    assert list(data["methods"]) == ["softmax", "global+sink+window"]
    assert all(math.isfinite(v) for m in data["methods"].values() for v in m.values())
    calib = read_json(out / "calibrate" / "global+sink+window" / "calibrate.json")
    assert calib["init_from"] == str(out / "calibrate" / "oal" / "global")
    assert calib["sink_window"] == {"n_sink": 1, "window": 8}
    summary = read_json(out / "finetune" / "global+sink+window" / "summary.json")
    assert set(summary["model"]["kernels"].values()) == {"global+sink+window"}
    assert not (out / "finetune" / "oal").exists() and (out / "calibrate" / "oal" / "global").is_dir()


def test_bad_inputs(tiny_setup, tmp_path):
    with pytest.raises(ValueError, match="data: no such data folder"):
        make_run({**tiny_setup, "data": tmp_path / "nowhere"}, tmp_path / "a")
    (tmp_path / "partial" / "wikitext-2-raw").mkdir(parents=True)
    with pytest.raises(ValueError, match="lacks .*wiki.valid.raw"):
        make_run({**tiny_setup, "data": tmp_path / "partial"}, tmp_path / "a")
    with pytest.raises(ValueError, match=r"fidelity_layers: .* got \[3\]"):
        make_run(tiny_setup, tmp_path / "b", fidelity_layers=(1, 3)).prepare()
    with pytest.raises(ValueError, match="analyze_layer"):
        make_run(tiny_setup, tmp_path / "c", analyze_layer=4).prepare()
    with pytest.raises(ValueError, match="layers"):
        make_run(tiny_setup, tmp_path / "d", layers="1-9").prepare()
