"""``load_nvfp4`` changes the model only once everything is decided (an error leaves it as it was), loads again into a
model an earlier load changed, materializes a model built on the meta device, and names what is wrong with the files
(a path, an index, a shard, a dtype, a per-expert scale). Small hand-made checkpoints, quantized with fp4dispatch's
own quantize (their decoding is the reference)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors.torch", reason="needs safetensors")

from safetensors.torch import save_file  # noqa: E402

from fp4dispatch import InvalidInputError, quantize_nvfp4  # noqa: E402
from fp4dispatch.checkpoint import load_nvfp4, read_quantization_config  # noqa: E402
from fp4dispatch.moe import Fp4MoeExperts  # noqa: E402
from fp4dispatch.nn import Fp4Linear  # noqa: E402

MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["head"]}
COMPRESSED = {"quant_method": "compressed-tensors", "ignore": ["head"], "config_groups": {"g": {
    "targets": ["Linear"], "format": "nvfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float",
                                                                         "group_size": 16}}}}


class Net(nn.Module):
    """Two quantized Linear layers (one with a bias), a norm, an excluded head and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 32, bias=False)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.head(self.down(self.up(self.norm(x))))


def _tensors(kind: str, seed: int = 0) -> dict:
    """The checkpoint's tensors of a Net, as the exporter of ``kind`` names them, with static activation scales."""
    g = torch.Generator().manual_seed(seed)
    t = {"norm.weight": 1 + torch.rand(64, generator=g), "norm.bias": torch.rand(64, generator=g),
         "up.bias": torch.randn(128, generator=g), "head.weight": torch.randn(32, 64, generator=g)}
    for name, (n, k) in (("up", (128, 64)), ("down", (64, 128))):
        w = torch.randn(n, k, generator=g)
        q, s, gs = quantize_nvfp4(w, scale_layout="linear")
        if kind == "modelopt":
            t |= {f"{name}.weight": q, f"{name}.weight_scale": s, f"{name}.weight_scale_2": (1 / gs).reshape(()),
                  f"{name}.input_scale": torch.tensor(0.002)}
        else:
            t |= {f"{name}.weight_packed": q, f"{name}.weight_scale": s, f"{name}.weight_global_scale": gs,
                  f"{name}.input_global_scale": torch.tensor([500.0])}
    return t


def _save(path, tensors: dict, qcfg: dict, shards: int = 2):
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(path / f))
        weight_map |= {n: f for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    return path


def _state(model: nn.Module) -> dict:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _same(model: nn.Module, before: dict) -> bool:
    after = model.state_dict()
    return set(after) == set(before) and all(torch.equal(after[n], t) for n, t in before.items())


X = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))


# -- nothing changes before everything is decided -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["modelopt", "compressed-tensors"])
def test_strict_refuses_with_the_model_unchanged_and_strict_false_then_loads(tmp_path, kind):
    t = _tensors(kind)
    del t["up.bias"]  # the model's up has a bias the checkpoint lacks: strict refuses
    path = _save(tmp_path, t, MODELOPT if kind == "modelopt" else COMPRESSED)
    model = Net()
    before = _state(model)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: 1 tensors of the model are not in the checkpoint "
                                                r"and would keep their initial values \(first: \['up.bias'\]\)\. "
                                                r"The model is unchanged: pass strict=False to accept that"):
        load_nvfp4(model, path, mode="w4a4")
    assert type(model.up) is nn.Linear and type(model.down) is nn.Linear and _same(model, before)
    report = load_nvfp4(model, path, mode="w4a4", strict=False)
    assert report.missing == ["up.bias"] and isinstance(model.up, Fp4Linear)
    assert torch.equal(model.up.bias, before["up.bias"])  # kept, as reported


