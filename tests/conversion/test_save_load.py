import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from oal.conversion import conversion_info, convert_model, is_converted_dir, load_converted, save_converted
from oal.models import attached_kernels, load_model, load_tokenizer

KERNELS = ["oal", "global", "performer", "spectraformer", "dijiang", "taylorshift"]


def convert(model, kernel, layers="1-2", **kw):
    if kernel == "oal":
        g = torch.Generator().manual_seed(0)
        kw["groups"] = {i: torch.randint(0, 3, (6, 8), generator=g) for i in range(4)}
    return convert_model(model, kernel, layers=layers, **kw)


def perturb(model):
    """Move every kernel's floating tensors away from their initial values, as calibration would."""
    with torch.no_grad():
        for kernel in attached_kernels(model).values():
            for t in kernel.state_dict().values():
                if t.is_floating_point():
                    t.add_(0.05 * torch.randn_like(t))


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("kernel", KERNELS)
def test_round_trip_gives_bit_identical_logits(make_model, tmp_path, kernel):
    model = convert(make_model("llama", num_kv_heads=2), kernel, seed=4)
    perturb(model)
    ids = torch.randint(0, 256, (2, 21))
    ref = logits(model, ids)
    out = save_converted(model, tmp_path / "converted")
    assert is_converted_dir(out) and not is_converted_dir(tmp_path)
    loaded = load_converted(out)
    assert torch.equal(logits(loaded, ids), ref)
    assert conversion_info(loaded) == conversion_info(model)
    assert loaded.config._attn_implementation == "oal" and not loaded.training
    for i, k in attached_kernels(model).items():
        other = attached_kernels(loaded)[i]
        assert type(other) is type(k)
        for (name, a), (_, b) in zip(k.state_dict().items(), other.state_dict().items(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_round_trip_other_families_and_load_model(make_model, tokenizer, tmp_path, arch):
    model = convert(make_model(arch, num_kv_heads=6), "oal", layers=[0, 3])
    perturb(model)
    save_converted(model, tmp_path / "m", tokenizer=tokenizer)
    loaded = load_model(tmp_path / "m")  # oal.models.load_model detects the conversion
    assert type(loaded) is type(model) and sorted(attached_kernels(loaded)) == [0, 3]
    assert loaded.oal_source.kind == "local"
    ids = torch.randint(0, 256, (1, 17))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert load_tokenizer(tmp_path / "m")("ab")["input_ids"] == tokenizer("ab")["input_ids"]


def test_bf16_model_keeps_fp32_kernels_through_save_and_load(make_model, tmp_path):
    model = convert(make_model(), "oal").to(torch.bfloat16)
    perturb(model)
    save_converted(model, tmp_path / "m")
    saved = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert saved["model.layers.1.self_attn.oal_kernel.L"].dtype == torch.float32
    assert saved["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    loaded = load_converted(tmp_path / "m", dtype=torch.bfloat16)
    assert attached_kernels(loaded)[1].L.dtype == torch.float32
    assert torch.equal(attached_kernels(loaded)[1].L, attached_kernels(model)[1].L)
    # Not bit-identical: model.to(bf16) casts RoPE's inv_freq buffer, loading in bf16 keeps it fp32 (transformers).
    ids = torch.randint(0, 256, (1, 9))
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0.03)
    save_converted(loaded, tmp_path / "again")
    assert torch.equal(logits(load_converted(tmp_path / "again", dtype=torch.bfloat16), ids), logits(loaded, ids))


def test_save_refuses_unconverted_models_and_non_empty_dirs(make_model, tmp_path):
    with pytest.raises(ValueError, match="not a converted model"):
        save_converted(make_model(), tmp_path / "x")
    model = convert(make_model(), "taylorshift")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not empty"):
        save_converted(model, tmp_path / "busy")
    assert (tmp_path / "busy" / "file").read_text() == "keep me"
    save_converted(model, tmp_path / "busy", overwrite=True)
    assert is_converted_dir(tmp_path / "busy") and not (tmp_path / "busy" / "file").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]  # no temporary directories left behind
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "busy").stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.fixture
def saved(make_model, tmp_path):
    model = convert(make_model(), "oal")
    perturb(model)
    return save_converted(model, tmp_path / "m")


def edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config["oal_conversion"])
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_tampered_groups_in_config_are_refused(saved):
    def swap(info):
        groups = info["kernel_configs"]["2"]["groups"]
        groups[0][0], groups[0][1] = groups[0][1] + 1, groups[0][0]

    edit_config(saved, swap)
    with pytest.raises(ValueError, match="layer 2: 'groups' differs from the kernel's own"):
        load_converted(saved)


def test_tampered_tensor_shapes_are_refused(saved):
    edit_tensors(saved, lambda t: t.update({"model.layers.1.self_attn.oal_kernel.L": torch.zeros(6, 5, 5)}))
    with pytest.raises(ValueError, match=r"layer 1: 'L' has shape \(6, 5, 5\), expected \(6, 4, 4\)"):
        load_converted(saved)


def test_missing_kernel_tensors_are_refused(saved):
    edit_tensors(saved, lambda t: t.pop("model.layers.2.self_attn.oal_kernel.L"))
    with pytest.raises(ValueError, match=r"layer 2: expected the tensors \['L', 'groups'\].*missing \['L'\]"):
        load_converted(saved)
    edit_tensors(saved, lambda t: [t.pop(k) for k in list(t) if ".layers.2.self_attn.oal_kernel." in k])
    with pytest.raises(ValueError, match=r"kernels for layers \[1\], but config.json records .* \[1, 2\]"):
        load_converted(saved)


def test_bad_records_are_refused(saved, tmp_path):
    edit_config(saved, lambda info: info["kernel_configs"]["1"].update(num_heads=4))
    with pytest.raises(ValueError, match="layer 1: the recorded kernel config is invalid"):
        load_converted(saved)
    edit_config(saved, lambda info: info.update(format="oal-conversion/0"))
    with pytest.raises(ValueError, match="expected a conversion record of format 'oal-conversion/1'"):
        load_converted(saved)
    with pytest.raises(FileNotFoundError):
        load_converted(tmp_path / "nowhere")
