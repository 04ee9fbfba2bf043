"""Converted models as their own transformers model type (oal.models.hf): Auto-class loading after `import oal`,
trust_remote_code without it, a clear error without the package, save/load round trips, PEFT merges."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny import byte_tokenizer, convert_tiny
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from oal.conversion import convert_model, save_converted
from oal.kernels import OALKernel, SinkWindowKernel
from oal.models import attached_kernels, load_model
from oal.models.hf import REMOTE_CODE_FILE, as_oal_model, oal_classes


def converted(make_model, arch="llama", kind="oal"):
    model = make_model(arch, num_heads=6, num_kv_heads=2)
    return convert_tiny(model, window=4 if kind == "sink_window" else None)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


IDS = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_auto_model_loads_the_converted_model_bit_identically(make_model, arch, tmp_path):
    model = converted(make_model, arch, "sink_window")
    config_cls, model_cls = oal_classes(arch)
    assert type(model) is model_cls and type(model.config) is config_cls
    assert model.config.model_type == f"oal_{arch}"
    model.generation_config = GenerationConfig(max_new_tokens=7, do_sample=False, pad_token_id=0)
    out = save_converted(model, tmp_path / "m", tokenizer=byte_tokenizer())
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == f"oal_{arch}" and saved["architectures"] == [model_cls.__name__]
    assert saved["auto_map"]["AutoModelForCausalLM"] == f"modeling_oal.{model_cls.__name__}"
    auto = AutoModelForCausalLM.from_pretrained(out)
    assert type(auto) is model_cls
    assert [type(k) for k in attached_kernels(auto).values()] == [SinkWindowKernel, SinkWindowKernel]
    ref = logits(model, IDS)
    assert torch.equal(logits(auto, IDS), ref)
    assert torch.equal(logits(load_model(out), IDS), ref)
    assert type(AutoConfig.from_pretrained(out)) is config_cls
    assert auto.generation_config.max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(out)("ab")["input_ids"] == byte_tokenizer()("ab")["input_ids"]


def test_save_pretrained_round_trip(make_model, tmp_path):
    model = converted(make_model)
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / REMOTE_CODE_FILE).is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert torch.equal(logits(again, IDS), logits(model, IDS))
    again.save_pretrained(tmp_path / "m2")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "m2"), IDS), logits(model, IDS))


def test_merge_and_unload_keeps_the_model_type(make_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = converted(make_model)
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    want = logits(peft, IDS)
    merged = peft.merge_and_unload()
    assert type(merged) is oal_classes("llama")[1]
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(loaded, IDS), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits(loaded, IDS), logits(merged, IDS))


def test_kernels_only_directory_loads_through_the_auto_class(make_model, tmp_path):
    base = make_model("llama", num_heads=6, num_kv_heads=2)
    base.save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"))
    g = torch.Generator().manual_seed(0)
    convert_model(model, "oal", layers="1-2", groups={i: torch.randint(0, 3, (6, 8), generator=g) for i in range(3)})
    out = save_converted(model, tmp_path / "k", base_weights=str(tmp_path / "base"))
    assert not (out / "model.safetensors").exists()
    auto = AutoModelForCausalLM.from_pretrained(out)
    assert type(auto) is oal_classes("llama")[1]
    assert torch.equal(logits(auto, IDS), logits(model, IDS))
    with pytest.raises(ValueError, match="kernels-only converted directory loads with"):
        AutoModelForCausalLM.from_pretrained(out, quantization_config={"x": 1})
    with pytest.raises(ValueError, match="kernels-only converted directory loads with"):
        oal_classes("llama")[1].from_pretrained(out, subfolder="inner")  # the Auto class fails before, on its config
    with pytest.raises(ValueError, match="device_map: a kernels-only converted directory loads onto one device"):
        AutoModelForCausalLM.from_pretrained(out, device_map={"": 0})
    half = AutoModelForCausalLM.from_pretrained(out, dtype="bfloat16")
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    assert next(iter(attached_kernels(half).values())).L.dtype == torch.float32  # kernels stay fp32


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_without_import_oal_remote_code_loads_it_and_a_missing_package_is_named(make_model, tmp_path):
    model = converted(make_model, "llama", "sink_window")
    out = save_converted(model, tmp_path / "m")
    want = logits(model, IDS)
    torch.save(want, tmp_path / "want.pt")
    # the same thread count as this process: a product's summation order may depend on it (bit-identity is asked)
    load = (
        "from transformers import AutoModelForCausalLM as A; import torch; "
        f"torch.set_num_threads({torch.get_num_threads()}); p = {str(out)!r}"
    )
    refused = _run(f"{load}; A.from_pretrained(p)")
    assert refused.returncode != 0 and "trust_remote_code=True" in refused.stderr
    ok = _run(
        f"{load}; import sys; m = A.from_pretrained(p, trust_remote_code=True)\n"
        f"with torch.no_grad(): got = m(torch.tensor({IDS.tolist()}), use_cache=False).logits\n"
        f"assert torch.equal(got, torch.load({str(tmp_path / 'want.pt')!r})), 'logits differ'\n"
        "print(type(m).__name__)"
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip() == "OALLlamaForCausalLM"
    missing = _run(f"import sys; sys.modules['oal'] = None; {load}; A.from_pretrained(p, trust_remote_code=True)")
    assert missing.returncode != 0 and "pip install oal" in missing.stderr


def test_as_oal_model_refuses_unconverted_models(make_model):
    with pytest.raises(ValueError, match="not a converted model"):
        as_oal_model(make_model("llama"))
    with pytest.raises(ValueError, match="base: expected one of"):
        oal_classes("gpt2")


def test_oal_kernels_are_rebuilt_from_the_record_not_from_defaults(make_model, tmp_path):
    model = converted(make_model)
    out = save_converted(model, tmp_path / "m")
    auto = AutoModelForCausalLM.from_pretrained(out)
    for i, k in attached_kernels(auto).items():
        mine = attached_kernels(model)[i]
        assert isinstance(k, OALKernel) and torch.equal(k.groups, mine.groups) and torch.equal(k.L, mine.L)