def test_an_orphan_quantized_tensor_or_a_bad_tensor_late_in_the_walk_leaves_the_model_unchanged(tmp_path):
    t = _tensors("modelopt")
    t["gone.weight_scale_2"] = torch.tensor(1.0)
    model = Net()
    before = _state(model)
    with pytest.raises(InvalidInputError, match=r"quantized checkpoint tensors have no nn.Linear .* The model is "
                                                r"unchanged: pass strict=False"):
        load_nvfp4(model, _save(tmp_path, t, MODELOPT))
    assert type(model.up) is nn.Linear and _same(model, before)
    t = _tensors("modelopt")
    t["down.weight_scale_2"] = torch.tensor(0.0)  # the second module's: the first is planned, not replaced
    with pytest.raises(InvalidInputError, match=r"weight_scale_2 must be positive and finite"):
        load_nvfp4(model, t, quantization_config=MODELOPT)
    assert type(model.up) is nn.Linear and _same(model, before)


# -- a second load ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_a_second_load_into_a_loaded_model_is_the_first(tmp_path, kind, mode):
    path = _save(tmp_path, _tensors(kind), MODELOPT if kind == "modelopt" else COMPRESSED)
    model = Net()
    load_nvfp4(model, path, mode=mode)
    want = model(X)
    first = _state(model)
    report = load_nvfp4(model, path, mode=mode)
    assert set(report.replaced) == {"up", "down"} and report.unused == [] and report.missing == []
    assert _same(model, first) and torch.equal(model(X), want)
    other = Net()  # a checkpoint of other weights into the loaded model: the other model's layers
    (tmp_path / "other").mkdir()
    path = _save(tmp_path / "other", _tensors(kind, seed=1), MODELOPT if kind == "modelopt" else COMPRESSED)
    load_nvfp4(other, path, mode=mode)
    load_nvfp4(model, path, mode=mode)
    assert torch.equal(model(X), other(X))


def test_a_loaded_layer_the_checkpoint_does_not_quantize_is_refused(tmp_path):
    model = Net()
    load_nvfp4(model, _tensors("modelopt"), quantization_config=MODELOPT)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: the model's 'up' is an Fp4Linear already \(made by "
                                                r"an earlier load\), but this checkpoint has it excluded by the "
                                                r"checkpoint \('up'\), so it cannot load into it\. Load into a model "
                                                r"built afresh"):
        load_nvfp4(model, _tensors("modelopt"), quantization_config={**MODELOPT, "exclude_modules": ["head", "up"]})


@pytest.mark.parametrize("strict", [True, False])
def test_a_module_the_config_excludes_but_the_checkpoint_stores_quantized_is_named(strict):
    """The packed weight was then compared as a plain tensor: "the checkpoint is not of this model"."""
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: module 'up' is excluded by the checkpoint's "
                                                r"quantization config \('up'\), but the checkpoint stores it quantized "
                                                r"\('up.weight' \(128, 32\) with block scales\): the config and the "
                                                r"tensors disagree\. Fix the exclusion list"):
        load_nvfp4(Net(), _tensors("modelopt"), quantization_config={**MODELOPT, "exclude_modules": ["head", "up"]},
                   strict=strict)


class TopKRouter(nn.Linear):
    """A router as PhiMoE's and Llama 4's: an nn.Linear whose forward returns more than x @ W.T."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.topk(2, dim=-1)


def test_an_nn_linear_subclass_with_its_own_forward_is_not_replaced():
    """It was replaced by a plain Fp4Linear, and the model failed on its first forward (a router's unpacking)."""
    model = Net()
    model.up = TopKRouter(64, 128)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: module 'up': TopKRouter is an nn.Linear with a forward "
                                                r"of its own, which an Fp4Linear \(x @ W.T \+ b\) would not compute, "
                                                r"and the checkpoint stores it quantized, .* The model is unchanged$"):
        load_nvfp4(model, _tensors("modelopt"), quantization_config=MODELOPT)
    assert type(model.up) is TopKRouter and type(model.down) is nn.Linear


def test_a_layers_constructor_error_names_its_module_once():
    t = _tensors("modelopt")
    t["up.weight_scale"] = t["up.weight_scale"].float()
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: module 'up': weight_scale must hold float8_e4m3fn block "
                                                r"scales \(or their uint8 bytes\); got dtype=torch.float32\..* The "
                                                r"model is unchanged$"):  # was "module 'up': module 'up': ..."
        load_nvfp4(Net(), t, quantization_config=MODELOPT)


