"""Drop-in for inference code (CPU): custom op + torch.compile, Fp4Linear, warm-up before capture. Guard mode:
test_guard.py."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import fp4dispatch
from fp4dispatch import graphs
from fp4dispatch.backends.reference import ReferenceBackend, reference_mm
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.errors import InvalidInputError
from fp4dispatch.format import dequantize_nvfp4, quantize_nvfp4, swizzled_scale_shape
from fp4dispatch.nn import Fp4Experts, Fp4Linear
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs

CPU = torch.device("cpu")


def _compile(fn, **kw):
    # aot_eager runs dynamo (fullgraph: no graph break allowed), the fake impls and functionalization without
    # Inductor's C++ build, which would take ~30 s per test on this CPU
    return torch.compile(fn, fullgraph=True, backend="aot_eager", **kw)


# ---------------------------------------------------------------------------------------------------------------
# custom op and torch.compile
# ---------------------------------------------------------------------------------------------------------------
def test_custom_ops_registered_with_fake_impl_shapes():
    a, b, sa, sb, alpha = (t.to("meta") for t in make_nvfp4_inputs(5, 64, 128))
    y = torch.ops.fp4dispatch.fp4_mm(a, b, sa, sb, alpha, 1.0, torch.float16, "swizzled", None)
    assert (tuple(y.shape), y.dtype, y.device.type) == ((5, 64), torch.float16, "meta")
    out = torch.empty((5, 64), dtype=torch.float32, device="meta")
    assert torch.ops.fp4dispatch.fp4_mm_out(a, b, sa, sb, None, 0.5, out, "swizzled", None) is None


def test_fake_impl_checks_the_contract():
    a, b, sa, sb, alpha = (t.to("meta") for t in make_nvfp4_inputs(5, 48, 128))
    with pytest.raises(InvalidInputError, match=r"b\.shape\[1\] \(K/2\) must equal a\.shape\[1\]=64"):
        torch.ops.fp4dispatch.fp4_mm(a, b[:, :16], sa, sb, alpha, 1.0, torch.bfloat16, "swizzled", None)


@pytest.mark.parametrize("op, args", [
    pytest.param("fp4_mm", lambda t: (*t, 1.0, torch.bfloat16, "swizzled", None), id="functional"),
    pytest.param("fp4_mm_out", lambda t: (*t[:4], None, 0.5, torch.empty(5, 64), "swizzled", None), id="out"),
])
def test_opcheck(op, args):
    a, b, sa, sb, alpha = make_nvfp4_inputs(5, 64, 128)
    # uint8 views of the e4m3 scales: opcheck's schema test compares with allclose, which CPU float8 lacks
    t = (a, b, sa.view(torch.uint8), sb.view(torch.uint8), alpha)
    res = torch.library.opcheck(getattr(torch.ops.fp4dispatch, op).default, args(t))
    assert set(res.values()) == {"SUCCESS"}, res


def test_compile_fullgraph_equals_eager_across_m():
    def f(a, b, sa, sb, alpha):
        return fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32) * 2 + 1

    cf = _compile(f, dynamic=True)
    for m in (1, 5, 37, 130):
        args = make_nvfp4_inputs(m, 64, 128, seed=m)
        assert torch.equal(cf(*args), f(*args))


@pytest.mark.parametrize("alpha", [pytest.param(None, id="none"), pytest.param(0.75, id="float"),
                                   pytest.param("tensor", id="tensor")])
def test_compile_out_variant_float_alpha_and_backend(alpha):
    a, b, sa, sb, at = make_nvfp4_inputs(9, 32, 64)
    al = at if alpha == "tensor" else alpha

    def f(a, b, sa, sb):
        out = torch.empty((a.shape[0], b.shape[0]), dtype=torch.float16)
        fp4dispatch.fp4_mm(a, b, sa, sb, al, out=out, out_dtype=torch.float16, backend="reference")
        return out.float() - 1

    assert torch.equal(_compile(f)(a, b, sa, sb), f(a, b, sa, sb))


@pytest.mark.parametrize("alpha", [np.float64(0.75), np.float32(0.75), np.int64(2)], ids=["f64", "f32", "i64"])
def test_compile_takes_a_numpy_number_alpha_as_eager_does(alpha):
    """Dynamo holds a NumPy number as a 0-d ndarray it cannot read (api._is_numpy_number): the compiled call must
    still give eager's bits; a NumPy array fails at trace time with eager's message."""
    a, b, sa, sb, _ = make_nvfp4_inputs(5, 32, 64)

    def f(a, b, sa, sb, al):
        return fp4dispatch.fp4_mm(a, b, sa, sb, al, backend="reference")

    assert torch.equal(_compile(f)(a, b, sa, sb, alpha), f(a, b, sa, sb, alpha))
    said = r"fp4_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got numpy.ndarray"
    with pytest.raises(InvalidInputError, match=said):
        f(a, b, sa, sb, np.array([0.5, 1.0]))
    with pytest.raises(Exception, match=said):
        _compile(f)(a, b, sa, sb, np.array([0.5, 1.0]))


def test_compile_reports_the_eager_message_at_trace_time():
    a, b, sa, sb, alpha = make_nvfp4_inputs(5, 64, 128)

    def f(a, b, sa, sb, alpha):
        return fp4dispatch.fp4_mm(a, b, sa, sb, alpha)

    with pytest.raises(Exception, match=r"b must be contiguous \[N, K/2\].*transposed view"):
        _compile(f)(a, b.t(), sa, sb, alpha)


def test_compile_out_dtype_mismatch_has_the_eager_message():
    a, b, sa, sb, alpha = make_nvfp4_inputs(5, 64, 128)

    def f(a, b, sa, sb, alpha):
        out = torch.empty((5, 64), dtype=torch.float32)
        return fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out=out)  # out_dtype defaults to bf16

    with pytest.raises(Exception, match=r"out must be a contiguous \[M, N\]=\(5, 64\) tensor of dtype torch.bfloat16"):
        _compile(f)(a, b, sa, sb, alpha)


def test_eager_calls_bypass_the_custom_op(monkeypatch):
    def boom(*args, **kw):
        raise AssertionError("eager fp4_mm went through the custom op")

    monkeypatch.setattr(fp4dispatch.api, "_traced", boom)
    a, b, sa, sb, alpha = make_nvfp4_inputs(3, 32, 64)
    y = fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)
    p = Problem(3, 32, 64, torch.float32, CPU)
    torch.testing.assert_close(y, reference_mm(p, Operands(a, b, sa, sb, alpha, y)))


# ---------------------------------------------------------------------------------------------------------------
# Fp4Linear
# ---------------------------------------------------------------------------------------------------------------
def _qdq(x: torch.Tensor, gs=None) -> torch.Tensor:
    p, s, g = quantize_nvfp4(x, gs)
    return dequantize_nvfp4(p, s, g)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def test_fp4linear_from_linear_is_the_nvfp4_layer_and_close_to_float():
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 192).requires_grad_(False)
    q = Fp4Linear.from_linear(lin, mode="w4a4")
    x = torch.randn(2, 3, 7, 512)
    y = q(x)
    assert y.shape == (2, 3, 7, 192) and y.dtype == torch.float32
    # exactly the float layer on NVFP4-rounded operands (up to summation order) ...
    yq = torch.nn.functional.linear(_qdq(x.reshape(-1, 512)), _qdq(lin.weight.detach()), lin.bias).reshape(y.shape)
    assert _rel(y, yq) < 1e-5
    # ... so its distance to the float layer is NVFP4 W4A4 quantization error (measured 0.141 here, see
    # docs/integration.md); e2m1 with e4m3 block scales costs ~0.1 relative error per operand
    err = _rel(y, lin(x).detach())
    assert 0.05 < err < 0.2, err


def test_fp4linear_static_input_scale_and_bf16():
    torch.manual_seed(1)
    lin = torch.nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(11, 256, dtype=torch.bfloat16)
    amax = float(x.float().abs().amax())
    q = Fp4Linear.from_linear(lin, input_scale=amax / 2688, mode="w4a4")
    y = q(x)
    assert y.dtype == torch.bfloat16
    yq = _qdq(x.float(), torch.tensor([2688 / amax])) @ _qdq(lin.weight.float()).t()
    assert _rel(y.float(), yq) < 1e-2  # bf16 output rounding
    assert "activation_scale=static" in repr(q)


def test_fp4linear_survives_module_dtype_casts():
    torch.manual_seed(2)
    lin = torch.nn.Linear(128, 32)
    q = Fp4Linear.from_linear(lin, input_scale=0.01)
    x = torch.randn(4, 128).to(torch.bfloat16)
    before = q(x.float())
    q16 = q.to(torch.bfloat16)  # casts every floating buffer; the scales are stored as bytes/bits
    assert q16.bias.dtype == torch.bfloat16
    after = q16(x)
    assert after.dtype == torch.bfloat16
    assert _rel(after.float(), before) < 1e-2  # bf16 output and bias rounding only


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_fp4linear_never_serves_stale_weight_views(mode):
    """The forward keeps its weight views between calls (host time); a reloaded, reassigned or moved buffer must
    still be what the next call multiplies by."""
    torch.manual_seed(3)
    a, b = (torch.nn.Linear(128, 32, bias=False) for _ in range(2))
    qa, qb = Fp4Linear.from_linear(a, mode=mode), Fp4Linear.from_linear(b, mode=mode)
    x = torch.randn(3, 128)
    ya, yb = qa(x), qb(x)
    qa.load_state_dict(qb.state_dict())  # copied in place into the same buffers
    assert torch.equal(qa(x), yb)
    qa.weight_scale_2 = qa.weight_scale_2.clone()  # a new buffer object
    qa.weight_scale_2.view(torch.float32).mul_(2)
    assert torch.equal(qa(x), 2 * yb)
    qa.weight_scale_2.data = qa.weight_scale_2.view(torch.float32).mul(2).view(torch.int32)  # same object, new storage
    assert torch.equal(qa(x), 4 * yb)  # it was served the old scale: 2 * yb
    qa.weight_scale.data = qb.weight_scale.clone()
    assert torch.equal(qa(x), 4 * yb)
    qa.weight_scale.data = torch.zeros_like(qb.weight_scale)  # all-zero block scales
    assert qa(x).abs().max() == 0
    qa.weight = torch.zeros_like(qa.weight)  # a new buffer object (all-zero codes)
    assert qa(x).abs().max() == 0 and not torch.equal(ya, yb)


def test_a_compiled_model_of_fp4linear_layers_compiles_once():
    """The forward filled its view cache on the first call, Dynamo guarded on it being empty, and the second call
    compiled the whole model again."""
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    net = torch.nn.Sequential(*(Fp4Linear.from_linear(torch.nn.Linear(64, 64), mode="w4a16") for _ in range(3)))
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = _compile(net)
    x = torch.randn(8, 64)
    for _ in range(3):
        assert torch.equal(compiled(x), net(x))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("kind", ["modelopt-static", "compressed-tensors-static", "dynamic", "w4a16"])
def test_fp4linear_uses_scales_loaded_with_load_state_dict(kind):
    """New scales loaded with load_state_dict, as a weight update does: the next call uses them in every mode, W4A4
    with a static scale included (its alpha is derived again when scales are set or loaded, not per call)."""
    torch.manual_seed(6)
    w, x = torch.randn(48, 64), torch.randn(3, 64)
    packed, scale, gs = quantize_nvfp4(w, scale_layout="linear")

    def make(g, enc=500.0):
        if kind == "compressed-tensors-static":
            return Fp4Linear.from_compressed_tensors(packed, scale, g, torch.tensor([enc]), mode="w4a4")
        return Fp4Linear.from_modelopt(packed, scale, 1 / g, torch.tensor(0.002) if kind == "modelopt-static" else None,
                                       mode="w4a16" if kind == "w4a16" else "w4a4")

    q = make(gs)
    y = q(x)
    q.load_state_dict(make(gs / 2).state_dict())
    assert torch.equal(q(x), 2 * y), kind  # a power of two: exact
    if kind == "compressed-tensors-static":  # a new static encode scale too
        q.load_state_dict(make(gs / 2, 250.0).state_dict())
        assert torch.equal(q(x), make(gs / 2, 250.0)(x))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_fp4linear_pickles_and_saves_after_a_call(mode):
    """The views a call keeps of the buffers (a float8 view of the uint8 scales) stay out of pickle and torch.save:
    torch.save refuses two dtypes of one storage, and pickle would restore them apart from the buffers."""
    import io
    import pickle

    torch.manual_seed(7)
    q = Fp4Linear.from_linear(torch.nn.Linear(64, 48, bias=False), input_scale=0.002, mode=mode)
    x = torch.randn(3, 64)
    y = q(x)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    for back in (pickle.loads(pickle.dumps(q)), torch.load(buf, weights_only=False)):
        assert torch.equal(back(x), y)
        assert back._views[0] is back._buffers["weight"]  # its views are of its own buffers
    assert torch.equal(q(x), y)


@pytest.mark.parametrize("kind", ["modelopt", "compressed-tensors"])
def test_fp4linear_state_dict_of_a_static_layer_loads_into_a_dynamic_one(kind):
    """A None buffer takes no key in nn.Module's loading: the static scale is set by the layer, which becomes static
    (strict or not, assign or not), and the other kind of static scale goes."""
    torch.manual_seed(8)
    w = torch.randn(48, 64)
    packed, scale, gs = quantize_nvfp4(w, scale_layout="linear")
    if kind == "modelopt":
        src = Fp4Linear.from_modelopt(packed, scale, 1 / gs, torch.tensor(0.002), bias=torch.randn(48), mode="w4a4")
        other = Fp4Linear.from_compressed_tensors(packed, scale, gs, torch.tensor([300.0]), mode="w4a4")
    else:
        src = Fp4Linear.from_compressed_tensors(packed, scale, gs, torch.tensor([300.0]), bias=torch.randn(48),
                                                mode="w4a4")
        other = Fp4Linear.from_modelopt(packed, scale, 1 / gs, torch.tensor(0.002), mode="w4a4")
    x = torch.randn(3, 64)
    sd = src.state_dict()
    for strict, assign in ((True, False), (False, False), (True, True)):
        dst = Fp4Linear(64, 48, dtype=torch.float32, mode="w4a4")
        keys = dst.load_state_dict(sd, strict=strict, assign=assign)
        assert not keys.missing_keys and not keys.unexpected_keys
        assert "activation_scale=static" in repr(dst) and torch.equal(dst(x), src(x)), (strict, assign)
    other.register_buffer("bias", torch.zeros(48))  # now the keys match but for the static scale's kind
    other.load_state_dict(sd)
    assert torch.equal(other(x), src(x))
    assert (other.input_scale is None) == (kind == "compressed-tensors")
    assert (other.input_global_scale is None) == (kind == "modelopt")


@pytest.mark.parametrize("key, value, match", [
    ("weight_scale_2", lambda t: t.view(torch.float32),
     r"^Fp4Linear.load_state_dict: state_dict\['weight_scale_2'\] must be the layer's storage, torch.int32 \(fp32 bit "
     r"patterns\); got dtype=torch.float32, which would be copied in by value\. Pass "
     r"t.float\(\).reshape\(-1\).view\(torch.int32\) if it holds the same values, or build the layer from checkpoint "
     r"tensors"),
    # ModelOpt stores it 0-d: the fix reshapes it too (t.view(torch.int32) left [] against the layer's [1])
    ("weight_scale_2", lambda t: t.view(torch.float32).reshape(()),
     r"got dtype=torch.float32, which would be copied in by value\. Pass t.float\(\).reshape\(-1\)"),
    # from_modelopt refuses these values; load_state_dict took them and the layer's output changed sign, or went NaN
    ("weight_scale_2", lambda t: (-t.view(torch.float32)).view(torch.int32),
     r"^Fp4Linear.load_state_dict: state_dict\['weight_scale_2'\] must hold positive finite fp32 weight decode "
     r"scales 1/gs_w \(as int32 bits\); it holds \[-"),
    ("weight_scale_2", lambda t: torch.tensor([float("nan")]).view(torch.int32),
     r"state_dict\['weight_scale_2'\] must hold positive finite fp32 weight decode scales 1/gs_w \(as int32 bits\); "
     r"it holds \[nan\]$"),
    ("input_scale", lambda t: t.view(torch.float32).double(),
     r"state_dict\['input_scale'\] must be the layer's storage, torch.int32 .*got dtype=torch.float64.* Pass "
     r"t.float\(\).reshape\(-1\).view\(torch.int32\)"),
    # a checkpoint's linear scales have the swizzled buffer's shape in most real layers: "t.view(torch.uint8)" alone
    # loaded them silently in the wrong order
    ("weight_scale", lambda t: t.view(torch.float8_e4m3fn),
     r"^Fp4Linear.load_state_dict: state_dict\['weight_scale'\] must be the layer's storage, torch.uint8 \(bytes\); "
     r"got dtype=torch.float8_e4m3fn, which would be copied in by value\. Pass t.view\(torch.uint8\) if it holds "
     r"this layer's swizzled scales \(a state dict of the layer itself\); a checkpoint's linear \[rows, K/16\] "
     r"scales need fp4dispatch.swizzle_scales\(t\).view\(torch.uint8\) first, or build the layer from checkpoint "
     r"tensors with from_modelopt / from_compressed_tensors \(load_nvfp4\)$"),
    ("input_scale", lambda t: torch.zeros(1, dtype=torch.int32),
     r"^Fp4Linear.load_state_dict: state_dict\['input_scale'\] must be a positive finite fp32 scale \(as int32 "
     r"bits\); it holds \[0.0\]$"),
    ("input_scale", lambda t: t.repeat(2),
     r"state_dict\['input_scale'\] must hold one fp32 value as int32 bits \[1\]; got \(2,\)$"),
    ("input_global_scale", lambda t: t,
     r"^Fp4Linear.load_state_dict: state_dict holds both input_scale \(a decode scale\) and input_global_scale \(an "
     r"encode scale\); a layer has one static activation scale: drop one$"),
])
def test_fp4linear_load_state_dict_refuses_tensors_it_would_cast_by_value(key, value, match):
    sd = Fp4Linear.from_linear(torch.nn.Linear(64, 48), input_scale=0.002).state_dict()
    sd[key] = value(sd[key] if key in sd else sd["input_scale"])
    with pytest.raises(InvalidInputError, match=match):
        Fp4Linear(64, 48).load_state_dict(sd)


def test_fp4linear_compiles_fullgraph_equal_to_eager():
    torch.manual_seed(3)
    for mode, static in (("w4a4", False), ("w4a16", False), ("w4a4", True)):
        q = Fp4Linear.from_linear(torch.nn.Linear(128, 48), mode=mode)
        if static:  # a static activation scale (ModelOpt's input_scale): its CPU value was read while tracing
            q.set_input_scale(0.003)
        x = torch.randn(2, 5, 128)
        assert torch.equal(_compile(q)(x), q(x)), (mode, static)


def test_compile_of_a_trainable_model_traces_the_calls_without_a_backward():
    """A model compiled without no_grad (its nn.Linear parameters require grad) feeds activations and an alpha that
    require grad into the W4A16 ops and fp4_mm: AOTAutograd must not try to differentiate them (no autograd formula
    is registered; BackendCompilerFailed before), and the results carry no autograd history, as eager ones."""
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 48, 64, generator=g)
    qs = [quantize_nvfp4(x, scale_layout="linear") for x in w]
    experts = Fp4Experts.from_modelopt([q[0] for q in qs], [q[1] for q in qs], [1 / q[2] for q in qs], mode="w4a16")
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    model = torch.nn.ModuleDict({"pre": torch.nn.Linear(64, 64), "dense": Fp4Linear(64, 48, mode="w4a16")})
    model.dense.load_state_dict(Fp4Linear.from_linear(torch.nn.Linear(64, 48), mode="w4a16").state_dict())
    a, sa, gs_a = quantize_nvfp4(torch.randn(5, 64, generator=g))
    b, sb, gs_b = quantize_nvfp4(w[0])
    scale = torch.ones(1, requires_grad=True)

    def fn(x):
        h = model["pre"](x)
        alpha = scale / (gs_a * gs_b)  # requires grad
        return model["dense"](h), experts(h, offs), fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)

    x = torch.randn(5, 64)
    for got, want in zip(_compile(fn)(x), fn(x)):
        assert not got.requires_grad and not want.requires_grad
        torch.testing.assert_close(got, want)


def test_fp4linear_auto_resolves_inside_a_fullgraph_compile(tmp_path):
    """mode="auto" decided by the layer's first call, a compiled one: the dispatcher it asks (a lock, probes) runs at
    trace time, not traced; W4A4 where a backend on FP4 tensor cores is healthy, else W4A16, as eagerly."""
    from fp4dispatch.backends.reference import ReferenceBackend

    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    native = FakeBackend("native-fp4", cost=1e-6)
    native.fp4_tensor_cores = True
    try:
        for backends, want in (([ReferenceBackend()], "w4a16"), ([native, ReferenceBackend()], "w4a4")):
            fp4dispatch.set_dispatcher(Dispatcher(backends, cache_dir=tmp_path / want, do_bench=fake_do_bench))
            torch._dynamo.reset()  # a fresh process: the answer is kept by the compiled code, like a layer's own
            q = Fp4Linear.from_linear(lin)
            compiled = _compile(q)
            y = compiled(x)
            assert q.resolved_mode(CPU) == want and torch.equal(y, Fp4Linear.from_linear(lin, mode=want)(x)), want
            assert torch.equal(compiled(x), y)  # the second call: "auto" already decided on the layer
    finally:
        fp4dispatch.set_dispatcher(None)


def test_fp4linear_empty_batch():
    q = Fp4Linear.from_linear(torch.nn.Linear(64, 16))
    y = q(torch.randn(0, 3, 64))
    assert y.shape == (0, 3, 16)


def _modelopt_tensors(w: torch.Tensor, x_amax: float):
    packed, scale_lin, gs = quantize_nvfp4(w, scale_layout="linear")
    return packed, scale_lin, (1.0 / gs).reshape(()), torch.tensor(x_amax / 2688, dtype=torch.float32)


def test_fp4linear_from_modelopt_matches_semantics():
    torch.manual_seed(4)
    w = torch.randn(96, 256)
    bias = torch.randn(96)
    x = torch.randn(6, 256)
    amax = float(x.abs().amax())
    weight, weight_scale, weight_scale_2, input_scale = _modelopt_tensors(w, amax)
    q = Fp4Linear.from_modelopt(weight, weight_scale, weight_scale_2, input_scale, bias=bias, mode="w4a4")
    # vLLM/SGLang: x quantized with 1/input_scale, alpha = input_scale * weight_scale_2
    ref = _qdq(x, torch.tensor([1 / float(input_scale)])) @ _qdq(w).t() + bias
    assert _rel(q(x), ref) < 1e-5
    assert q.weight_scale.shape == swizzled_scale_shape(96, 256)
    # per-shard input scales (fused qkv): the max is used, as the engines do
    q2 = Fp4Linear.from_modelopt(weight, weight_scale.view(torch.uint8), weight_scale_2.reshape(1).repeat(3),
                                 input_scale.reshape(1) * torch.tensor([1.0, 0.5, 0.25]), bias=bias, mode="w4a4")
    torch.testing.assert_close(q2(x), q(x))
    # no input_scale: dynamic activation scaling
    q3 = Fp4Linear.from_modelopt(weight, weight_scale, weight_scale_2, mode="w4a4")
    assert _rel(q3(x), _qdq(x) @ _qdq(w).t()) < 1e-5
    # W4A16: the activations as they are (fp32 cast to bf16), alpha = weight_scale_2 alone
    q4 = Fp4Linear.from_modelopt(weight, weight_scale, weight_scale_2, input_scale, bias=bias, mode="w4a16")
    ref16 = x.to(torch.bfloat16).double() @ _qdq(w).double().t() + bias.double()
    assert _rel(q4(x), ref16) < 1e-5


def test_fp4linear_auto_is_w4a16_without_fp4_tensor_cores_and_w4a4_with_them(tmp_path):
    import fp4dispatch
    from fp4dispatch.backends.reference import ReferenceBackend
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.testing import FakeBackend, fake_do_bench

    torch.manual_seed(5)
    lin = torch.nn.Linear(128, 32)
    x = torch.randn(3, 128)
    native = FakeBackend("native-fp4", cost=1e-6)
    native.fp4_tensor_cores = True
    errs = {}
    try:
        for backends, want in (([ReferenceBackend()], "w4a16"), ([native, ReferenceBackend()], "w4a4")):
            fp4dispatch.set_dispatcher(Dispatcher(backends, cache_dir=tmp_path / want, do_bench=fake_do_bench))
            q = Fp4Linear.from_linear(lin)
            assert q.mode == "auto" and "mode=auto," in repr(q)
            y = q(x)
            assert q.resolved_mode(x.device) == want and f"mode=auto ({want} on cpu)" in repr(q)
            fixed = Fp4Linear.from_linear(lin, mode=want)
            assert torch.equal(y, fixed(x))
            errs[want] = _rel(y, lin(x).detach())
    finally:
        fp4dispatch.set_dispatcher(None)
    # the weight's NVFP4 rounding only (W4A16) vs the activations' on top of it (W4A4)
    assert errs["w4a16"] < 0.8 * errs["w4a4"], errs


_W = torch.zeros(8, 32, dtype=torch.uint8)
_S = torch.ones(8, 4).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("args, match", [
    pytest.param((torch.zeros(8, 32), _S, torch.tensor(1.0)),
                 r"weight must be packed NVFP4 data \(uint8 or torch.float4_e2m1fn_x2.*got dtype=torch.float32",
                 id="weight-dtype"),
    pytest.param((_W, torch.ones(128, 4).to(torch.float8_e4m3fn), torch.tensor(1.0)),
                 r"weight_scale must be linear \[N, K/16\]=\(8, 4\) for weight \(8, 32\); got shape=\(128, 4\)",
                 id="swizzled-scale"),
    pytest.param((_W, torch.ones(8, 4), torch.tensor(1.0)),
                 r"weight_scale must hold float8_e4m3fn block scales .*got dtype=torch.float32", id="scale-dtype"),
    pytest.param((_W, _S, torch.tensor([1.0, 2.0])),
                 r"weight_scale_2 has 2 different per-shard values \[1.0, 2.0\]", id="shard-scales"),
    pytest.param((_W, _S, torch.tensor(0.0)),
                 r"weight_scale_2 must be positive and finite .*got \[0.0\]", id="zero-scale"),
    pytest.param((_W, _S, "x"), r"weight_scale_2 must be a float32 tensor .*got str", id="scale-type"),
    pytest.param((_W, _S, torch.tensor(1.0), torch.tensor(float("nan"))),
                 r"input_scale must be positive and finite", id="nan-input-scale"),
])
def test_fp4linear_from_modelopt_errors(args, match):
    with pytest.raises(InvalidInputError, match=match):
        Fp4Linear.from_modelopt(*args)


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: Fp4Linear(100, 8), r"in_features must be a positive multiple of 16 .*got 100",
                 id="in-features"),
    pytest.param(lambda: Fp4Linear(64, 0), r"out_features must be a positive int; got 0", id="out-features"),
    pytest.param(lambda: Fp4Linear(64, True), r"^Fp4Linear: out_features must be a positive int; got bool True\. Pass "
                 r"the layer's size as an int$", id="out-features-bool"),
    pytest.param(lambda: Fp4Linear(64.0, 8), r"^Fp4Linear: in_features must be a positive int; got float 64\.0\. Pass "
                 r"int\(64\.0\)$", id="in-features-float"),
    pytest.param(lambda: Fp4Linear(100, 8), r"^Fp4Linear: in_features must be a positive multiple of 16 \(one e4m3 "
                 r"scale per 16 values\); got 100\. Pad K with zeros to 112$", id="in-features-pad"),
    pytest.param(lambda: Fp4Experts(2, 64, True), r"^Fp4Experts: out_features must be a positive int; got bool True",
                 id="experts-out-bool"),
    pytest.param(lambda: Fp4Experts(2, 64.0, 8), r"^Fp4Experts: in_features must be a positive int; got float 64\.0",
                 id="experts-in-float"),
    pytest.param(lambda: Fp4Linear(64, 8, mode="fp8"), r"^Fp4Linear: mode must be one of \('auto', 'w4a4', 'w4a16'\); "
                 r"got 'fp8'\. 'auto' picks W4A4 where FP4 tensor cores serve it, else W4A16$", id="mode"),
    # set after construction: anything but "w4a16" ran W4A4, silently
    pytest.param(lambda: setattr(Fp4Linear(64, 8), "mode", "W4A16"), r"^Fp4Linear: mode must be one of \('auto', "
                 r"'w4a4', 'w4a16'\); got 'W4A16'\. 'auto' picks W4A4 where FP4 tensor cores serve it, else W4A16$",
                 id="mode-set"),
    pytest.param(lambda: setattr(Fp4Experts(2, 64, 8), "mode", None), r"^Fp4Experts: mode must be one of \('auto', "
                 r"'w4a4', 'w4a16'\); got None\.", id="experts-mode-set"),
    pytest.param(lambda: Fp4Linear.from_linear(torch.nn.Conv1d(1, 1, 1)),
                 r"linear must be a torch.nn.Linear; got Conv1d", id="not-linear"),
    pytest.param(lambda: Fp4Linear(64, 8)(torch.randn(3, 32)), r"x must be \[..., in_features=64\]; got \(3, 32\)",
                 id="x-shape"),
    pytest.param(lambda: Fp4Linear(64, 8)(torch.ones(3, 64, dtype=torch.int32)),
                 r"x must be float32, bfloat16 or float16; got dtype=torch.int32", id="x-dtype"),
    pytest.param(lambda: Fp4Linear(64, 8).set_input_scale(-1.0),
                 r"input_scale must be one positive finite value .*got \[-1.0\]", id="input-scale"),
])
def test_fp4linear_errors(make, match):
    with pytest.raises(InvalidInputError, match=match):
        make()


# ---------------------------------------------------------------------------------------------------------------
# warm-up before CUDA-graph capture
# ---------------------------------------------------------------------------------------------------------------
def test_warmup_decides_and_runs_each_shape(tmp_path):
    fast = FakeBackend("fast", cost=1e-6)
    d = Dispatcher([fast, FakeBackend("slow", cost=1e-5)], cache_dir=tmp_path / "c", do_bench=fake_do_bench, guard=True)
    got = graphs.warmup([(3, 64, 128), (200, 32, 64)], out_dtype=torch.float32, device="cpu", dispatcher=d)
    assert got == {(3, 64, 128): "fast", (200, 32, 64): "fast"}
    assert len(d.guard._watches) == 2  # the guard flags exist before capture
    calls = fast.calls
    graphs.warmup([(3, 64, 128)], out_dtype=torch.float32, device="cpu", dispatcher=d, run=False)
    assert fast.calls == calls  # decided: no tuning, and run=False runs nothing


@pytest.mark.parametrize("shapes, shown", [
    pytest.param([(4, 64)], r"\(4, 64\)", id="pair"),
    pytest.param([(4, 64, 100)], r"\(4, 64, 100\)", id="k-not-16"),
    pytest.param([(0, 64, 128)], r"\(0, 64, 128\)", id="zero-m"),
    pytest.param([(4.0, 64, 128)], r"\(4.0, 64, 128\)", id="float"),
])
def test_warmup_shape_errors(shapes, shown):
    with pytest.raises(InvalidInputError, match=r"warmup: shapes must be \(M, N, K\) triples of positive ints with "
                                                rf"K % 16 == 0; got {shown}"):
        graphs.warmup(shapes, device="cpu")


@pytest.mark.parametrize("shapes", [None, 5, "abc"])
def test_warmup_refuses_shapes_that_are_not_a_list(shapes):
    with pytest.raises(InvalidInputError, match=r"^warmup: shapes must be a list of \(M, N, K\) triples; got "
                                                rf"{re.escape(repr(shapes))}\. Pass e\.g\. \[\(1, 4096, 4096\)"):
        graphs.warmup(shapes, device="cpu")


@pytest.mark.parametrize("out_dtype", [None, "bfloat16", torch.int8])
def test_warmup_refuses_a_bad_out_dtype_before_it_reaches_the_cache(tmp_path, out_dtype):
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c", do_bench=fake_do_bench)
    with pytest.raises(InvalidInputError, match=r"^warmup: out_dtype must be one of torch.bfloat16, torch.float16, "
                                                rf"torch.float32 \(.*\); got {re.escape(repr(out_dtype))}$"):
        graphs.warmup([(4, 32, 64)], out_dtype=out_dtype, device="cpu", dispatcher=d)
    assert not d.cache_for("cpu").decisions  # no key of a bad dtype was decided or written


_NOT_A_DEVICE = r"device must be None, a torch.device, a string like 'cuda:0' or 'cpu', or a CUDA index; got "


@pytest.mark.parametrize("device, said", [
    pytest.param("gpu", _NOT_A_DEVICE + "'gpu'$", id="name"),
    pytest.param(1.5, _NOT_A_DEVICE + "1.5$", id="float"),
    pytest.param("meta", r"tensors must hold data on a CPU or CUDA device; got device meta\.", id="meta"),
])
def test_report_and_warmup_name_themselves_for_a_bad_device(tmp_path, device, said):
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c", do_bench=fake_do_bench)
    with pytest.raises(InvalidInputError, match=r"^report: " + said):
        d.report(device)
    with pytest.raises(InvalidInputError, match=r"^warmup: " + said):
        graphs.warmup([(4, 32, 64)], device=device, dispatcher=d)


@pytest.mark.parametrize("dispatcher", ["reference", Dispatcher], ids=["str", "class"])
def test_warmup_refuses_a_dispatcher_that_is_not_one(dispatcher):
    with pytest.raises(InvalidInputError, match=r"^warmup: dispatcher must be None \(the process-wide one, which "
                                                r"fp4_mm uses\) or a fp4dispatch\.dispatch\.dispatcher\.Dispatcher; "
                                                r"got (str 'reference'|the class itself)\. Pass the "):
        graphs.warmup([(4, 32, 64)], device="cpu", dispatcher=dispatcher)  # was AttributeError


def test_cpu_0_is_the_cpu_every_cpu_tensor_is_on(tmp_path):
    """torch.device("cpu:0") != torch.device("cpu"), the device of every CPU tensor: warmup(device="cpu:0") kept its
    decisions under a device no call looks up, in a second cache object of the same file."""
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c", do_bench=fake_do_bench)
    graphs.warmup([(4, 32, 64)], device="cpu:0", dispatcher=d, run=False)
    assert d.cache_for("cpu:0") is d.cache_for("cpu") and d.cache_for("cpu").decisions


def test_warmup_refuses_during_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(InvalidInputError, match=r"warmup: called during CUDA graph capture; call it before"):
        graphs.warmup([(1, 64, 128)], device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# benchmarks/run_benchmarks.py (the entry point; the numbers come from a GPU run)
# ---------------------------------------------------------------------------------------------------------------
def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run_benchmarks.py"
    spec = importlib.util.spec_from_file_location("run_benchmarks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_run_benchmarks_without_gpu_says_so_and_exits_0(tmp_path, capsys):
    rb = _bench_module()
    assert rb.main(["--results", str(tmp_path / "R.md")]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "R.md").exists()


@pytest.mark.parametrize("mode", ["tuned", "forced"])
def test_run_benchmarks_measures_and_replaces_only_its_section(tmp_path, mode):
    from fp4dispatch.dispatch.timer import for_device

    rb = _bench_module()
    res = rb.measure([(32, 64)], [1, 20], mode, budget_s=60, device="cpu", bench=for_device(CPU), copy_numel=1 << 16)
    assert res["backends"] == ["reference"] and [p["m"] for p in res["points"]] == [1, 20]
    for p in res["points"]:
        assert p["us"]["reference"] > 0 and p["us"]["cuBLAS bf16"] > 0
        assert p["roofline_us"] == pytest.approx(((p["m"] + 32) * 64 * 9 / 16 + 2 * p["m"] * 32)
                                                 / res["copy_bw_bytes_s"] * 1e6)
    results = tmp_path / "RESULTS.md"
    results.write_text("# R\n\n## Before\nkeep 1\n\n## Backend comparison\nstale\n\n## After\nkeep 2\n")
    rb.replace_section(results, rb.render_section(res, "cmd", "2026-11-29", {}))
    text = results.read_text()
    assert "keep 1" in text and "keep 2" in text and "stale" not in text
    assert text.count("## Backend comparison") == 1 and "### N=32, K=64" in text and "| 20 |" in text


@pytest.mark.parametrize("wrong, said", [
    pytest.param("reference", r"str 'reference'", id="name"),
    pytest.param(Dispatcher, r"the class itself", id="class"),
])
def test_set_dispatcher_refuses_what_is_not_a_dispatcher_before_a_call_trips_on_it(wrong, said):
    with pytest.raises(InvalidInputError, match=r"^set_dispatcher: dispatcher must be None \(a fresh one on next "
                                                r"use\) or a fp4dispatch\.dispatch\.dispatcher\.Dispatcher; got "
                                                rf"{said}\. Pass e\.g\. Dispatcher\(cache_dir=\.\.\.\)$"):
        fp4dispatch.set_dispatcher(wrong)
    a, b, sa, sb, alpha = make_nvfp4_inputs(4, 32, 64)
    assert fp4dispatch.fp4_mm(a, b, sa, sb, alpha).shape == (4, 32)  # the default dispatcher is still in place


def test_a_layers_mode_set_after_construction_takes_effect_and_survives_pickling():
    import pickle

    torch.manual_seed(0)
    layer = Fp4Linear.from_linear(torch.nn.Linear(64, 32), mode="w4a4")
    x = torch.randn(3, 64)
    w4a4 = layer(x)
    layer.mode = "w4a16"
    assert layer.resolved_mode(CPU) == "w4a16" and not torch.equal(layer(x), w4a4)
    again = pickle.loads(pickle.dumps(layer))
    assert again.mode == "w4a16" and torch.equal(again(x), layer(x))
    state = layer.__getstate__()  # as a layer pickled while mode was a plain attribute holds it
    state["mode"] = state.pop("_mode")
    old = Fp4Linear.__new__(Fp4Linear)
    old.__setstate__(state)
    assert old.mode == "w4a16" and torch.equal(old(x), layer(x))


def test_loading_a_saved_layer_keeps_its_bias_dtype():
    """Fp4Linear(in, out) makes a bf16 bias: a saved layer's fp32 bias was rounded into it, silently ("All keys
    matched"), and the state dict no longer round-tripped."""
    torch.manual_seed(0)
    src = Fp4Linear.from_linear(torch.nn.Linear(64, 32), mode="w4a16")
    dst = Fp4Linear(64, 32, mode="w4a16")
    assert src.bias.dtype == torch.float32 and dst.bias.dtype == torch.bfloat16
    dst.load_state_dict(src.state_dict())
    x = torch.randn(3, 64)
    assert dst.bias.dtype == torch.float32 and torch.equal(dst(x), src(x))
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))


