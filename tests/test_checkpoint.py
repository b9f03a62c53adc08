"""``load_nvfp4`` with checkpoints written by the real clients on the CPU: a tiny transformers Llama, its Linear
weights quantized by NVIDIA ModelOpt (``NVFP4QTensor``, its pure-torch path) and by compressed-tensors (its NVFP4
preset and ``NVFP4PackedCompressor``), saved as sharded safetensors with the config each writes; loaded by fp4dispatch
and compared with the library's own decoding of the same tensors. Plus every error a user meets."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install fp4dispatch[test])")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

from fp4dispatch import InvalidInputError  # noqa: E402
from fp4dispatch.checkpoint import load_nvfp4, nvfp4_format, read_quantization_config  # noqa: E402
from fp4dispatch.nn import Fp4Linear  # noqa: E402

warnings.filterwarnings("ignore", message=".*transformers.*is not tested with current version of modelopt.*")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), cfg


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def _save(tmp_path, tensors: dict, cfg, qcfg: dict, shards: int = 2):
    """safetensors shards with an index, and config.json with the quantization_config, as exporters write them."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, str(tmp_path / fname))
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "quantization_config": qcfg}, default=str))
    return tmp_path


def _modelopt_checkpoint(tmp_path, model, cfg, input_scale: float | None = 0.02):
    """ModelOpt's export names: weight (uint8), weight_scale (e4m3), weight_scale_2 (fp32 0-d), input_scale; the
    reference weights are ModelOpt's own dequantize in float64 terms."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    tensors = {k: v for k, v in model.state_dict().items()}
    ref = {}
    for name, lin in _linears(model).items():
        q, s, s2 = NVFP4QTensor.quantize(lin.weight.detach().float(), 16)
        del tensors[f"{name}.weight"]
        tensors |= {f"{name}.weight": q._quantized_data, f"{name}.weight_scale": s,
                    f"{name}.weight_scale_2": s2.float().reshape(())}
        if input_scale is not None:
            tensors[f"{name}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
        ref[name] = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16}).double()
    qcfg = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    return _save(tmp_path, tensors, cfg, qcfg), ref


def _compressed_tensors_checkpoint(tmp_path, model, cfg):
    """compressed-tensors' NVFP4 preset: global scale by generate_gparam in the model's dtype (bf16), block scales by
    calculate_qparams, packed by NVFP4PackedCompressor; the reference is the stored tensors decoded with the
    library's own unpack (e2m1 * weight_scale / weight_global_scale)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    tensors = {k: v for k, v in model.state_dict().items()}
    ref = {}
    for name, lin in _linears(model).items():
        w = lin.weight.detach()
        n, k = w.shape
        gs = generate_gparam(w.min(), w.max(), dtype=w.dtype)
        scale, _ = calculate_qparams(w.reshape(n, k // 16, 16).amin(-1), w.reshape(n, k // 16, 16).amax(-1),
                                     scheme.weights, global_scale=gs)
        out = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        del tensors[f"{name}.weight"]
        # llm-compressor saves the global scales as fp32 tensors holding the bf16-computed value
        igs = generate_gparam(torch.tensor(-4.0), torch.tensor(4.0))
        tensors |= {f"{name}.weight_packed": out["weight_packed"], f"{name}.weight_scale": out["weight_scale"],
                    f"{name}.weight_global_scale": out["weight_global_scale"].float(),
                    f"{name}.input_global_scale": igs.float()}
        codes = unpack_fp4_from_uint8(out["weight_packed"], n, k, dtype=torch.float32).double()
        ref[name] = (codes * out["weight_scale"].double().repeat_interleave(16, dim=1)
                     / out["weight_global_scale"].double())
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized", ignore=["lm_head"],
                              quantization_status="compressed").model_dump(mode="json")
    return _save(tmp_path, tensors, cfg, qcfg), ref


