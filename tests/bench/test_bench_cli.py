"""`oal bench op` / `oal bench report` argument handling (no measurement is started)."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from oal.cli import app


def make_app() -> typer.Typer:
    return app


def test_unknown_method_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(make_app(), ["bench", "op", "--methods", "nope", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "nope" in result.output


def test_max_n_below_every_size_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(make_app(), ["bench", "op", "--quick", "--max-n", "10", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "10" in result.output
    assert not (tmp_path / "op.json").exists()


def test_bad_config_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(
        make_app(), ["bench", "op", "--heads-q", "5", "--heads-kv", "2", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "heads_q" in result.output


def test_report_rewrites_markdown_from_json(tmp_path, full_result):
    (tmp_path / "op.json").write_text(json.dumps(full_result))
    result = CliRunner().invoke(make_app(), ["bench", "report", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "| 32768 | 6,400.0 | 800.0 | 8.00 |" in (tmp_path / "op.md").read_text()
    assert (tmp_path / "op.png").is_file()


def test_report_without_results_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(make_app(), ["bench", "report", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "op.json" in result.output