def test_a_packed_weight_stored_with_a_float8_dtype_gets_the_bytes_fix():
    """Its float dtype read as "not quantized" first, and the message was "not of this model"."""
    t = _tensors("modelopt")
    t["up.weight"] = t["up.weight"].view(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: 'up.weight' has dtype torch.float8_e4m3fn; a packed "
                                                r"NVFP4 weight is uint8 \[N, K/2\] .* It holds bytes: store them as "
                                                r"uint8 \(t.view\(torch.uint8\), the same bytes\)$"):
        load_nvfp4(Net(), t, quantization_config=MODELOPT)


# -- a model on the meta device --------------------------------------------------------------------------------------
def test_a_model_on_the_meta_device_is_made_on_device_and_refused_without_it(tmp_path):
    path = _save(tmp_path, _tensors("modelopt"), MODELOPT)
    real = Net()
    load_nvfp4(real, path, mode="w4a16")
    with torch.device("meta"):
        model = Net()
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: the model's 'up' is on the meta device \(a model built "
                                                r"without memory\), so it cannot hold the checkpoint's tensors; pass "
                                                r"device= \(e\.g\. device='cuda'\)"):
        load_nvfp4(model, path, mode="w4a16")
    assert model.norm.weight.is_meta and type(model.up) is nn.Linear
    report = load_nvfp4(model, path, mode="w4a16", device="cpu")  # a non-persistent buffer is no strict matter
    assert report.on_meta == ["inv_freq"] and "on meta  inv_freq (no data)" in str(report)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert [n for n, t in tensors.items() if t.is_meta] == ["inv_freq"]
    assert isinstance(model.norm.weight, nn.Parameter) and model.norm.weight.requires_grad
    assert torch.equal(model(X), real(X))


def test_a_tied_weight_on_the_meta_device_stays_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 16)
            self.out = nn.Linear(16, 8, bias=False)
            self.out.weight = self.embed.weight

    with torch.device("meta"):
        model = Tied()
    w = torch.randn(8, 16)
    report = load_nvfp4(model, {"embed.weight": w}, quantization_config=MODELOPT, device="cpu")
    assert report.loaded == ["embed.weight"] and report.missing == [] and report.on_meta == []
    assert model.out.weight is model.embed.weight and torch.equal(model.embed.weight, w)


# -- what is wrong with the files ------------------------------------------------------------------------------------
def test_a_path_an_index_or_a_shard_that_is_wrong_is_named_before_the_model_changes(tmp_path):
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: checkpoint '/tmp/does/not/exist' does not exist; pass a "
                                                r"checkpoint folder"):
        load_nvfp4(Net(), "/tmp/does/not/exist")
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: checkpoint '/tmp/does/not' does not exist"):
        read_quantization_config("/tmp/does/not")
    path = _save(tmp_path, _tensors("modelopt"), MODELOPT, shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    model = Net()
    before = _state(model)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: model.safetensors.index.json maps \d+ tensors "
                                                r"\(first: '.*'\) to 'model-00002-of-00003.safetensors', which '.*' "
                                                r"does not hold \(1 of 3 shards missing: .*\): the checkpoint is "
                                                r"incomplete\. Fetch the missing shards$"):
        load_nvfp4(model, path)
    path = _save(tmp_path, _tensors("modelopt"), MODELOPT, shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    right = index["weight_map"]["up.weight"]
    index["weight_map"]["up.weight"] = next(f for f in index["weight_map"].values() if f != right)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidInputError, match=rf"^load_nvfp4: model.safetensors.index.json maps 'up.weight' to "
                                                rf"'.*', which does not hold it \(it is in '{right}'; 1 such in that "
                                                r"shard\): the index is not the shards'"):
        load_nvfp4(model, path)
    assert _same(model, before)


def test_a_layers_constructor_error_names_the_module_and_leaves_the_model_unchanged(tmp_path):
    """What a layer's constructor refuses (here two different per-shard weight scales of one fused weight) comes with
    the module load_nvfp4 was building, before the model changes."""
    t = _tensors("modelopt")
    t["down.weight_scale_2"] = torch.tensor([t["down.weight_scale_2"].item(), 2 * t["down.weight_scale_2"].item()])
    model = Net()
    before = _state(model)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: module 'down': Fp4Linear.from_modelopt: weight_scale_2 "
                                                r"has 2 different per-shard values .*\. The model is unchanged$"):
        load_nvfp4(model, _save(tmp_path, t, MODELOPT), mode="w4a16")
    assert type(model.down) is nn.Linear and _same(model, before)


