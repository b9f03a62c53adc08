"""``Fp4Experts`` on the CPU: built from ModelOpt's per-expert tensors, it computes what ``fp4_grouped_mm`` computes on
the quantized rows, close to the float product; its messages name the tensor and the expert."""
from __future__ import annotations

import pytest
import torch

import fp4dispatch
from fp4dispatch import InvalidInputError, quantize_nvfp4
from fp4dispatch.backends.reference import ReferenceBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.format_grouped import grouped_scale_rows, swizzle_grouped_scales
from fp4dispatch.nn import Fp4Experts
from fp4dispatch.routing import offs_from_counts
from fp4dispatch.testing import fake_do_bench


@pytest.fixture(autouse=True)
def _reference_only(tmp_path):
    fp4dispatch.set_dispatcher(Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c", do_bench=fake_do_bench))
    yield
    fp4dispatch.set_dispatcher(None)


def _modelopt(e=3, n=48, k=128, seed=0):
    """ModelOpt's tensors of e experts as it exports them: packed weight, linear e4m3 scales, 1/gs per expert, and
    a calibrated input scale per expert; and the float weights they came from."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.linspace(0.5, 2, e).reshape(e, 1, 1)
    qs = [quantize_nvfp4(w[i], scale_layout="linear") for i in range(e)]
    return ([q[0] for q in qs], [q[1] for q in qs], torch.stack([1 / q[2] for q in qs]).reshape(e),
            torch.tensor([0.002, 0.003, 0.0025][:e]), w)


def test_the_experts_compute_fp4_grouped_mm_of_the_quantized_rows():
    wq, ws, ws2, ins, w = _modelopt()
    mod = Fp4Experts.from_modelopt(wq, ws, ws2, ins, mode="w4a4")
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    offs = offs_from_counts(torch.tensor([6, 0, 14]))
    y = mod(x, offs)
    assert y.dtype == torch.bfloat16 and y.shape == (20, 48)
    # by hand: one static encode scale for all rows (the largest input scale), alpha[e] = weight_scale_2[e] / gs
    gs = (1 / ins.max()).reshape(1)
    xq, xs, _ = quantize_nvfp4(x, gs, scale_layout="linear")
    from fp4dispatch.format_grouped import swizzle_expert_scales
    want = fp4dispatch.fp4_grouped_mm(xq, torch.stack(wq), swizzle_grouped_scales(xs, offs, grouped_scale_rows(20, 3)),
                                      swizzle_expert_scales(torch.stack(ws)), (ws2 / gs).float(), offs)
    assert torch.equal(y, want)
    ref = torch.cat([x[:6].float() @ w[0].T, x[6:].float() @ w[2].T])
    assert float((y.float() - ref).norm() / ref.norm()) < 0.2  # NVFP4's rounding of both operands


def test_dynamic_scaling_stacked_tensors_and_a_cast_model():
    wq, ws, ws2, _, w = _modelopt(e=2)
    mod = Fp4Experts.from_modelopt(torch.stack(wq), torch.stack(ws), ws2, mode="w4a4").to(torch.bfloat16)  # cast
    assert mod.input_scale is None and "activation_scale=dynamic" in repr(mod)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    offs = offs_from_counts(torch.tensor([0, 9]))
    y = mod(x, offs)
    assert y.dtype == torch.float32
    assert float((y - x @ w[1].T).norm() / (x @ w[1].T).norm()) < 0.2


@pytest.mark.parametrize("build, message", [
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws[:2], s2),
     r"^Fp4Experts.from_modelopt: weight and weight_scale must hold the same number \(E >= 1\) of experts .*got 3 "
     r"items and 2 items$"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws, s2[:2]),
     r"^Fp4Experts.from_modelopt: weight_scale_2 must hold one value per expert \(E=3\); got 2 values$"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, [ws[0], ws[1].T.contiguous(), ws[2]], s2),
     r"^Fp4Experts.from_modelopt \(expert 1\): weight_scale must be linear \[N, K/16\]=\(48, 8\) for weight "
     r"\(48, 64\); got shape=\(8, 48\)\. It is \[K/16, N\]"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws, -s2),
     r"^Fp4Experts.from_modelopt: weight_scale_2 must be positive and finite"),
    (lambda wq, ws, s2: Fp4Experts.from_compressed_tensors(None, ws, 1 / s2),
     r"^Fp4Experts.from_compressed_tensors: weight_packed and weight_scale must hold the same number \(E >= 1\) of "
     r"experts .*got NoneType and 3 items$"),
    (lambda wq, ws, s2: Fp4Experts.from_compressed_tensors([wq[0], wq[1][:40], wq[2]], [ws[0], ws[1][:40], ws[2]],
                                                           1 / s2),
     r"^Fp4Experts.from_compressed_tensors: every expert's weight_packed must have one shape; got "),
    (lambda wq, ws, s2: Fp4Experts.from_compressed_tensors(wq, ws, (1 / s2)[:1]),
     r"^Fp4Experts.from_compressed_tensors: weight_global_scale must hold one value per expert \(E=3\); got 1 "
     r"values$"),
    (lambda wq, ws, s2: Fp4Experts.from_compressed_tensors(wq, ws, 1 / s2, input_global_scale=[1.0, 0.0, 2.0]),
     r"^Fp4Experts.from_compressed_tensors: input_global_scale must be positive and finite \(encode scales "
     r"448\*6/amax\); got \[1.0, 0.0, 2.0\]$"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws, s2, input_scale="0.1"),
     r"^Fp4Experts.from_modelopt: input_scale must be float32 decode scales amax/\(448\*6\), one per expert; got "
     r"str$"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt([wq[0], wq[1][:40], wq[2]], [ws[0], ws[1][:40], ws[2]], s2),
     r"^Fp4Experts.from_modelopt: every expert's weight must have one shape; got \[\(40, 64\), \(48, 64\)\]$"),
    # a sequence of per-expert scales holding something else than one value each (raw torch errors before)
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws, [torch.tensor([0.1, 0.1])] * 3),
     r"^Fp4Experts.from_modelopt: weight_scale_2 as a sequence must hold one number or one-element tensor per expert "
     r"\(decode scales amax/\(448\*6\)\); item 0 is shape \(2,\)\. Pass one value per expert$"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws, s2, input_scale=[0.1, None, 0.2]),
     r"^Fp4Experts.from_modelopt: input_scale as a sequence must hold .*; item 1 is NoneType\. Pass one value"),
    (lambda wq, ws, s2: Fp4Experts.from_compressed_tensors(wq, ws, ["300"] * 3),
     r"^Fp4Experts.from_compressed_tensors: weight_global_scale as a sequence must hold one number or one-element "
     r"tensor per expert \(encode scales 448\*6/amax\); item 0 is str"),
    # one expert's 2-D weight: its rows were taken as experts, and the message said it must be 2-D
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq[0], ws[0], s2[:1]),
     r"^Fp4Experts.from_modelopt: weight must be \[E, N, K/2\] \(or a sequence of E experts' tensors\); got a 2-D "
     r"tensor of shape \(48, 64\)\. One expert's: pass weight.unsqueeze\(0\), its scales likewise$"),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(torch.stack(wq), ws[0], s2),
     r"^Fp4Experts.from_modelopt: weight_scale must be \[E, N, K/16\] .*; got a 2-D tensor of shape \(48, 8\)\."),
    (lambda wq, ws, s2: Fp4Experts.from_modelopt(wq, ws, []),
     r"^Fp4Experts.from_modelopt: weight_scale_2 must hold one value per expert \(E=3\); got 0 values$"),
])
def test_bad_checkpoint_tensors_are_refused_naming_tensor_and_expert(build, message):
    wq, ws, ws2, _, _ = _modelopt()
    with pytest.raises(InvalidInputError, match=message):
        build(wq, ws, ws2)


def test_compressed_tensors_experts_quantize_with_the_stored_encode_scale():
    """Stored encode scales are used as they are: the smallest input_global_scale quantizes every row (none
    clips), never 1/(1/x); the weight decode scale is 1/weight_global_scale, as Fp4Linear takes it."""
    wq, ws, ws2, _, _ = _modelopt()
    mod = Fp4Experts.from_compressed_tensors(wq, ws, 1 / ws2, input_global_scale=[300.0, 200.0, 250.0])
    assert mod.input_global_scale.view(torch.float32).item() == 200.0 and "activation_scale=static" in repr(mod)
    torch.testing.assert_close(mod.weight_scale_2.view(torch.float32), (1 / (1 / ws2.float())), rtol=0, atol=0)
    assert Fp4Experts.from_modelopt(wq, ws, ws2, input_scale=0.05).input_scale.view(torch.float32).item() == \
        torch.tensor(0.05).item()


def test_w4a16_experts_keep_the_activations_and_auto_is_w4a16_without_fp4_tensor_cores():
    """W4A16: w4a16_grouped_mm of the rows as they are, so the only error is the weight's NVFP4 rounding (and the
    bf16 output): far below W4A4's."""
    wq, ws, ws2, ins, w = _modelopt()
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    offs = offs_from_counts(torch.tensor([6, 0, 14]))
    auto = Fp4Experts.from_modelopt(wq, ws, ws2, ins)
    y = auto(x, offs)
    assert auto.resolved_mode(x.device) == "w4a16" and "mode=auto (w4a16 on cpu)" in repr(auto)
    assert auto.resolved_mode("cpu") == "w4a16" and repr(auto).count("on cpu") == 1  # a string: the same device
    from fp4dispatch.format_grouped import swizzle_expert_scales
    want = fp4dispatch.w4a16_grouped_mm(x, torch.stack(wq), swizzle_expert_scales(torch.stack(ws)), ws2.float(), offs)
    assert torch.equal(y, want)
    decoded = [fp4dispatch.dequantize_nvfp4(wq[i], ws[i], scale_layout="linear").double() * ws2[i].double()
               for i in range(3)]
    ref = torch.cat([x[:6].double() @ decoded[0].T, x[6:].double() @ decoded[2].T])
    assert float((y.double() - ref).norm() / ref.norm()) < 4e-3  # the bf16 output rounding
    w4a4 = Fp4Experts.from_modelopt(wq, ws, ws2, ins, mode="w4a4")(x, offs)
    assert float((w4a4.double() - ref).norm() / ref.norm()) > 0.02
    with pytest.raises(InvalidInputError, match=r"^Fp4Experts: mode must be one of \('auto', 'w4a4', 'w4a16'\); "
                                                r"got 'w8a8'\. 'auto' picks W4A4 where a grouped backend multiplies on "
                                                r"FP4 tensor cores, else W4A16$"):
        Fp4Experts.from_modelopt(wq, ws, ws2, mode="w8a8")