def _modelopt_export(tmp_path, model, cfg):
    """ModelOpt end to end: ``mtq.quantize`` with NVFP4_DEFAULT_CFG (calibrated on a few tokens, on the CPU) and
    ``export_hf_checkpoint``; the reference is ModelOpt's own NVFP4QTensor decoding of the exported tensors."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors import safe_open

    model = copy.deepcopy(model)
    model.config.architectures = ["LlamaForCausalLM"]  # ModelOpt's export reads it
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(4))
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(tmp_path))
    ref = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.endswith(".weight_scale_2"):
                    name = k[: -len(".weight_scale_2")]
                    packed, scale = h.get_tensor(f"{name}.weight"), h.get_tensor(f"{name}.weight_scale")
                    q = NVFP4QTensor(torch.Size([packed.shape[0], packed.shape[1] * 2]), torch.float32, packed)
                    ref[name] = q.dequantize(dtype=torch.float32, scale=scale, double_scale=h.get_tensor(k),
                                             block_sizes={-1: 16}).double()
    return tmp_path, ref


CLIENTS = {"modelopt": _modelopt_checkpoint, "compressed-tensors": _compressed_tensors_checkpoint,
           "modelopt-export": _modelopt_export}
LIBRARY = {"modelopt": "modelopt.torch.quantization", "compressed-tensors": "compressed_tensors",
           "modelopt-export": "modelopt.torch.export"}


def _distance_from_decoded(model, src, ref) -> float:
    """Relative distance of ``model``'s logits from the source model's with each Linear replaced by the library's
    decoded weight (bf16): the same computation but for the decoded weights' bf16 rounding there."""
    want = copy.deepcopy(src)
    for name, w in ref.items():
        want.get_submodule(name).weight.data.copy_(w.to(torch.bfloat16))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = model(ids).logits.double(), want(ids).logits.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_real_clients_checkpoint_loads_layer_for_layer_exactly(tmp_path, client):
    pytest.importorskip(LIBRARY[client])
    src, cfg = _tiny_llama()
    path, ref = CLIENTS[client](tmp_path, src, cfg)
    model, _ = _tiny_llama(seed=1)  # other random weights: everything must come from the checkpoint
    report = load_nvfp4(model, path, mode="w4a16")
    assert report.format == client.removesuffix("-export") and set(report.replaced) == set(ref) and len(ref) == 14
    assert report.skipped == {"lm_head": "excluded by the checkpoint ('lm_head')"}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(report.loaded)
    assert report.unused == []
    torch.manual_seed(2)
    for name, w in ref.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Fp4Linear) and layer.resolved_mode(torch.device("cpu")) == "w4a16"
        x = torch.randn(5, layer.in_features).to(torch.bfloat16)
        exact = x.double() @ w.T
        # the fp32 sums and one rounding to bf16 at the end: within a bf16 ulp of the library's own decoding
        got = layer(x).double()
        assert bool(((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()), name
    assert _distance_from_decoded(model, src, ref) < 1e-2


@pytest.mark.parametrize("client", ["modelopt", "compressed-tensors"])
def test_static_activation_scales_are_the_stored_ones_and_can_be_turned_off(tmp_path, client):
    pytest.importorskip(LIBRARY[client])
    src, cfg = _tiny_llama()
    path, _ = CLIENTS[client](tmp_path, src, cfg)
    model, _ = _tiny_llama(seed=1)
    report = load_nvfp4(model, path, mode="w4a4")
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert "activation scale static" in report.replaced["model.layers.0.self_attn.q_proj"]
    if client == "modelopt":
        assert torch.equal(layer.input_scale.view(torch.float32), torch.tensor([0.02], dtype=torch.float32))
    else:  # the encode scale itself quantizes x, never 1/(1/x)
        assert torch.equal(layer.input_global_scale, layer._input_global_scale)
        stored = safetensors_torch.load_file(str(next(tmp_path.glob("*.safetensors"))))
        key = next(k for k in stored if k.endswith("input_global_scale"))
        assert torch.equal(layer.input_global_scale.view(torch.float32), stored[key].float().reshape(1))
    model2, _ = _tiny_llama(seed=1)
    report2 = load_nvfp4(model2, path, mode="w4a4", static_activation_scales=False)
    assert all("activation scale dynamic" in v for v in report2.replaced.values())


# -- errors --------------------------------------------------------------------------------------------------------
def _plain_checkpoint(tmp_path, qcfg: dict):
    model, cfg = _tiny_llama()
    return _save(tmp_path, dict(model.state_dict()), cfg, qcfg, shards=1)


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "modelopt", "quant_algo": "FP8"},
     r"^load_nvfp4: the checkpoint is ModelOpt 'FP8', not NVFP4\. fp4dispatch loads NVFP4 checkpoints of NVIDIA "
     r"ModelOpt"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
     r"^load_nvfp4: group_size must be 16 \(NVFP4: one e4m3 scale per 16 values\); got 32$"),
    ({"quant_method": "awq", "bits": 4},
     r"^load_nvfp4: quant_method 'awq' \(quant_algo None\) is not an NVFP4 checkpoint\. .* FP8, MXFP4, AWQ and GPTQ "
     r"checkpoints are other formats$"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}},
     r"^load_nvfp4: compressed-tensors group 'group_0' has format 'mxfp4-pack-quantized', not "
     r"'nvfp4-pack-quantized'\."),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}},
     r"^load_nvfp4: config_groups\.g\.weights\.group_size must be 16 .* got 32$"),
])
def test_a_checkpoint_that_is_not_nvfp4_is_refused_with_what_it_is(tmp_path, qcfg, message):
    path = _plain_checkpoint(tmp_path, qcfg)
    with pytest.raises(InvalidInputError, match=message):
        load_nvfp4(_tiny_llama()[0], path)