def test_a_dynamic_scale_layer_exports():
    """Its None buffers came before the bias: torch.export's buffer bookkeeping raised a bare IndexError."""
    torch.manual_seed(0)
    layer = Fp4Linear.from_linear(torch.nn.Linear(64, 32), mode="w4a4")
    x = torch.randn(3, 64)
    exported = torch.export.export(layer, (x,))
    assert torch.equal(exported.module()(x), layer(x))


@pytest.mark.parametrize("make", [lambda: Fp4Linear.from_linear(torch.nn.Linear(64, 32), mode="w4a4"),
                                  lambda: Fp4Experts(2, 64, 32, mode="w4a4")], ids=["Fp4Linear", "Fp4Experts"])
def test_an_input_on_another_device_is_named_in_dynamic_w4a4_too(make):
    """W4A16 and static W4A4 named it (through the ops' checks); dynamic W4A4 raised a raw RuntimeError from its
    alpha's division."""
    layer = make()
    name = type(layer).__name__
    args = (torch.zeros(3, 2, dtype=torch.int32, device="meta"),) if name == "Fp4Experts" else ()
    with pytest.raises(InvalidInputError, match=rf"^{name}: x must be on the layer's device cpu; got x.device=meta\. "
                                                r"Move the input or the layer \(\.to\)$"):
        layer(torch.zeros(3, 64, device="meta"), *args)
