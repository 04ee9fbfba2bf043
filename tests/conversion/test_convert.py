import copy
import json
import pickle

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from oal.conversion import conversion_info, convert_model, default_layers, parse_layers
from oal.grouping import GroupAssignment, group_heads
from oal.kernels import OALKernel, PerformerKernel
from oal.models import attached_kernels, detach_kernel

BASELINES = ["global", "performer", "spectraformer", "dijiang", "taylorshift"]


def groups_for(model, layers, num_groups=3, seed=0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d = model.config.num_attention_heads, 8
    return {i: torch.randint(0, num_groups, (h, d), generator=g) for i in layers}


def assignment(model_id, layers, num_heads=6, head_dim=8) -> GroupAssignment:
    chi = torch.rand(len(layers), 5, num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    return group_heads(chi, model_id=model_id, alpha=0.5, gamma=0.0, n_boot=20, layers=layers)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_parse_layers():
    assert parse_layers("3-5", 10) == [3, 4, 5]
    assert parse_layers("8, 1-2,5", 10) == [1, 2, 5, 8]
    assert parse_layers([4, 2], 10) == [2, 4]
    assert parse_layers(7, 10) == [7]
    assert parse_layers(range(2, 4), 10) == [2, 3]
    with pytest.raises(ValueError, match=r"layers: expected indices in \[0, 10\).*got \[10, 11\]"):
        parse_layers("8-11", 10)
    with pytest.raises(ValueError, match="ends before it starts"):
        parse_layers("5-3", 10)
    with pytest.raises(ValueError, match="ranges like"):
        parse_layers("3..5", 10)
    with pytest.raises(ValueError, match="distinct"):
        parse_layers("1-3,2", 10)
    with pytest.raises(ValueError, match="integer layer indices"):
        parse_layers([1.0], 10)
    with pytest.raises(ValueError, match="at least one"):
        parse_layers([], 10)


def test_default_layers(make_model):
    model = make_model(layers=30)
    assert default_layers(model) == list(range(3, 27))  # SmolLM2: 3-26
    model.config._name_or_path = "meta-llama/Llama-3.2-1B"
    assert default_layers(model) == list(range(1, 15))  # App. F
    model.config._name_or_path = "Qwen/Qwen2.5-0.5B"
    assert default_layers(model) == list(range(3, 21))
    with pytest.raises(ValueError, match="nothing to convert in a model of 6 layers"):
        default_layers(make_model(layers=6))


CASES = [(arch, heads, kv, "oal") for arch in ("llama", "qwen2", "mistral") for heads, kv in ((6, 6), (6, 2))]
CASES += [("llama", 6, 2, kernel) for kernel in BASELINES]


@pytest.mark.parametrize(("arch", "heads", "kv", "kernel"), CASES)
def test_convert_attaches_kernels(make_model, arch, heads, kv, kernel):
    model = make_model(arch, num_heads=heads, num_kv_heads=kv)
    ids = torch.randint(0, 256, (2, 19))
    ref = logits(model, ids)
    groups = groups_for(model, [1, 2]) if kernel == "oal" else None
    out = convert_model(model, kernel, layers="1-2", groups=groups, seed=3)
    assert out is model
    kernels = attached_kernels(model)
    assert sorted(kernels) == [1, 2] and all(k.name == kernel for k in kernels.values())
    info = conversion_info(model)
    assert info["kernel"] == kernel and info["layers"] == [1, 2] and info["seed"] == 3
    assert json.loads(json.dumps(info)) == info  # JSON-friendly record
    if kernel == "oal":
        assert torch.equal(kernels[2].groups, groups[2])
        assert info["kernel_configs"]["2"]["groups"] == groups[2].tolist()
    got = logits(model, ids)
    assert torch.isfinite(got).all() and (got - ref).abs().max() > 1e-4


def test_seeded_baselines_draw_per_layer(make_model):
    model = convert_model(make_model(), "performer", layers=[1, 2], seed=5)
    k1, k2 = attached_kernels(model)[1], attached_kernels(model)[2]
    assert isinstance(k1, PerformerKernel) and not torch.equal(k1.omega, k2.omega)
    again = attached_kernels(convert_model(make_model(), "performer", layers=[1, 2], seed=5))
    assert torch.equal(again[1].omega, k1.omega)


def test_groups_from_assignment_object_and_file(make_model, tmp_path):
    ga = assignment("tiny", [1, 2, 3])
    model = convert_model(make_model(), "oal", layers="1-2", groups=ga)
    assert torch.equal(attached_kernels(model)[1].groups, ga.group_ids(1))
    ga.save(tmp_path / "groups.json")
    model = convert_model(make_model(), "oal", layers=[2, 3], groups=tmp_path / "groups.json")
    assert torch.equal(attached_kernels(model)[3].groups, ga.group_ids(3))
    assert conversion_info(model)["groups"]["source"] == str(tmp_path / "groups.json")


def test_bad_groups(make_model, tmp_path):
    other = assignment("other-model", [1, 2], num_heads=4)
    other.save(tmp_path / "other.json")
    with pytest.raises(ValueError, match="groups were made for num_heads=4"):
        convert_model(make_model(), "oal", layers="1-2", groups=tmp_path / "other.json")
    with pytest.raises(ValueError, match="made for 4 heads of size 8"):
        convert_model(make_model(), "oal", layers="1-2", groups=other)
    with pytest.raises(ValueError, match=r"no groups for the converted layers \[3\]"):
        convert_model(make_model(), "oal", layers="1-3", groups=assignment("tiny", [1, 2]))
    with pytest.raises(FileNotFoundError, match="groups: no such file"):
        convert_model(make_model(), "oal", layers="1", groups=tmp_path / "missing.json")
    with pytest.raises(ValueError, match="needs dimension groups"):
        convert_model(make_model(), "oal", layers="1")
    with pytest.raises(ValueError, match="only the 'oal' kernel takes dimension groups"):
        convert_model(make_model(), "performer", layers="1", groups=assignment("tiny", [1]))
    with pytest.raises(ValueError, match=r"groups: layer 1: expected \(6, 8\) group ids"):
        convert_model(make_model(), "oal", layers="1", groups={1: torch.zeros(6, 4, dtype=torch.long)})


def test_bad_inputs_leave_the_model_untouched(make_model):
    model = make_model()
    with pytest.raises(ValueError, match="kernel: expected one of"):
        convert_model(model, "mamba", layers="1")
    with pytest.raises(ValueError, match=r"layers: expected indices in \[0, 4\)"):
        convert_model(model, "taylorshift", layers="2-4")
    with pytest.raises(ValueError, match="kw: unknown options"):
        convert_model(model, "taylorshift", layers="1", num_features=3)
    assert attached_kernels(model) == {} and conversion_info(model) is None
    assert model.config._attn_implementation == "sdpa"
    convert_model(model, "taylorshift", layers="1")
    with pytest.raises(ValueError, match="already has kernels attached"):
        convert_model(model, "taylorshift", layers="2")


def test_unsupported_architecture_names_the_model_type():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32)).eval()
    with pytest.raises(ValueError, match="model type 'gpt2' \\(GPT2LMHeadModel\\)"):
        convert_model(gpt2, "taylorshift", layers="0")
    with pytest.raises(ValueError, match="PreTrainedModel"):
        convert_model(torch.nn.Linear(2, 2), "taylorshift", layers="0")