def test_missing_tensor_transposed_weight_and_a_state_dict_without_config(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    src, cfg = _tiny_llama()
    path, _ = _modelopt_checkpoint(tmp_path, src, cfg)
    files = sorted(path.glob("*.safetensors"))
    sd = {k: v for f in files for k, v in safetensors_torch.load_file(str(f)).items()}
    qcfg = read_quantization_config(path)
    assert nvfp4_format(qcfg).kind == "modelopt"
    name = "model.layers.1.mlp.down_proj"
    broken = {k: v for k, v in sd.items() if k != f"{name}.weight_scale_2"}
    with pytest.raises(InvalidInputError, match=rf"^load_nvfp4: module '{name}' is quantized in the checkpoint "
                                                rf"\('{name}.weight' is there\) but '{name}.weight_scale_2' is "
                                                r"missing; found \["):
        load_nvfp4(_tiny_llama()[0], broken, quantization_config=qcfg)
    q = "model.layers.0.mlp.gate_proj"  # Linear(64, 128): [N, K/2] = (128, 32); transposed (32, 128)
    flipped = dict(sd, **{f"{q}.weight": sd[f"{q}.weight"].T.contiguous()})
    with pytest.raises(InvalidInputError, match=rf"^load_nvfp4: '{q}.weight' has shape \(32, 128\); the model's "
                                                rf"'{q}' is Linear\(64, 128\), so \[N, K/2\] = \(128, 32\) was "
                                                r"expected\. It is \[K/2, N\]: the weight is stored transposed"):
        load_nvfp4(_tiny_llama()[0], flipped, quantization_config=qcfg)
    repacked = dict(sd, **{f"{q}.weight": sd[f"{q}.weight"].view(torch.int32)})
    with pytest.raises(InvalidInputError, match=r"weight must be uint8 \[N, K/2\] \(two e2m1 per byte\); got "
                                                r"torch.int32: a weight repacked into wider words"):
        load_nvfp4(_tiny_llama()[0], repacked, quantization_config=qcfg)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: checkpoint is a state dict: pass "
                                                r"quantization_config="):
        load_nvfp4(_tiny_llama()[0], sd)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))
    with pytest.raises(InvalidInputError, match=r"The checkpoint is not of this model$"):
        load_nvfp4(other, path)