def test_bad_calls_are_explained():
    wq, ws, ws2, _, _ = _modelopt()
    mod = Fp4Experts.from_modelopt(wq, ws, ws2, mode="w4a4")
    with pytest.raises(InvalidInputError, match=r"^Fp4Experts: x must be \[T, in_features=128\] \(the routed rows, "
                                                r"grouped by expert\); got \(2, 5, 128\)$"):
        mod(torch.randn(2, 5, 128), torch.tensor([1, 2, 10], dtype=torch.int32))
    with pytest.raises(InvalidInputError, match=r"^fp4_grouped_mm: offs\[-1\] must equal T = a.shape\[0\] = 4"):
        mod(torch.randn(4, 128), torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(InvalidInputError, match=r"^fp4_grouped_mm: offs must be on cpu like a; got offs.device=meta\. "
                                                r"Move it with \.to\('cpu'\)$"):
        mod(torch.randn(4, 128), torch.zeros(3, dtype=torch.int32, device="meta"))
    for mode in ("w4a4", "w4a16"):  # was swizzle_grouped_scales' message in W4A4, w4a16_grouped_mm's in W4A16
        mod.mode = mode
        with pytest.raises(InvalidInputError, match=r"^Fp4Experts: offs must be an int32 tensor \[E\] of each expert's "
                                                    r"cumulative end row; got dtype=torch.float32\. Build it as "
                                                    r"torch.cumsum\(rows_per_expert, 0\).to\(torch.int32\)$"):
            mod(torch.randn(4, 128), torch.tensor([1.0, 2.0, 4.0]))
        with pytest.raises(InvalidInputError, match=r"^Fp4Experts: offs must be .*; got list\."):
            mod(torch.randn(4, 128), [1, 2, 4])


def test_a_static_experts_state_dict_loads_into_a_dynamic_module():
    wq, ws, ws2, ins, _ = _modelopt()
    src = Fp4Experts.from_modelopt(wq, ws, ws2, ins, mode="w4a4")
    dst = Fp4Experts(3, 128, 48, mode="w4a4")
    dst.load_state_dict(src.state_dict())
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(1))
    offs = offs_from_counts(torch.tensor([6, 0, 14]))
    assert "activation_scale=static" in repr(dst) and torch.equal(dst(x, offs), src(x, offs))
    sd = src.state_dict()
    sd["weight_scale_2"] = sd["weight_scale_2"].view(torch.float32)
    with pytest.raises(InvalidInputError, match=r"^Fp4Experts.load_state_dict: state_dict\['weight_scale_2'\] must be "
                                                r"the layer's storage, torch.int32"):
        dst.load_state_dict(sd)
    sd = src.state_dict()  # one value per expert, in another dtype: the message's fix must load it
    sd["weight_scale_2"] = sd["weight_scale_2"].view(torch.float32).double()
    with pytest.raises(InvalidInputError, match=r"got dtype=torch.float64, which would be copied in by value\. Pass "
                                                r"t.float\(\).reshape\(-1\).view\(torch.int32\) if it holds"):
        dst.load_state_dict(sd)
    t = sd["weight_scale_2"]
    sd["weight_scale_2"] = t.float().reshape(-1).view(torch.int32)  # as the message says
    dst.load_state_dict(sd)
    assert torch.equal(dst(x, offs), src(x, offs))
    sd = src.state_dict()  # the checkpoint's linear scales: "t.view(torch.uint8)" alone loaded them in the wrong order
    sd["weight_scale"] = torch.stack(ws)  # [E, N, K/16] e4m3, linear
    with pytest.raises(InvalidInputError, match=r"^Fp4Experts.load_state_dict: state_dict\['weight_scale'\] .* Pass "
                                                r"t.view\(torch.uint8\) if it holds this layer's swizzled scales .*; a "
                                                r"checkpoint's linear \[rows, K/16\] scales need fp4dispatch."
                                                r"format_grouped.swizzle_expert_scales\(t\).view\(torch.uint8\) first"):
        dst.load_state_dict(sd)
    from fp4dispatch.format_grouped import swizzle_expert_scales

    sd["weight_scale"] = swizzle_expert_scales(torch.stack(ws)).view(torch.uint8)  # as the message says
    dst.load_state_dict(sd)
    assert torch.equal(dst(x, offs), src(x, offs))
    sd["weight_scale_2"] = torch.tensor([1.0, float("nan")]).view(torch.int32)  # one bad expert: refused, as by
    with pytest.raises(InvalidInputError, match=r"^Fp4Experts.load_state_dict: state_dict\['weight_scale_2'\] must "
                                                r"hold positive finite fp32 weight decode scales 1/gs_w \(as int32 "
                                                r"bits\); it holds \[1.0, nan\]$"):  # from_modelopt
        dst.load_state_dict(sd)
