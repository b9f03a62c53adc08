"""``load_nvfp4`` with MoE checkpoints: a tiny transformers Qwen3-MoE (its experts the stacked transformers 5 form,
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) whose Linear layers and per-expert projections are quantized
by ModelOpt's ``NVFP4QTensor`` and by compressed-tensors' NVFP4 compressor under the names their exports use
(``experts.<e>.gate_proj.*``); loaded into ``Fp4MoeExperts`` and compared with the model run on the library-decoded
weights. Plus ``Fp4MoeExperts`` against a per-token reference, and the errors a user meets."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install fp4dispatch[test])")
pytest.importorskip("safetensors.torch", reason="needs safetensors")

import test_checkpoint as tc  # noqa: E402
from fp4dispatch import InvalidInputError  # noqa: E402
from fp4dispatch.checkpoint import load_nvfp4  # noqa: E402
from fp4dispatch.experts import Fp4Experts  # noqa: E402
from fp4dispatch.moe import Fp4MoeExperts  # noqa: E402

warnings.filterwarnings("ignore", message=".*transformers.*is not tested with current version of modelopt.*")
E, TOP_K = 8, 2


def _tiny_moe(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=E, num_experts_per_tok=TOP_K, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval(), cfg


def _expert_weights(model):
    """(experts module name, e, projection, float weight [N, K]) of every routed expert's gate, up and down."""
    for name, mod in model.named_modules():
        if hasattr(mod, "gate_up_proj") and getattr(mod, "gate_up_proj").dim() == 3:
            i = mod.down_proj.shape[2]
            for e in range(mod.gate_up_proj.shape[0]):
                gu = mod.gate_up_proj[e].detach()
                yield name, e, "gate_proj", gu[:i]
                yield name, e, "up_proj", gu[i:]
                yield name, e, "down_proj", mod.down_proj[e].detach()


def _modelopt_moe(tmp_path, model, cfg, input_scale=0.05):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    path, ref = tc._modelopt_checkpoint(tmp_path, model, cfg, input_scale=input_scale)
    tensors = {k: v for f in path.glob("*.safetensors") for k, v in _read(f).items()}
    for name, e, proj, w in _expert_weights(model):
        q, s, s2 = NVFP4QTensor.quantize(w.float(), 16)
        p = f"{name}.{e}.{proj}"
        tensors |= {f"{p}.weight": q._quantized_data, f"{p}.weight_scale": s,
                    f"{p}.weight_scale_2": s2.float().reshape(()),
                    f"{p}.input_scale": torch.tensor(input_scale * (1 + e / 16), dtype=torch.float32)}
        ref[p] = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16}).double()
    return _rewrite(path, tensors, model, cfg), ref