def test_a_packed_weight_of_another_integer_dtype_and_a_bad_mode_are_named():
    t = _tensors("modelopt")
    t["up.weight"] = t["up.weight"].view(torch.int8)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: 'up.weight' has dtype torch.int8; a packed NVFP4 "
                                                r"weight is uint8 \[N, K/2\] \(two e2m1 per byte, low nibble = even "
                                                r"k\)\. It holds bytes: store them as uint8 \(t.view\(torch.uint8\), "
                                                r"the same bytes\)$"):
        load_nvfp4(Net(), t, quantization_config=MODELOPT)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: mode must be one of \('auto', 'w4a4', 'w4a16'\); got "
                                                r"'fp4'\. 'auto' picks W4A4"):
        load_nvfp4(Net(), _tensors("modelopt"), quantization_config=MODELOPT, mode="fp4")


# -- MoE experts -----------------------------------------------------------------------------------------------------
E, H, I = 3, 64, 32


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I))
        self.act_fn = nn.SiLU()


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()


def _experts(seed: int = 0) -> dict:
    g, t = torch.Generator().manual_seed(seed), {}
    for e in range(E):
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            q, s, gs = quantize_nvfp4(torch.randn(n, k, generator=g) * (e + 1), scale_layout="linear")
            p = f"experts.{e}.{proj}."
            t |= {p + "weight": q, p + "weight_scale": s, p + "weight_scale_2": (1 / gs).reshape(()),
                  p + "input_scale": torch.tensor(0.01 * (e + 1))}
    return t


def _route():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(6, H, generator=g).to(torch.bfloat16), torch.randint(0, E, (6, 2), generator=g),
            torch.rand(6, 2, generator=g))


def test_experts_load_again_and_report_which_projections_scale_statically():
    model = Moe()
    load_nvfp4(model, _experts(), quantization_config=MODELOPT, mode="w4a16")
    want = model.experts(*_route())
    report = load_nvfp4(model, _experts(), quantization_config=MODELOPT, mode="w4a16")
    assert isinstance(model.experts, Fp4MoeExperts) and torch.equal(model.experts(*_route()), want)
    assert report.replaced["experts"].endswith("activation scale static)")
    t = _experts()
    del t["experts.1.up_proj.input_scale"]
    report = load_nvfp4(Moe(), t, quantization_config=MODELOPT, mode="w4a4")
    assert report.replaced["experts"] == ("Fp4MoeExperts(3 experts, 64 -> 32 -> 64, mode=w4a4, activation scale "
                                          "static for gate, down; dynamic for up (not every expert stores one))")


def test_a_per_expert_scale_of_several_values_is_taken_as_fp4linear_takes_it():
    t = _experts()
    s2 = t["experts.1.up_proj.weight_scale_2"]
    want = Moe()
    load_nvfp4(want, t, quantization_config=MODELOPT, mode="w4a16")
    same = dict(t, **{"experts.1.up_proj.weight_scale_2": s2.reshape(1).repeat(2),
                      "experts.1.up_proj.input_scale": torch.tensor([0.001, 0.02])})  # the max, as Fp4Linear's
    model = Moe()
    load_nvfp4(model, same, quantization_config=MODELOPT, mode="w4a16")
    assert torch.equal(model.experts(*_route()), want.experts(*_route()))
    spread = dict(t, **{"experts.1.up_proj.weight_scale_2": torch.stack([s2, 2 * s2])})
    model = Moe()
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: experts module 'experts', up_proj \(experts.<e>.up_proj"
                                                r"\.\*\): experts.1.up_proj.weight_scale_2 has 2 different "
                                                r"per-shard values .*; fp4_grouped_mm applies one alpha per expert, "
                                                r"and taking their max would silently rescale the rest of the "
                                                r"expert's weight\. Requantize the expert's weight with one global "
                                                r"scale\. The model is unchanged$"):
        load_nvfp4(model, spread, quantization_config=MODELOPT)
    assert type(model.experts) is Experts