def test_strict_loading_refuses_orphan_quantized_tensors_and_model_tensors_left_at_init(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    src, cfg = _tiny_llama()
    path, _ = _modelopt_checkpoint(tmp_path, src, cfg)
    sd = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in safetensors_torch.load_file(str(f)).items()}
    qcfg = read_quantization_config(path)
    # quantized tensors of modules the model does not have (experts of another model): nothing can take them
    q = "model.layers.0.mlp.gate_proj"
    experts = dict(sd, **{f"model.layers.0.mlp.experts.0.gate_proj.{k}": sd[f"{q}.{k}"]
                          for k in ("weight", "weight_scale", "weight_scale_2")})
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: 2 quantized checkpoint tensors have no nn.Linear or "
                                                r"transformers experts module in the model to take them \(first: \["
                                                r"'model.layers.0.mlp.experts.0.gate_proj.weight_scale', .*the model "
                                                r"keeps those weights another way, or it is not the checkpoint's "
                                                r"model"):
        load_nvfp4(_tiny_llama()[0], experts, quantization_config=qcfg)
    report = load_nvfp4(_tiny_llama()[0], experts, quantization_config=qcfg, strict=False)
    assert report.unused == sorted(f"model.layers.0.mlp.experts.0.gate_proj.{k}"
                                   for k in ("weight", "weight_scale", "weight_scale_2"))
    # a tensor of the model that the checkpoint lacks would keep its random initial value
    partial = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: 1 tensors of the model are not in the checkpoint and "
                                                r"would keep their initial values \(first: \['model.norm.weight'\]\)"):
        load_nvfp4(_tiny_llama()[0], partial, quantization_config=qcfg)
    assert load_nvfp4(_tiny_llama()[0], partial, quantization_config=qcfg, strict=False).missing == [
        "model.norm.weight"]


def test_stored_biases_load_and_a_missing_one_is_reported(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                   tie_word_embeddings=False)
    src = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    path, _ = _modelopt_checkpoint(tmp_path, src, cfg)
    sd = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in safetensors_torch.load_file(str(f)).items()}
    qcfg = read_quantization_config(path)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    load_nvfp4(model, sd, quantization_config=qcfg)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(model.get_submodule(q).bias, sd[f"{q}.bias"])
    partial = {k: v for k, v in sd.items() if k != f"{q}.bias"}
    with pytest.raises(InvalidInputError, match=rf"not in the checkpoint and would keep their initial values "
                                                rf"\(first: \['{q}.bias'\]\)"):
        load_nvfp4(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), partial, quantization_config=qcfg)
    report = load_nvfp4(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), partial, quantization_config=qcfg,
                        strict=False)
    assert report.missing == [f"{q}.bias"]


