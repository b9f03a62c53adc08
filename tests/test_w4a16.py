"""``w4a16_mm`` on the CPU: its contract and messages, exactness against float64, and the dispatcher's machinery
(per-key checks, fallbacks, the cache key) applied to it unchanged with fake backends and a fake timer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fp4dispatch
from fp4dispatch import InvalidInputError, dequantize_nvfp4, quantize_nvfp4, unswizzle_scales
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.records import check_key, key_str
from fp4dispatch.dispatch.verify import make_case
from fp4dispatch.backends.reference import ReferenceBackend, reference_mm
from fp4dispatch.problem import Problem
from fp4dispatch.testing import FakeBackend, fake_do_bench

CPU = torch.device("cpu")


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wq, ws, wg = quantize_nvfp4(torch.randn(n, k, generator=g))
    return wq, ws, (1.0 / wg).float().reshape(1)


def _f64(a, wq, ws, alpha):
    return a.double() @ dequantize_nvfp4(wq, ws).double().T * float(alpha)


def _disp(backends, tmp_path):
    return Dispatcher(backends, cache_dir=tmp_path / "c", do_bench=fake_do_bench)


# -- exactness ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adt", [torch.bfloat16, torch.float16])
def test_fp32_out_equals_float64_where_every_partial_sum_is_exact(tmp_path, adt):
    # activations k/4 with |k| < 8 and weight scales 2^-2..2^2: every product and partial sum of K=64 terms has few
    # enough significant bits for fp32, so any summation order gives the float64 result exactly
    g = torch.Generator().manual_seed(1)
    a = (torch.randint(-8, 8, (5, 64), generator=g).float() / 4).to(adt)
    wq = torch.randint(0, 256, (48, 32), dtype=torch.uint8, generator=g)
    scales = torch.exp2(torch.randint(-2, 3, (48, 4), generator=g).float()).to(torch.float8_e4m3fn)
    ws = fp4dispatch.swizzle_scales(scales)
    out = _disp([ReferenceBackend()], tmp_path).w4a16_mm(a, wq, ws, 0.5, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out.double(), _f64(a, wq, ws, 0.5))


def test_bf16_out_is_the_float64_result_rounded_once(tmp_path):
    a = torch.randn(7, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    wq, ws, alpha = _weight(96, 256)
    out = _disp([ReferenceBackend()], tmp_path).w4a16_mm(a, wq, ws, alpha)
    assert out.dtype == torch.bfloat16  # out_dtype defaults to a's dtype
    ref = _f64(a, wq, ws, alpha)
    # the fp32 sum rounds a little, then the one cast to bf16: within one bf16 ulp of the exact result
    assert bool(((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all())


def test_make_case_holds_hostile_activations_and_the_reference_uses_them_as_they_are():
    p = Problem(6, 64, 128, torch.bfloat16, CPU, torch.bfloat16)
    case = make_case(p, 3, reference_mm)
    a = case.ops.a
    assert a.dtype == torch.bfloat16 and a.shape == (6, 128) and case.ops.a_scale.numel() == 0
    assert bool((a[0, :16] == 0).all()) and float(a[1:].abs().max()) > 0
    # full mantissas: bf16 values that a 16-element NVFP4 block could not hold exactly
    assert not torch.equal(a.float(), a.float().round())
    exp = a.double() @ dequantize_nvfp4(case.ops.b, case.ops.b_scale).double().T * float(case.ops.alpha)
    finite = torch.isfinite(exp)
    assert torch.allclose(case.ref.double()[finite], exp[finite], rtol=1e-5, atol=1e-3)


# -- the dispatcher's machinery -----------------------------------------------------------------------------------
W4A16_FAILURES = [dict(result="zeros"), dict(result="nan"), dict(result="transposed"), dict(result="scaled"),
                  dict(result="abs_alpha"), dict(result="nan_scale_as_zero"), dict(mutates="a"),
                  dict(out_fault="past_end"), dict(raises=RuntimeError("launch failed"))]


@pytest.mark.parametrize("kw", W4A16_FAILURES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_failure_mode_of_a_w4a16_backend_is_caught_per_key(tmp_path, kw):
    bad = FakeBackend("bad", cost=1e-6, ops=("w4a16",), **kw)  # the fastest: only the checks keep it out
    good = FakeBackend("good", cost=1e-3, ops=("w4a16",))
    d = _disp([bad, good], tmp_path)
    wq, ws, alpha = _weight(64, 128)
    for m in (1, 5, 300):
        a = torch.randn(m, 128).to(torch.bfloat16)
        out = d.w4a16_mm(a, wq, ws, alpha, out_dtype=torch.float32)
        ref = _f64(a, wq, ws, alpha)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
        assert d.choose(Problem(m, 64, 128, torch.float32, CPU, torch.bfloat16)).backend is good


def test_a_w4a16_key_is_its_own_and_only_w4a16_backends_compete(tmp_path):
    fp4_only = FakeBackend("fp4-only", cost=1e-9)
    w4 = FakeBackend("w4", cost=1e-3, ops=("w4a16",))
    both = FakeBackend("both", cost=1e-4, ops=("fp4_mm", "w4a16"))
    d = _disp([fp4_only, w4, both], tmp_path)
    p = Problem(16, 64, 128, torch.bfloat16, CPU, torch.bfloat16)
    assert d.choose(p).backend is both
    assert [b.name for b, _ in d.choose(p).fallbacks] == ["w4"]  # fp4-only never ran on the w4a16 key
    assert d.choose(p._replace(a_dtype=torch.uint8)).backend is fp4_only
    ks = key_str(p.key)
    assert ks == "w4a16-bfloat16-m16-n64-k128-bfloat16" and key_str(p._replace(a_dtype=torch.uint8).key) == \
        "m16-n64-k128-bfloat16"
    check_key(ks)
    assert set(d.cache_for(CPU).decisions) == {ks, "m16-n64-k128-bfloat16"}
    with pytest.raises(InvalidInputError, match=r"^w4a16_mm: backend 'fp4-only' computes fp4_mm only; pass one of "
                                                r"\['both', 'w4'\] or none"):
        d.choose(p, backend="fp4-only")


def test_a_probe_of_a_w4a16_only_backend_uses_w4a16_problems(tmp_path):
    seen = []

    class Recording(FakeBackend):
        def run(self, problem, ops, config):
            seen.append((problem.op, ops.a.dtype))
            super().run(problem, ops, config)

    d = _disp([Recording("w4", ops=("w4a16",))], tmp_path)
    assert d.report("cpu")[0].status == "ok"
    assert seen and set(seen) == {("w4a16", torch.bfloat16)}


# -- the contract ---------------------------------------------------------------------------------------------------
def _args(m=3, n=64, k=128, adt=torch.bfloat16):
    wq, ws, alpha = _weight(n, k)
    return torch.randn(m, k).to(adt), wq, ws, alpha


ERRORS = [
    (lambda a, b, s, al: (a.float(), b, s, al), {},
     r"^w4a16_mm: a must be bfloat16 or float16 \[M, K\] \(W4A16: activations as they are\); got "
     r"dtype=torch.float32\. Cast it with a.to\(torch.bfloat16\)$"),
    (lambda a, b, s, al: (b, b, s, al), {},
     r"^w4a16_mm: a must be bfloat16 or float16 .* got dtype=torch.uint8\. It holds packed NVFP4 data: that is "
     r"fp4_mm's a \(with a_scale\)$"),
    (lambda a, b, s, al: (b.view(torch.float4_e2m1fn_x2), b, s, al), {},  # was told to cast it to bf16
     r"^w4a16_mm: a must be bfloat16 or float16 .* got dtype=torch.float4_e2m1fn_x2\. It holds packed NVFP4 data: "
     r"that is fp4_mm's a \(with a_scale\)$"),
    (lambda a, b, s, al: (a[None], b, s, al), {},
     r"^w4a16_mm: a must be 2-D \[M, K\]; got a.shape=\(1, 3, 128\)\. Flatten the leading dims"),
    (lambda a, b, s, al: (a[:, :64], b, s, al), {},
     r"^w4a16_mm: b must be \[N, K/2\] with K = a.shape\[1\] = 64; got b.shape=\(64, 64\) \(K/2 = 64\)\.$"),
    (lambda a, b, s, al: (a, torch.zeros(64, 96, dtype=torch.uint8), s, al), {},  # a [96, 64] weight, transposed
     r"^w4a16_mm: b must be \[N, K/2\] with K = a.shape\[1\] = 128; got b.shape=\(64, 96\) \(K/2 = 96\)\. b "
     r"looks transposed \(\[K/2, N\]\): pass the \[N, K/2\] weight$"),
    (lambda a, b, s, al: (a.T.contiguous().T, b, s, al), {},
     r"^w4a16_mm: a must be contiguous \[M, K\]; got strides \(1, 3\) for shape \(3, 128\)\. Call a.contiguous\(\)$"),
    (lambda a, b, s, al: (a, b, s[:64], al), {},
     r"^w4a16_mm: b_scale with scale_layout='swizzled' must have shape \(128, 8\)"),
    (lambda a, b, s, al: (a, b.T, s, al), {},  # a square weight, transposed: b.contiguous() would compute with it
     r"^w4a16_mm: b must be contiguous \[N, K/2\]; got strides \(1, 64\) for shape \(64, 64\)\. It is a transposed "
     r"view: pass the contiguous \[N, K/2\] weight itself$"),
    (lambda a, b, s, al: (a, b, s, al.half()), {}, r"^w4a16_mm: alpha must be float32; got dtype=torch.float16"),
    (lambda a, b, s, al: (a, b, s, al.bfloat16()), {},
     r"^w4a16_mm: alpha must be float32; got dtype=torch.bfloat16\. Compute 1/gs_b \(the weight's decode global "
     r"scale, e.g. ModelOpt's weight_scale_2\) in float32 \(a bf16 global scale gave silently wrong outputs in "
     r"FlashInfer #3398\); w4a16_mm never converts it for you$"),
    (lambda a, b, s, al: (a, b, s, 1e39), {},
     r"^w4a16_mm: alpha=1e\+39 does not fit in float32 \(largest 3.403e\+38\); alpha is 1/gs_b \(the weight's "
     r"decode global scale, e.g. ModelOpt's weight_scale_2\) and is normally far smaller: check the global scales$"),
    (lambda a, b, s, al: (a, b, s, al), {"out_dtype": torch.int8},
     r"^w4a16_mm: out_dtype must be None \(a's dtype\), torch.bfloat16, torch.float16 or torch.float32; got "
     r"torch.int8$"),
    (lambda a, b, s, al: (a, b, s, al), {"out": torch.empty(3, 64, dtype=torch.float32)},
     r"^w4a16_mm: out must be a contiguous \[M, N\]=\(3, 64\) tensor of dtype torch.bfloat16 on cpu; got .* or "
     r"pass out_dtype$"),
]


@pytest.mark.parametrize("change, kw, message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_every_contract_error_names_argument_expected_got_and_fix(tmp_path, change, kw, message):
    d = _disp([ReferenceBackend()], tmp_path)
    with pytest.raises(InvalidInputError, match=message):
        d.w4a16_mm(*change(*_args()), **kw)


def test_linear_scales_fp16_activations_and_an_empty_m(tmp_path):
    d = _disp([ReferenceBackend()], tmp_path)
    a, wq, ws, alpha = _args(adt=torch.float16)
    lin = unswizzle_scales(ws.view(torch.uint8), 64, 8).view(torch.float8_e4m3fn)
    out = d.w4a16_mm(a, wq, lin, alpha, scale_layout="linear")
    assert out.dtype == torch.float16 and torch.equal(out, d.w4a16_mm(a, wq, ws, alpha))
    assert d.w4a16_mm(a[:0], wq, ws, alpha).shape == (0, 64)


def test_the_public_call_and_the_custom_op_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    fp4dispatch.set_dispatcher(None)
    try:
        a, wq, ws, alpha = _args()
        out = fp4dispatch.w4a16_mm(a, wq, ws, alpha)
        assert torch.equal(out, torch.ops.fp4dispatch.w4a16_mm(a, wq, ws, alpha, None, "swizzled", None))
        buf = torch.empty_like(out)
        torch.ops.fp4dispatch.w4a16_mm_out(a, wq, ws, alpha, buf, "swizzled", None)
        assert torch.equal(out, buf)
    finally:
        fp4dispatch.set_dispatcher(None)


def test_w4a16_mm_compiles_fullgraph_with_a_tensor_python_or_numpy_float_alpha(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    fp4dispatch.set_dispatcher(None)
    try:
        a, wq, ws, alpha = _args()
        for al in (alpha, 0.25, np.float64(0.25), np.float32(0.5)):  # NumPy: a 0-d ndarray to Dynamo
            fn = torch.compile(lambda x, al=al: fp4dispatch.w4a16_mm(x, wq, ws, al), fullgraph=True, backend="eager")
            assert torch.equal(fn(a), fp4dispatch.w4a16_mm(a, wq, ws, al))
    finally:
        fp4dispatch.set_dispatcher(None)


TRACED_ERRORS = [
    ("out-vs-out_dtype", {"out_dtype": torch.float16, "out": "f32"},
     r"w4a16_mm: out must be a contiguous \[M, N\]=\(3, 64\) tensor of dtype torch.float16 on cpu; got shape=\(3, "
     r"64\), dtype=torch.float32.* or pass out_dtype"),
    ("out-vs-a-dtype", {"out": "f32"},
     r"w4a16_mm: out must be a contiguous \[M, N\]=\(3, 64\) tensor of dtype torch.bfloat16 on cpu; got .*"
     r"dtype=torch.float32"),
    ("alpha-1e39", {"alpha": 1e39}, r"w4a16_mm: alpha=1e\+39 does not fit in float32 \(largest 3.403e\+38\)"),
    ("alpha-bool", {"alpha": True},
     r"w4a16_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got bool"),
    ("alpha-str", {"alpha": "0.5"},
     r"w4a16_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got str"),
]


@pytest.mark.parametrize("kw, message", [c[1:] for c in TRACED_ERRORS], ids=[c[0] for c in TRACED_ERRORS])
def test_a_compiled_w4a16_mm_fails_at_trace_time_with_the_eager_message(kw, message):
    a, wq, ws, alpha = _args()
    kw = {"alpha": alpha, **kw}
    if kw.get("out") == "f32":
        kw["out"] = torch.empty(3, 64, dtype=torch.float32)
    with pytest.raises(InvalidInputError, match=message):
        fp4dispatch.w4a16_mm(a, wq, ws, **kw)
    # dynamic=False: alpha is traced as the constant it is (a float Dynamo makes symbolic has no repr to print)
    fn = torch.compile(lambda x: fp4dispatch.w4a16_mm(x, wq, ws, **kw), fullgraph=True, backend="aot_eager",
                       dynamic=False)
    with pytest.raises(Exception, match=message):  # Dynamo's error, which carries the eager one
        fn(a)


def test_fp4dispatch_backend_forces_only_the_ops_its_backend_computes(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "fp4-only")
    fp4_only = FakeBackend("fp4-only", cost=1e-3)
    w4 = FakeBackend("w4", cost=1e-3, ops=("w4a16",))
    d = _disp([fp4_only, w4], tmp_path)
    p = Problem(3, 64, 128, torch.bfloat16, CPU, torch.bfloat16)
    assert d.choose(p).backend is w4  # w4a16 calls are decided as usual
    assert d.choose(p._replace(a_dtype=torch.uint8)).backend is fp4_only  # fp4_mm calls take the forced one
    with pytest.raises(InvalidInputError, match=r"^w4a16_mm: backend 'fp4-only' computes fp4_mm only"):
        d.choose(p, backend="fp4-only")  # an explicit backend= for the wrong op is the caller's mistake


def test_warmup_decides_w4a16_keys_before_capture(tmp_path):
    from fp4dispatch.graphs import warmup

    w4 = FakeBackend("w4", cost=1e-3, ops=("w4a16",))
    d = _disp([FakeBackend("fp4", cost=1e-3), w4], tmp_path)
    got = warmup([(3, 64, 128), (16, 64, 128)], activations=torch.bfloat16, dispatcher=d, device="cpu")
    assert got == {(3, 64, 128): "w4", (16, 64, 128): "w4"}
    assert set(d.cache_for(CPU).decisions) == {"w4a16-bfloat16-m4-n64-k128-bfloat16",
                                                "w4a16-bfloat16-m16-n64-k128-bfloat16"}
    assert w4.calls > 0  # run=True ran each shape once through w4a16_mm
    with pytest.raises(InvalidInputError, match=r"^warmup: activations must be None \(fp4_mm\), torch.bfloat16 or "
                                                r"torch.float16 \(w4a16_mm\); got torch.float32$"):
        warmup([(3, 64, 128)], activations=torch.float32, dispatcher=d, device="cpu")


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_the_validation_fast_path_returns_what_the_explaining_path_returns(out_dtype):
    from fp4dispatch.validate import _check_w4a16, check_w4a16_mm_args

    a, wq, ws, alpha = _args()
    out = torch.empty(3, 64, dtype=out_dtype or a.dtype)
    slow = _check_w4a16(a, wq, ws, alpha, out_dtype, out, "swizzled")  # also creates the per-device empty a_scale
    fast = check_w4a16_mm_args(a, wq, ws, alpha, out_dtype, out, "swizzled")
    assert fast[0] == slow[0] and all(x is y for x, y in zip(fast[1], slow[1]))
    assert type(fast[0]) is type(slow[0]) and fast[0].op == "w4a16"
