"""``oal calibrate`` / ``oal fidelity`` / ``oal intervene`` end to end on a tiny local Llama and a small text."""

from __future__ import annotations

import json

import pytest
import typer

from oal.fidelity.cli import resolve_methods, run_calibrate, run_fidelity, run_intervene

FAST = {"max_updates": 20, "val_every": 10, "patience": 10, "train_pool": 32, "val_positions": 16}
N = 64


@pytest.fixture(scope="module")
def env(tiny_env):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OAL_CACHE_DIR", str(tiny_env["root"] / "oal-cache"))
        yield tiny_env


@pytest.fixture(scope="module")
def calibrated(env):
    root = env["root"] / "calibrate"
    common = dict(
        layers=[1, 2], seq_len=N, data_dir=env["data"], cache=env["root"] / "qkv", progress=False, config_overrides=FAST
    )
    model = str(env["model"])
    oal = run_calibrate(model, kernel="oal", out=root / "oal", groups_path=env["groups"], **common)
    dj = run_calibrate(model, kernel="dijiang", out=root / "dijiang", **common)
    sw = run_calibrate(
        model,
        kernel="oal+sink+window",
        out=root / "oal+sink+window",
        groups_path=env["groups"],
        n_sink=1,
        window=8,
        init_from=root / "oal",
        **common,
    )
    return root, oal, dj, sw


def test_calibrate_outputs_and_resume(calibrated, env, tmp_path):
    root, oal, dj, sw = calibrated
    for d in ("oal", "oal/global", "dijiang", "oal+sink+window"):
        assert (root / d / "params.safetensors").is_file(), d
    assert oal["data"]["train_blocks"] == list(range(16, 24)) and oal["data"]["val_blocks"] == [24, 25]
    assert "valid" in oal["data"]["description"] and "train split is absent" in oal["data"]["description"]
    assert len(oal["timings"]["capture"]["captured"]) == 10
    assert dj["timings"]["capture"]["captured"] == []  # same cache: the blocks are reused
    assert set(oal["per_layer"]) == {1, 2} and sw["sink_window"] == {"n_sink": 1, "window": 8}
    summary = json.loads((root / "oal" / "calibrate.md").parent.joinpath("calibrate.json").read_text())
    assert summary["provenance"]["data"].startswith("fit:")
    # resuming the same run does no work; other settings in the same directory are refused
    again = run_calibrate(
        str(env["model"]),
        kernel="dijiang",
        out=root / "dijiang",
        layers=[1, 2],
        seq_len=N,
        data_dir=env["data"],
        cache=env["root"] / "qkv",
        progress=False,
        config_overrides=FAST,
    )
    assert again["per_layer"] == dj["per_layer"]
    with pytest.raises(ValueError, match="different settings"):
        run_calibrate(
            str(env["model"]),
            kernel="dijiang",
            out=root / "dijiang",
            layers=[1],
            seq_len=N,
            data_dir=env["data"],
            cache=env["root"] / "qkv",
            progress=False,
            config_overrides={**FAST, "max_updates": 30},
        )


def test_fidelity_table(calibrated, env, tmp_path):
    root, *_ = calibrated
    out = tmp_path / "fid"
    r = run_fidelity(
        str(env["model"]),
        methods=["softmax", "performer", "taylorshift=init", "dijiang", "global", "oal", "oal+sink+window"],
        layers=[1, 2],
        blocks=[0, 1, 2],
        seq_len=N,
        out=out,
        calibrated_root=root,
        data_dir=env["data"],
        cache=env["root"] / "qkv",
        progress=False,
    )
    m = r["methods"]
    assert m["softmax"]["relmse_before_wo"] == 0 and m["softmax"]["mse_after_wo"] == 0
    for name in ("performer", "dijiang", "global", "oal", "oal+sink+window"):
        assert m[name]["relmse_before_wo"] > 0 and m[name]["relmse_after_wo"] > 0, name
        assert set(m[name]["per_layer"]) == {"1", "2"}
    assert m["global"]["params"].startswith(f"calibrated: {root / 'oal' / 'global'}")
    assert m["taylorshift"]["params"] == "initial values"
    assert r["diagnostics"]["max_abs_sdpa_minus_captured_output"]["1"] < 1e-5
    assert (out / "fidelity.md").read_text().count("| oal |") == 2


def test_fidelity_refuses_fitting_blocks_and_missing_calibration(calibrated, env, tmp_path):
    root, *_ = calibrated
    common = dict(
        layers=[1], seq_len=N, data_dir=env["data"], cache=env["root"] / "qkv", progress=False, out=tmp_path / "f"
    )
    with pytest.raises(ValueError, match="also evaluation blocks"):
        run_fidelity(
            str(env["model"]), methods=["dijiang"], split="valid", blocks=[15, 16], calibrated_root=root, **common
        )
    with pytest.raises(typer.BadParameter, match="trainable parameters"):
        run_fidelity(str(env["model"]), methods=["spectraformer"], blocks=[0], calibrated_root=root, **common)


def test_resolve_methods(tmp_path):
    (tmp_path / "oal" / "global").mkdir(parents=True)
    (tmp_path / "oal" / "global" / "params.safetensors").write_bytes(b"")
    got = resolve_methods(["softmax", "global", "dijiang=init", "oal=/x", "w16:oal+window=/y"], tmp_path)
    assert got == [
        ("softmax", "softmax", None),
        ("global", "global", str(tmp_path / "oal" / "global")),
        ("dijiang", "dijiang", "init"),
        ("oal", "oal", "/x"),
        ("w16", "oal+window", "/y"),
    ]
    with pytest.raises(ValueError, match="twice"):
        resolve_methods(["oal", "oal=/y"], tmp_path)
    with pytest.raises(ValueError, match="twice"):
        resolve_methods(["a:oal=/x", "a:global=/y"], tmp_path)
    with pytest.raises(ValueError, match="kernel"):
        resolve_methods(["nope"], tmp_path)


def test_intervene(env, tmp_path):
    r = run_intervene(
        str(env["model"]),
        groups_path=env["groups"],
        methods=["performer", "taylorshift"],
        layers=[1, 2],
        blocks=[0, 1],
        seq_len=N,
        out=tmp_path / "int",
        data_dir=env["data"],
        cache=env["root"] / "qkv",
        positions=8,
        seeds=[0, 1],
        controls=4,
        control_blocks=1,
        gauss_prompts=6,
        gauss_prompt_len=16,
        progress=False,
    )
    p = r["methods"]["performer"]
    assert p["kernel_seeds"] == [0, 1] and r["methods"]["taylorshift"]["kernel_seeds"] == [0]
    assert p["controls"]["B"] == 4 and p["controls"]["p_value"] in {k / 5 for k in range(1, 6)}
    assert p["R_S"] > 0 and "R_S_gaussian" in p
    assert 0 < r["subsets"]["pretrained"]["fraction"] < 1
    assert "p (B = 4)" in (tmp_path / "int" / "intervene.md").read_text()