def test_a_stored_bias_the_models_linear_lacks_is_left_unused(tmp_path):
    """It was given to the Fp4Linear (q_proj(0) was the bias, not 0) and named neither loaded nor unused."""
    pytest.importorskip("modelopt.torch.quantization")
    src, cfg = _tiny_llama()  # attention_bias=False
    path, _ = _modelopt_checkpoint(tmp_path, src, cfg)
    sd = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in safetensors_torch.load_file(str(f)).items()}
    q = "model.layers.0.self_attn.q_proj"
    sd[f"{q}.bias"] = torch.ones(64, dtype=torch.bfloat16)
    model = _tiny_llama(seed=1)[0]
    report = load_nvfp4(model, sd, quantization_config=read_quantization_config(path))
    layer = model.get_submodule(q)
    assert isinstance(layer, Fp4Linear) and layer.bias is None and report.unused == [f"{q}.bias"]
    assert torch.equal(layer(torch.zeros(1, 64, dtype=torch.bfloat16)), torch.zeros(1, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("name, text, message", [
    ("config.json", "{", r"config.json' is not valid JSON \(Expecting property name enclosed in double quotes: line 1 "
                         r"column 2 \(char 1\)\); the checkpoint is damaged: fetch that file again$"),
    ("config.json", "[1]", r"config.json' must hold a JSON object; got list\. The checkpoint is damaged: fetch that "
                           r"file again$"),
    ("model.safetensors.index.json", '{"metadata": {}}',
     r"model.safetensors.index.json' must hold an object with a 'weight_map' object; got NoneType\. The checkpoint "
     r"is damaged"),
    ("model.safetensors.index.json", '{"weight_map": {', r"model.safetensors.index.json' is not valid JSON"),
])
def test_a_damaged_json_file_of_the_checkpoint_is_named(tmp_path, name, text, message):
    """They raised a bare KeyError or JSONDecodeError that named no file."""
    model, cfg = _tiny_llama()
    _save(tmp_path, {"x": torch.zeros(1)}, cfg, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
    (tmp_path / name).write_text(text)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: '.*" + message):
        load_nvfp4(model, tmp_path)


def test_a_bare_linear_cannot_be_replaced_in_place():
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: model is an nn.Linear itself; it can only replace "
                                                r"Linear submodules\. Wrap it"):
        load_nvfp4(torch.nn.Linear(32, 16), {}, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})


def test_a_folder_without_a_quantization_config_says_so(tmp_path):
    model, cfg = _tiny_llama()
    safetensors_torch.save_file(dict(model.state_dict()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(InvalidInputError, match=r"has no quantization_config in config.json and no "
                                                r"hf_quant_config.json: it is not a quantized checkpoint"):
        load_nvfp4(model, tmp_path)


_CW, _CS = torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 4).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("args, message", [
    pytest.param((_CW, _CS, torch.tensor([0.0])),
                 r"^Fp4Linear.from_compressed_tensors: weight_global_scale must be positive and finite \(an encode "
                 r"scale 448\*6/amax\); got \[0.0\]$", id="zero-global-scale"),
    pytest.param((_CW, _CS, torch.tensor([2.0, 3.0])),
                 r"^Fp4Linear.from_compressed_tensors: weight_global_scale has 2 different per-shard values",
                 id="shards"),
    pytest.param((_CW, _CS.T.contiguous(), torch.tensor([2.0])),
                 r"^Fp4Linear.from_compressed_tensors: weight_scale must be linear \[N, K/16\]=\(8, 4\) for "
                 r"weight_packed \(8, 32\); got shape=\(4, 8\)\. It is \[K/16, N\]: weight_packed and "
                 r"weight_scale look transposed", id="transposed-scale"),
    pytest.param((_CW.view(torch.int32), _CS, torch.tensor([2.0])),
                 r"^Fp4Linear.from_compressed_tensors: weight_packed must be uint8 \[N, K/2\] \(two e2m1 per byte\); "
                 r"got torch.int32: a weight repacked into wider words", id="int32"),
    pytest.param((_CW, _CS, torch.tensor([2.0]), torch.tensor([float("inf")])),
                 r"^Fp4Linear.from_compressed_tensors: input_global_scale must be positive and finite", id="igs"),
    # its fix was the weight shards' ("requantize the fused weight"), wrong for an activation scale
    pytest.param((_CW, _CS, torch.tensor([2.0]), torch.tensor([100.0, 200.0])),
                 r"^Fp4Linear.from_compressed_tensors: input_global_scale has 2 different per-shard values \[100.0, "
                 r"200.0\]; one encode scale quantizes the input of the whole fused layer\. Store the smallest of "
                 r"them as its input_global_scale \(no shard's activations then saturate\), or pass None for per-call "
                 r"scaling$", id="igs-shards"),
    # it named the scales' shape (8, 0) first, a K/16 that is not a whole number
    pytest.param((_CW[:, :4], _CS[:, :1], torch.tensor([2.0])),
                 r"^Fp4Linear.from_compressed_tensors: K=2\*weight_packed.shape\[1\]=8 must be a multiple of 16 \(one "
                 r"e4m3 scale per 16 values\); got weight_packed.shape=\(8, 4\)$", id="k-8"),
])
def test_from_compressed_tensors_errors(args, message):
    with pytest.raises(InvalidInputError, match=message):
        Fp4Linear.from_compressed_tensors(*args)


def test_a_model_that_reads_a_linears_weight_directly_is_told_it_is_quantized(tmp_path):
    """Jamba's mamba mixer computes ``dt_proj.weight @ x`` unless ``config._is_quantized`` is set, as transformers'
    own quantizers set it; with the packed weight there the first forward raised (a shape mismatch). load_nvfp4 sets
    it on every config of the model, and the model computes what the decoded weights give."""
    pytest.importorskip("modelopt")
    torch.manual_seed(0)
    cfg = transformers.JambaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   num_experts=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=8,
                                   mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=16, use_mamba_kernels=False,
                                   tie_word_embeddings=False)
    src = transformers.JambaForCausalLM(cfg).to(torch.bfloat16).eval()
    path, ref = _modelopt_checkpoint(tmp_path, src, cfg, input_scale=None)
    assert "model.layers.1.mamba.dt_proj" in ref
    model = transformers.JambaForCausalLM(cfg).to(torch.bfloat16).eval()
    report = load_nvfp4(model, path, mode="w4a16")
    assert set(report.replaced) == set(ref)
    assert _distance_from_decoded(model, src, ref) < 1e-2 and model.config._is_quantized is True
    assert "_is_quantized" not in json.dumps(model.config.to_dict(), default=str)  # transformers does not save it


def test_a_linear_whose_parent_reads_its_weight_itself_is_refused_where_quantized(tmp_path):
    """Mamba's mixer computes ``dt_proj.weight @ x`` whatever the config says: its first forward raised on the packed
    weight. Refused, naming the parent, before the model changes; the checkpoint with dt_proj left unquantized
    loads."""
    pytest.importorskip("modelopt")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=96, hidden_size=64, state_size=8, num_hidden_layers=1, expand=2,
                                   conv_kernel=4, time_step_rank=16, tie_word_embeddings=False)
    src = transformers.MambaForCausalLM(cfg).to(torch.bfloat16).eval()
    path, _ = _modelopt_checkpoint(tmp_path, src, cfg, input_scale=None)
    model = transformers.MambaForCausalLM(cfg).to(torch.bfloat16).eval()
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: module 'backbone\.layers\.0\.mixer\.dt_proj': its "
                                                r"parent, a MambaMixer, reads dt_proj\.weight itself in its forward "
                                                r"\(weight @ x\), which a packed weight would not compute, and the "
                                                r"checkpoint stores it quantized, so it cannot load into this model\. "
                                                r"The model is unchanged\. Export the model with that module "
                                                r"unquantized \(ModelOpt's exclude_modules, compressed-tensors' "
                                                r"ignore\)$"):
        load_nvfp4(model, path)
    assert not any(isinstance(m, Fp4Linear) for m in model.modules())
    stem = "backbone.layers.0.mixer.dt_proj"
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors |= safetensors_torch.load_file(str(f))
        f.unlink()
    tensors = {k: v for k, v in tensors.items() if not k.startswith(stem + ".")}
    tensors |= {f"{stem}.{k}": v for k, v in src.get_submodule(stem).state_dict().items()}
    _save(path, tensors, cfg, json.loads((path / "config.json").read_text())["quantization_config"])
    report = load_nvfp4(model, path, mode="w4a16")
    assert report.skipped[stem] == "not quantized in the checkpoint (weight is torch.bfloat16)"
    assert isinstance(model.get_submodule("backbone.layers.0.mixer.x_proj"), Fp4Linear)
    with torch.no_grad():
        assert bool(torch.isfinite(model(torch.randint(0, 96, (1, 8))).logits).all())


def test_a_replaced_module_keeps_the_models_eval_mode_and_its_forward_hooks(tmp_path):
    """The new layers were built in training mode inside a model set to eval(), and hooks registered on the replaced
    nn.Linear stopped firing."""
    pytest.importorskip("modelopt")
    src, cfg = _tiny_llama()
    path, _ = _modelopt_checkpoint(tmp_path, src, cfg, input_scale=None)
    model, _ = _tiny_llama(seed=1)
    model.eval()
    seen = []
    down = model.model.layers[0].mlp.down_proj
    post = down.register_forward_hook(lambda mod, args, out: seen.append(("post", type(mod).__name__, out.shape)))
    pre = down.register_forward_pre_hook(lambda mod, args: seen.append(("pre", type(mod).__name__)))
    load_nvfp4(model, path, mode="w4a16")
    assert not any(m.training for m in model.modules())
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        model(ids)
    assert seen == [("pre", "Fp4Linear"), ("post", "Fp4Linear", (1, 5, 64))]
    post.remove(), pre.remove()  # the handles still reach them
    with torch.no_grad():
        model(ids)
    assert len(seen) == 2
