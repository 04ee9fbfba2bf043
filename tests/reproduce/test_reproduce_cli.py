"""``oal reproduce`` through the wired command line: options map onto the preset exactly, bad input gives one
error line and a non-zero exit, another configuration in the same directory exits 1."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from oal.cli import app
from oal.reproduce import PRESETS


def _invoke(setup, out, *extra):
    args = ["reproduce", "--preset", "demo", "--out", str(out), "--model", str(setup["model"])]
    args += ["--data", str(setup["data"]), "--cache", str(setup["root"] / "qkv"), "--threads", "1", "--no-progress"]
    return CliRunner().invoke(app, [*args, *setup["micro_args"], *extra])


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "Error" in line]


def test_cli_resumes_the_library_run(reference, tiny_setup):
    """The options given as text reproduce the library run's configuration exactly, so nothing is recomputed."""
    out, data = reference
    before = {p.name: p.read_bytes() for p in (out / "stages").iterdir()}
    result = _invoke(tiny_setup, out)
    assert result.exit_code == 0, result.output
    assert "Table 3 analogue" in result.output and "report.md" in result.output
    assert {p.name: p.read_bytes() for p in (out / "stages").iterdir()} == before


def test_cli_other_configuration_exits_1(reference, tiny_setup):
    out, _ = reference
    result = _invoke(tiny_setup, out, "--eval-max-blocks", "1")
    assert result.exit_code == 1, result.output
    assert len(_error_lines(result.output)) == 1 and "another configuration" in result.output
    assert "eval_max_blocks: 2 -> 1" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "softmax,hedgehog"], "unknown ['hedgehog']"),
        (["--data", "/nonexistent/data"], "no such data folder: /nonexistent/data"),
        (["--calib-seq-len", "abc"], "expected an integer, got 'abc'"),
        (["--fidelity-layers", "1,3"], "fidelity_layers"),
        (["--preset", "huge"], "preset: expected one of"),
        (["--model", "/nonexistent/model"], "no such model directory"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_cli_bad_input(tiny_setup, tmp_path, extra, message):
    result = _invoke(tiny_setup, tmp_path / "out", *extra)
    assert result.exit_code == 2, result.output
    errors = _error_lines(result.output)
    assert len(errors) == 1 and message in result.output, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "run.json").exists()


def test_cli_defaults(monkeypatch):
    """``oal reproduce`` without options: the cpu preset on the embedded SmolLM2 into runs/reproduce."""
    import oal.reproduce.pipeline as pipeline

    seen = {}

    class Recorder:
        def __init__(self, preset, **kw):
            seen.update(preset=preset, **kw)

        def prepare(self):
            raise pipeline.ReproduceConflict("stop here")

    monkeypatch.setattr(pipeline, "Reproduction", Recorder)
    result = CliRunner().invoke(app, ["reproduce"])
    assert result.exit_code == 1 and "stop here" in result.output, result.output
    assert seen["preset"] == PRESETS["cpu"] and seen["model"] == "smollm2-135m"
    assert str(seen["out"]) == "runs/reproduce" and str(seen["cache"]) == "runs/qkv" and seen["data_dir"] is None