def write_calibrated(path, kernels: dict[int, torch.nn.Module], summary: dict | None = None) -> None:
    tensors = {
        f"layers.{i}.{k}": v.detach().clone() for i, kern in kernels.items() for k, v in kern.state_dict().items()
    }
    save_file(tensors, str(path / "params.safetensors"))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))


def test_calibrated_parameters_are_loaded(make_model, tmp_path):
    groups = groups_for(make_model(), [1, 2])
    calibrated = {}
    for i in (1, 2):
        calibrated[i] = OALKernel(groups[i], num_kv_heads=2, num_groups=4)
        calibrated[i].L.data.normal_()
    write_calibrated(tmp_path, calibrated, {"kernel": "oal"})
    # groups from the calibrated tensors, G from L's shape
    model = convert_model(make_model(), "oal", layers="1-2", calibrated=tmp_path)
    for i in (1, 2):
        assert torch.equal(attached_kernels(model)[i].L, calibrated[i].L)
        assert torch.equal(attached_kernels(model)[i].groups, groups[i])
    # the same through the file path and explicit groups
    model = convert_model(make_model(), "oal", layers="1-2", calibrated=tmp_path / "params.safetensors", groups=groups)
    assert torch.equal(attached_kernels(model)[2].L, calibrated[2].L)
    assert conversion_info(model)["calibrated"]["source"] == str(tmp_path / "params.safetensors")