def _compressed_tensors_moe(tmp_path, model, cfg):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    path, ref = tc._compressed_tensors_checkpoint(tmp_path, model, cfg)
    tensors = {k: v for f in path.glob("*.safetensors") for k, v in _read(f).items()}
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    for name, e, proj, w in _expert_weights(model):
        n, k = w.shape
        gs = generate_gparam(w.min(), w.max(), dtype=w.dtype)
        blocks = w.reshape(n, k // 16, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
        out = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        p = f"{name}.{e}.{proj}"
        tensors |= {f"{p}.weight_packed": out["weight_packed"], f"{p}.weight_scale": out["weight_scale"],
                    f"{p}.weight_global_scale": out["weight_global_scale"].float()}
        codes = unpack_fp4_from_uint8(out["weight_packed"], n, k, dtype=torch.float32).double()
        ref[p] = codes * out["weight_scale"].double().repeat_interleave(16, 1) / out["weight_global_scale"].double()
    return _rewrite(path, tensors, model, cfg), ref


def _read(f):
    from safetensors import safe_open

    with safe_open(str(f), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def _rewrite(path, tensors, model, cfg):
    """The checkpoint as the exporters write a MoE model: per-expert modules instead of the stacked parameters."""
    import json

    for f in path.glob("*.safetensors"):
        f.unlink()
    stacked = {f"{n}.{p}" for n, m in model.named_modules() if hasattr(m, "gate_up_proj") for p in
               ("gate_up_proj", "down_proj")}
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    return tc._save(path, {k: v for k, v in tensors.items() if k not in stacked}, cfg, qcfg)


def _decoded_model(model, ref):
    """The bf16 model whose every quantized weight is the library's own decoding of the stored tensors."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, lin in tc._linears(m).items():
            lin.weight.copy_(ref[name].to(torch.bfloat16))
        for name, mod in m.named_modules():
            if hasattr(mod, "gate_up_proj") and mod.gate_up_proj.dim() == 3:
                for e in range(mod.gate_up_proj.shape[0]):
                    mod.gate_up_proj[e].copy_(torch.cat([ref[f"{name}.{e}.gate_proj"], ref[f"{name}.{e}.up_proj"]]))
                    mod.down_proj[e].copy_(ref[f"{name}.{e}.down_proj"])
    return m


# (MoE block, logits) relative distance from the model on the decoded weights, measured: W4A16 0.006-0.007 (bf16
# rounding), W4A4 0.13-0.17 (the activations rounded to NVFP4); an expert's weight in another's place costs 0.66
BOUNDS = {"w4a16": 0.02, "w4a4": 0.3}


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("client", ["modelopt", "compressed-tensors"])
def test_a_moe_checkpoint_loads_its_experts_into_fp4_moe_experts(tmp_path, client, mode):
    pytest.importorskip(tc.LIBRARY[client])
    src, cfg = _tiny_moe()
    path, ref = (_modelopt_moe if client == "modelopt" else _compressed_tensors_moe)(tmp_path, src, cfg)
    model, _ = _tiny_moe(seed=1)
    report = load_nvfp4(model, path, mode=mode)
    experts = {n for n, what in report.replaced.items() if what.startswith("Fp4MoeExperts")}
    assert experts == {f"model.layers.{i}.mlp.experts" for i in range(2)}, report.replaced
    assert report.unused == [] and report.missing == []
    layer = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(layer, Fp4MoeExperts) and layer.gate.num_experts == E
    assert ("static" in report.replaced["model.layers.0.mlp.experts"]) == (client == "modelopt")
    assert layer.gate.resolved_mode(torch.device("cpu")) == mode
    # each expert's weight is the library's own decoding of what it stored
    from fp4dispatch.format import dequantize_nvfp4

    for e in (0, E - 1):
        got = dequantize_nvfp4(layer.down.weight[e], layer.down.weight_scale[e].view(torch.float8_e4m3fn),
                               dtype=torch.float32).double() * layer.down.weight_scale_2.view(torch.float32)[e].double()
        want = ref[f"model.layers.0.mlp.experts.{e}.down_proj"]
        torch.testing.assert_close(got, want, rtol=2 ** -23, atol=0)
    decoded = _decoded_model(src, ref)
    h = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = (m.model.layers[0].mlp(h).double() for m in (model, decoded))
        assert float((got - want).norm() / want.norm()) < BOUNDS[mode]
        got, want = (m(ids, use_cache=False).logits.double() for m in (model, decoded))
    assert float((got - want).norm() / want.norm()) < BOUNDS[mode]


def _moe_module(input_scale, mode="auto"):
    g = torch.Generator().manual_seed(0)
    h, i = 64, 32

    def proj(n, k):
        w = torch.randn(E, n, k, generator=g) * 0.1
        from fp4dispatch.format import quantize_nvfp4

        packed, scales, decode = [], [], []
        for x in w:
            p, s, gs = quantize_nvfp4(x, scale_layout="linear")
            packed.append(p), scales.append(s), decode.append(1.0 / gs)
        return Fp4Experts.from_modelopt(packed, scales, decode, input_scale, mode=mode)

    return Fp4MoeExperts(proj(i, h), proj(i, h), proj(h, i), torch.nn.SiLU())


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_fp4_moe_experts_equals_one_token_at_a_time_and_drops_slots_of_other_ranks(mode):
    """With a static activation scale each routed row is quantized on its own: the layer must equal computing every
    (token, slot) alone through the same Fp4Experts; a slot whose index is E (another rank's expert, as transformers
    marks it) adds nothing."""
    layer = _moe_module(input_scale=0.02, mode=mode)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, E, (6, TOP_K), generator=g)
    idx[2, 1] = E  # routed to no expert of this module
    w = torch.rand(6, TOP_K, generator=g)
    got = layer(x, idx, w).float()
    want = torch.zeros(6, 64)
    for t in range(6):
        for j in range(TOP_K):
            e = int(idx[t, j])
            if e >= E:
                continue
            offs = torch.zeros(E, dtype=torch.int32)
            offs[e:] = 1
            row = x[t:t + 1]
            mid = torch.nn.functional.silu(layer.gate(row, offs)) * layer.up(row, offs)
            want[t] += layer.down(mid, offs)[0].float() * w[t, j]
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-3)
    assert torch.equal(layer(x, idx, w).view(torch.int16), got.to(torch.bfloat16).view(torch.int16))  # same bits


def test_fp4_moe_experts_with_a_dynamic_scale_gives_rows_of_other_ranks_no_say_in_it():
    """Dynamic W4A4 scales all routed rows by one amax: the slots of another rank's experts (computed on expert E-1,
    then dropped) must not move it. This rank's outputs stay the same bits when a token routed only elsewhere grows
    1000-fold, and equal a call without that token."""
    layer = _moe_module(input_scale=None, mode="w4a4")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, E, (6, TOP_K), generator=g)
    idx[2] = torch.tensor([E, -1])  # token 2: another rank's experts only
    idx[4, 0] = E  # token 4: one slot here, one elsewhere
    w = torch.rand(6, TOP_K, generator=g)
    got = layer(x, idx, w)
    loud = x.clone()
    loud[2] *= 1000
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(layer(loud, idx, w)[keep].view(torch.int16), got[keep].view(torch.int16))
    assert torch.equal(layer(x[keep], idx[keep], w[keep]).view(torch.int16), got[keep].view(torch.int16))
    assert not got[2].any() and got[keep].abs().sum(1).min() > 0


@pytest.mark.parametrize("mode, input_scale", [("w4a16", None), ("w4a4", None), ("w4a4", 0.05)])
def test_fp4_moe_experts_compiles_fullgraph_equal_to_eager_for_any_batch(mode, input_scale):
    """No graph break (the argument checks are on metadata, the routing is sorted and counted on the device; a static
    activation scale's CPU value is not read while tracing) and the compiled layer gives eager's bits at every T, int32
    ids included."""
    layer = _moe_module(input_scale=input_scale, mode=mode)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    g = torch.Generator().manual_seed(2)
    for t in (5, 3, 9):
        x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
        idx = torch.randint(-1, E + 1, (t, TOP_K), generator=g, dtype=torch.int32)  # other ranks' slots too
        w = torch.rand(t, TOP_K, generator=g)
        assert torch.equal(compiled(x, idx, w), layer(x, idx, w)), t


def test_fp4_moe_experts_refuses_mismatched_projections_and_routing():
    layer = _moe_module(input_scale=None)
    with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: up must be Fp4Experts\(E=8, in=64, out=32\) to "
                                                r"match down \(E=8, in=32, out=64\); got E=8, in=32, out=64$"):
        Fp4MoeExperts(layer.gate, layer.down, layer.down, torch.nn.SiLU())
    with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: top_k_index and top_k_weights must both be "
                                                r"\[T=3, k\]; got \(3, 2\) and \(3, 1\)$"):
        layer(torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1))
    with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: hidden_states must be \[T, 64\]; got \(3, 32\)$"):
        layer(torch.zeros(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))
    assert layer(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 64)
    # each was a raw AttributeError, or a TypeError at the first forward
    with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: down must be an Fp4Experts \(the E experts' down "
                                                r"projections\); got Linear\. Build it with "
                                                r"Fp4Experts.from_modelopt or from_compressed_tensors, or load the "
                                                r"model with load_nvfp4$"):
        Fp4MoeExperts(layer.gate, layer.up, torch.nn.Linear(32, 64), torch.nn.SiLU())
    with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: act_fn must be the activation module or function "
                                                r"applied to the gate projection \(e.g. nn.SiLU\(\)\); got NoneType$"):
        Fp4MoeExperts(layer.gate, layer.up, layer.down, None)


def test_fp4_moe_experts_output_has_no_autograd_history_as_every_result():
    """Routing weights that require grad (a router's output, without no_grad) gave the output a history through them
    alone: backward() ran and gave the router a gradient, the experts none, silently."""
    layer = _moe_module(input_scale=None, mode="w4a16")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    w = torch.rand(5, TOP_K, generator=g, requires_grad=True)
    idx = torch.randint(0, E, (5, TOP_K), generator=g)
    y = layer(x, idx, w)
    assert not y.requires_grad and y.grad_fn is None
    assert torch.equal(y, layer(x.detach(), idx, w.detach()))


@pytest.mark.parametrize("args, said", [
    pytest.param((None, "idx", "w"), r"hidden_states must be a float32, bfloat16 or float16 tensor \[T, H\] \(the "
                 r"tokens\); got NoneType", id="x-none"),
    pytest.param(("x_int", "idx", "w"), r"hidden_states must be .*; got dtype=torch.int64", id="x-int"),
    pytest.param(("x", [[0, 1]] * 3, "w"), r"top_k_index must be an integer tensor \[T, k\] \(each token's expert "
                 r"ids\); got list", id="idx-list"),
    pytest.param(("x", "idx_float", "w"), r"top_k_index must be an integer tensor .*; got dtype=torch.float32",
                 id="idx-float"),  # was truncated to an expert id without a word
    pytest.param(("x", "idx_bool", "w"), r"top_k_index must be .*; got dtype=torch.bool", id="idx-bool"),
    pytest.param(("x", "idx", "w_int"), r"top_k_weights must be a floating-point tensor \[T, k\] \(the routing "
                 r"weights\); got dtype=torch.int64", id="w-int"),
])
def test_fp4_moe_experts_refuses_arguments_of_the_wrong_kind(args, said):
    layer = _moe_module(input_scale=None)
    have = {"x": torch.zeros(3, 64), "x_int": torch.zeros(3, 64, dtype=torch.long),
            "idx": torch.zeros(3, 2, dtype=torch.long), "idx_float": torch.full((3, 2), 1.7),
            "idx_bool": torch.ones(3, 2, dtype=torch.bool), "w": torch.ones(3, 2),
            "w_int": torch.ones(3, 2, dtype=torch.long)}
    fix = (r"Cast the tokens to the model's dtype" if said.startswith("hidden_states") else
           r"Pass the router's outputs as transformers does \(top_k_index: the int64 indices of topk\)")
    with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: " + said + r"\. " + fix + "$"):
        layer(*[have[a] if isinstance(a, str) else a for a in args])
    assert layer(have["x"], have["idx"].int(), have["w"].bfloat16()).shape == (3, 64)  # int32 ids, bf16 weights
    for idx, w in ((have["idx"].to("meta"), have["w"]), (have["idx"], have["w"].to("meta"))):  # another device
        with pytest.raises(InvalidInputError, match=r"^Fp4MoeExperts: hidden_states, top_k_index and top_k_weights "
                                                    r"must be on one device; got cpu, .* and .*\. Move the router's "
                                                    r"outputs to the tokens' device$"):
            layer(have["x"], idx, w)


def test_a_missing_expert_tensor_is_named_with_its_module(tmp_path):
    pytest.importorskip(tc.LIBRARY["modelopt"])
    src, cfg = _tiny_moe()
    path, _ = _modelopt_moe(tmp_path, src, cfg)
    state = {k: v for f in path.glob("*.safetensors") for k, v in _read(f).items()}
    del state["model.layers.1.mlp.experts.5.up_proj.weight_scale_2"]
    qcfg = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    model, _ = _tiny_moe(seed=1)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: experts module 'model.layers.1.mlp.experts' is "
                                                r"quantized in the checkpoint but 'model.layers.1.mlp.experts.5."
                                                r"up_proj.weight_scale_2' is missing \(the model has 8 experts\)$"):
        load_nvfp4(model, state, quantization_config=qcfg)


def test_experts_the_checkpoint_leaves_unquantized_stay_and_load_as_they_are(tmp_path):
    pytest.importorskip(tc.LIBRARY["modelopt"])
    src, cfg = _tiny_moe()
    path, _ = tc._modelopt_checkpoint(tmp_path, src, cfg)  # Linear layers only: the stacked experts stay bf16
    model, _ = _tiny_moe(seed=1)
    report = load_nvfp4(model, path)
    assert report.skipped["model.layers.0.mlp.experts"].startswith("experts not quantized in the checkpoint")
    assert "model.layers.0.mlp.experts.gate_up_proj" in report.loaded
    assert torch.equal(model.get_submodule("model.layers.0.mlp.experts").down_proj,
                       src.get_submodule("model.layers.0.mlp.experts").down_proj)


class _Experts(torch.nn.Module):
    def __init__(self, gate_up_shape, down_shape, bias=False):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(gate_up_shape))
        self.down_proj = torch.nn.Parameter(torch.zeros(down_shape))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(gate_up_shape[:2])) if bias else None
        self.act_fn = torch.nn.SiLU()


class _Computing(_Experts):
    """An experts module with transformers' forward (per routed slot act_fn(gate) * up, then down, weighted), and
    ``variant`` as families change it: a clamp (DeepSeek-V4's swiglu_limit), a norm of its own (MuseSpark's), a
    two-argument activation (Inkling2's)."""

    def __init__(self, variant=None):
        super().__init__((2, 64, 64), (2, 64, 32))
        self.variant = variant
        if variant == "norm":
            self.post_norm = torch.nn.LayerNorm(64)
        if variant == "two-argument":
            self.act_fn = type("GatedSiLU", (torch.nn.Module,), {"forward": lambda self, g, u: F.silu(g) * u})()

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for s in range(idx.shape[1]):
                gate, up = (self.gate_up_proj[idx[t, s]] @ x[t]).chunk(2)
                if self.variant == "clamp":
                    gate, up = gate.clamp(max=10.0), up.clamp(-10.0, 10.0)
                h = self.act_fn(gate, up) if self.variant == "two-argument" else self.act_fn(gate) * up
                out[t] += w[t, s] * (self.down_proj[idx[t, s]] @ h)
        return self.post_norm(out) if self.variant == "norm" else out


@pytest.mark.parametrize("variant, said", [
    ("clamp", r"its forward does not compute act_fn\(gate\) \* up, then down_proj, as an Fp4MoeExperts does \(on "
              r"small random weights they differ by .* relative: a clamp, a norm or another gate\)"),
    ("norm", r"it holds \['post_norm'\] beside gate_up_proj, down_proj and act_fn, which an Fp4MoeExperts would drop"),
    ("two-argument", r"its forward could not be checked against act_fn\(gate\) \* up, then down_proj \(TypeError"),
])
def test_experts_whose_forward_computes_something_else_are_refused(variant, said):
    """They loaded silently and computed without the clamp or the norm, or failed on their first forward."""
    model = torch.nn.Module()
    model.experts = _Computing(variant)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: experts module 'experts' \(_Computing\): " + said):
        load_nvfp4(model, _expert_state(2, 64, 32), quantization_config=QCFG)
    assert type(model.experts) is _Computing
    plain = torch.nn.Module()
    plain.experts = _Computing()  # transformers' maths: replaced
    load_nvfp4(plain, _expert_state(2, 64, 32), quantization_config=QCFG)
    assert isinstance(plain.experts, Fp4MoeExperts)


def _expert_state(e, h, i, gate_shape=None):
    from fp4dispatch.format import quantize_nvfp4

    sd = {}
    for x in range(e):
        for proj, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            p, s, gs = quantize_nvfp4(torch.randn(n, k), scale_layout="linear")
            if proj == "gate_proj" and gate_shape is not None:
                p = torch.zeros(gate_shape, dtype=torch.uint8)
            sd |= {f"experts.{x}.{proj}.weight": p, f"experts.{x}.{proj}.weight_scale": s,
                   f"experts.{x}.{proj}.weight_scale_2": (1.0 / gs).reshape(())}
    return sd


QCFG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


@pytest.mark.parametrize("shapes, bias, got", [
    (((2, 64, 64), (2, 32, 64)), False, r"gate_up_proj \[E, 2I, H\] \(got \(2, 64, 64\)\), down_proj \[E, H, I\] "
                                        r"\(got \(2, 32, 64\)\), an act_fn module \(got SiLU\) and no biases "
                                        r"\(got none\)"),
    (((2, 64, 64), (2, 64, 32)), True, r".*\(got \['gate_up_proj_bias'\]\); strict=False leaves it as it is"),
], ids=["transposed-layout", "biased"])
def test_experts_of_another_form_are_refused_with_what_was_expected(shapes, bias, got):
    model = torch.nn.Module()
    model.experts = _Experts(*shapes, bias=bias)
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: experts module 'experts' \(_Experts\) is not of the "
                                                r"form fp4dispatch replaces: " + got):
        load_nvfp4(model, _expert_state(2, 64, 32), quantization_config=QCFG)
    report = load_nvfp4(model, _expert_state(2, 64, 32), quantization_config=QCFG, strict=False)
    assert report.skipped["experts"].startswith("experts module 'experts' (_Experts) is not of the form")
    assert "experts.0.gate_proj.weight" in report.unused and isinstance(model.experts, _Experts)


def test_an_expert_weight_stored_transposed_is_named():
    model = torch.nn.Module()
    model.experts = _Experts((2, 96, 64), (2, 64, 48))
    with pytest.raises(InvalidInputError, match=r"^load_nvfp4: 'experts.0.gate_proj.weight' has shape \(32, 48\); "
                                                r"the model's experts need \[N, K/2\] = \(48, 32\) \(stored "
                                                r"transposed\)$"):
        load_nvfp4(model, _expert_state(2, 64, 48, gate_shape=(32, 48)), quantization_config=QCFG)
    model.experts = _Experts((2, 64, 64), (2, 64, 32))
    report = load_nvfp4(model, _expert_state(2, 64, 32), quantization_config=QCFG)
    assert report.replaced == {"experts": "Fp4MoeExperts(2 experts, 64 -> 32 -> 64, mode=auto, activation scale "
                                          "dynamic)"}


def _as_exported_block_sparse_moe(src, router: str = "") -> dict:
    """``src``'s state dict named as Mixtral's and PhiMoE's exported checkpoints name it: block_sparse_moe for mlp,
    the router (``router``: the model's name for it) as gate, and each expert's w1/w3/w2 quantized (ModelOpt's
    names)."""
    from fp4dispatch.format import quantize_nvfp4

    sd = {k.replace(".mlp.", ".block_sparse_moe.").replace(router or ".gate.", ".gate."): v
          for k, v in src.state_dict().items() if ".experts." not in k}
    for name, e, proj, w in _expert_weights(src):
        p, s, gs = quantize_nvfp4(w.float(), scale_layout="linear")
        exported = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
        stem = f"{name.replace('.mlp.', '.block_sparse_moe.')}.{e}.{exported}"
        sd |= {f"{stem}.weight": p, f"{stem}.weight_scale": s, f"{stem}.weight_scale_2": (1 / gs).reshape(())}
    return sd


def test_a_checkpoint_named_as_exported_loads_by_the_names_transformers_gives_its_model():
    """Mixtral's exported checkpoints name the experts block_sparse_moe.experts.E.w1/w3/w2, which transformers 5
    renames to mlp. when it loads: every quantized tensor was refused as having no module to take it."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=False)
    src = transformers.MixtralForCausalLM(cfg).eval()
    sd = _as_exported_block_sparse_moe(src)
    model = transformers.MixtralForCausalLM(cfg).eval()
    report = load_nvfp4(model, sd, quantization_config={**QCFG, "exclude_modules": ["lm_head", "*self_attn*"]})
    assert isinstance(model.model.layers[0].mlp.experts, Fp4MoeExperts) and report.unused == []
    assert "model.layers.0.block_sparse_moe.gate.weight" in report.loaded  # as the checkpoint names it


def test_an_exclusion_that_names_a_module_as_the_checkpoint_does_applies_to_the_renamed_module():
    """PhiMoE's checkpoints name its router block_sparse_moe.gate, which transformers 5 renames to mlp.router: an
    exclusion by the stored name was not seen, and the router was reported as 'not quantized' rather than excluded."""
    torch.manual_seed(0)
    cfg = transformers.PhimoeConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                    num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=False)
    src = transformers.PhimoeForCausalLM(cfg).eval()
    stored = _as_exported_block_sparse_moe(src, router=".router.")
    model = transformers.PhimoeForCausalLM(cfg).eval()
    qcfg = {**QCFG, "exclude_modules": ["lm_head", "*self_attn*", "model.layers.0.block_sparse_moe.gate"]}
    report = load_nvfp4(model, stored, quantization_config=qcfg)
    assert isinstance(model.model.layers[0].mlp.experts, Fp4MoeExperts) and report.unused == []
    assert report.skipped["model.layers.0.mlp.router"] == ("excluded by the checkpoint "
                                                          "('model.layers.0.block_sparse_moe.gate')")