def test_bad_calibrated_parameters(make_model, tmp_path):
    groups = groups_for(make_model(), [1, 2])
    kernels = {i: OALKernel(groups[i], num_kv_heads=2, num_groups=3) for i in (1, 2)}
    write_calibrated(tmp_path, kernels, {"kernel": "oal"})
    with pytest.raises(FileNotFoundError, match="calibrated: no such file"):
        convert_model(make_model(), "oal", layers="1-2", calibrated=tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match=r"cover exactly the converted layers \[1, 2, 3\].*missing \[3\]"):
        convert_model(make_model(), "oal", layers="1-3", calibrated=tmp_path)
    with pytest.raises(ValueError, match=r"not converted \[2\]"):
        convert_model(make_model(), "oal", layers="1", calibrated=tmp_path)
    with pytest.raises(ValueError, match="parameters of the 'oal' kernel, not 'global'"):
        convert_model(make_model(), "global", layers="1-2", calibrated=tmp_path)
    other = groups_for(make_model(), [1, 2], seed=9)
    with pytest.raises(ValueError, match="calibrated: layer 1: 'groups' differs"):
        convert_model(make_model(), "oal", layers="1-2", calibrated=tmp_path, groups=other)
    with pytest.raises(ValueError, match=r"calibrated: layer 1: 'L' has shape \(6, 4, 4\), expected \(6, 6, 6\)"):
        convert_model(make_model(), "oal", layers="1-2", calibrated=tmp_path, groups=groups, num_groups=5)
    (tmp_path / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"calibrated: layer 1: expected the tensors \['temperature'\]"):
        convert_model(make_model(), "taylorshift", layers="1-2", calibrated=tmp_path)
    save_file({"L": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="expected keys 'layers.<i>.<name>'"):
        convert_model(make_model(), "oal", layers="1", calibrated=tmp_path / "bad.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        convert_model(make_model(), "oal", layers="1", calibrated=tmp_path / "junk.safetensors")


def test_kernels_stay_fp32_when_the_model_is_cast(make_model):
    model = convert_model(make_model(), "oal", layers="1-2", groups=groups_for(make_model(), [1, 2]))
    L = attached_kernels(model)[1].L.detach().clone()
    model.to(torch.bfloat16)
    kernel = attached_kernels(model)[1]
    assert model.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert kernel.L.dtype == torch.float32 and torch.equal(kernel.L, L)  # not rounded through bf16
    assert kernel.groups.dtype == torch.int64
    model.half()
    assert kernel.L.dtype == torch.float32
    model.double()  # up-casts apply
    assert kernel.L.dtype == torch.float64
    model.float()
    out = logits(model.to(torch.bfloat16), torch.randint(0, 256, (1, 9)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # the guard survives copies and pickles of the model, and leaves with the kernel
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        other.float().half()
        assert attached_kernels(other)[1].L.dtype == torch.float32
        assert other.model.layers[1].self_attn.q_proj.weight.dtype == torch.float16
    detached = detach_kernel(model, 1)
    assert detached.half().L.dtype == torch.float16


@pytest.mark.parametrize("name", ["oal+sink+window", "global+sink"])
def test_sink_window_kernels_convert_from_their_calibration(make_model, tmp_path, name):
    from oal.conversion import load_converted, save_converted
    from oal.kernels.registry import build_kernel, kernel_config

    model = make_model()
    groups = groups_for(model, [1, 2]) if name.startswith("oal") else {1: None, 2: None}
    kernels = {}
    for i in (1, 2):
        kw = {"groups": groups[i]} if groups[i] is not None else {}
        kernels[i] = build_kernel(name, num_heads=6, num_kv_heads=2, head_dim=8, layer_idx=i, n_sink=2, **kw)
        with torch.no_grad():
            kernels[i].beta.normal_()
    summary = {
        "kernel": name,
        "layers": {str(i): {"meta": {"kernel_config": kernel_config(k)}} for i, k in kernels.items()},
    }
    write_calibrated(tmp_path, kernels, summary)
    converted = convert_model(model, name, layers="1-2", calibrated=tmp_path)
    for i in (1, 2):
        got = attached_kernels(converted)[i]
        assert got.name == name and got.n_sink == 2
        for key, value in kernels[i].state_dict().items():
            assert torch.equal(got.state_dict()[key], value), key
    ids = torch.randint(0, 256, (1, 19))
    with torch.no_grad():
        ref = converted(ids, use_cache=False).logits
        loaded = load_converted(save_converted(converted, tmp_path / "saved"))
        assert torch.equal(loaded(ids, use_cache=False).logits, ref)
    with pytest.raises(ValueError, match="converted from its calibration directory alone"):
        convert_model(make_model(), name, layers="1-2")
    with pytest.raises(ValueError, match="converted from its calibration directory alone"):
        convert_model(make_model(), name, layers="1-2", calibrated=tmp_path, window=4)
