"""``w4a16_grouped_mm``: the MoE expert GEMM with bf16/fp16 activations as they are. Exactness on the CPU, the
dispatcher's machinery for its keys (its own op: only backends that compute it compete), every failure mode of a
fake backend caught per key, and the input errors, each pinned."""
from __future__ import annotations

import re

import pytest
import torch

import fp4dispatch
from fp4dispatch import InvalidInputError
from fp4dispatch.backends.reference import ReferenceBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.records import check_key, key_str
from fp4dispatch.format import dequantize_nvfp4
from fp4dispatch.format_grouped import swizzle_expert_scales
from fp4dispatch.problem import Problem
from fp4dispatch.routing import offs_from_counts
from fp4dispatch.testing import FakeBackend, fake_do_bench

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _disp(backends, tmp_path):
    return Dispatcher(backends, cache_dir=tmp_path / "c", do_bench=fake_do_bench)


def _inputs(counts, n=64, k=128, seed=0, adt=BF16):
    """(a, b, b_scale swizzled, alpha, offs) with power-of-two scales, alphas and activations, so that every fp32
    partial sum is exact."""
    g = torch.Generator().manual_seed(seed)
    offs = offs_from_counts(torch.tensor(counts))
    t, e = int(offs[-1]), len(counts)
    a = (torch.exp2(torch.randint(-2, 2, (t, k), generator=g).float())
         * torch.randint(-1, 2, (t, k), generator=g).float()).to(adt)
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    sb = torch.exp2(torch.randint(-1, 2, (e, n, k // 16), generator=g).float()).to(torch.float8_e4m3fn)
    alpha = torch.exp2(torch.randint(-2, 3, (e,), generator=g).float())
    return a, b, swizzle_expert_scales(sb), alpha, offs


def _f64(a, b, sb, alpha, offs):
    n, k = b.shape[1], a.shape[1]
    from fp4dispatch.format_grouped import unswizzle_expert_scales

    lin = unswizzle_expert_scales(sb, n, k // 16)
    out = torch.zeros(a.shape[0], n, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        w = dequantize_nvfp4(b[e], lin[e], scale_layout="linear", dtype=torch.float64)
        out[start:end] = a[start:end].double() @ w.T * float(alpha[e])
        start = end
    return out


@pytest.mark.parametrize("counts", [[0, 5, 0, 2], [7], [0, 0, 130, 1, 0]])
def test_fp32_out_equals_float64_where_every_sum_is_exact(tmp_path, counts):
    ops = _inputs(counts)
    out = _disp([ReferenceBackend()], tmp_path).w4a16_grouped_mm(*ops, out_dtype=torch.float32)
    assert torch.equal(out.double(), _f64(*ops))
    one = fp4dispatch.w4a16_grouped_mm(ops[0][:0], *ops[1:4], torch.zeros(len(counts), dtype=torch.int32))
    assert one.shape == (0, 64) and one.dtype == BF16


def test_one_expert_equals_w4a16_mm_and_the_key_is_its_own(tmp_path):
    d = _disp([ReferenceBackend()], tmp_path)
    a, b, sb, alpha, offs = _inputs([37])
    dense = d.w4a16_mm(a, b[0], sb[0], alpha, out_dtype=torch.float32)
    assert torch.equal(d.w4a16_grouped_mm(a, b, sb, alpha, offs, out_dtype=torch.float32), dense)
    p = Problem(37, 64, 128, torch.float32, CPU, BF16, 1)
    assert p.op == "w4a16_grouped" and p.call == "w4a16_grouped_mm"
    ks = key_str(p.key)
    assert ks == "w4a16-bfloat16-grouped-e1-m64-n64-k128-float32" and ks in d.cache_for(CPU).decisions
    check_key(ks)


FAILURES = [dict(result="zeros"), dict(result="nan"), dict(result="scaled"), dict(result="abs_alpha"),
            dict(result="one_expert"), dict(mutates="offs"), dict(mutates="a"), dict(out_fault="past_end"),
            dict(raises=RuntimeError("launch failed"))]


@pytest.mark.parametrize("kw", FAILURES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_failure_mode_of_a_w4a16_grouped_backend_is_caught_per_key(tmp_path, kw):
    bad = FakeBackend("bad", cost=1e-6, ops=("w4a16_grouped",), **kw)  # the fastest: only the checks keep it out
    good = FakeBackend("good", cost=1e-3, ops=("w4a16_grouped",))
    grouped = FakeBackend("nvfp4-only", cost=1e-9, ops=("grouped",))  # another op's backend never competes
    d = _disp([grouped, bad, good], tmp_path)
    for counts in ([0, 1, 0, 0], [2, 0, 3, 0], [0, 100, 150, 50]):
        ops = _inputs(counts, seed=len(counts))
        out = d.w4a16_grouped_mm(*ops, out_dtype=torch.float32)
        ref = _f64(*ops)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
        assert d.choose(Problem(sum(counts), 64, 128, torch.float32, CPU, BF16, 4)).backend is good


@pytest.mark.parametrize("call, message", [
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a.view(torch.uint8), b, sb, al, offs),
     r"^w4a16_grouped_mm: a must be bfloat16 or float16 \[T, K\] \(W4A16: activations as they are\); got "
     r"dtype=torch.uint8\. It holds packed NVFP4 data: that is fp4_grouped_mm's a \(with a_scale\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(b[0].view(torch.float4_e2m1fn_x2)[:8], b, sb, al,
                                                             offs),
     r"^w4a16_grouped_mm: a must be bfloat16 or float16 .*got dtype=torch.float4_e2m1fn_x2\. It holds packed NVFP4 "
     r"data: that is fp4_grouped_mm's a \(with a_scale\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a.float(), b, sb, al, offs),
     r"^w4a16_grouped_mm: a must be bfloat16 or float16 .*got dtype=torch.float32\. Cast it with "
     r"a.to\(torch.bfloat16\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a.t(), b, sb, al, offs),
     r"^w4a16_grouped_mm: a must be 2-D contiguous \[T, K\]; got shape=\(128, 7\), strides=\(1, 128\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a[:, :64], b, sb, al, offs),
     r"^w4a16_grouped_mm: a must be 2-D contiguous"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a[:, :64].contiguous(), b, sb, al, offs),
     r"^w4a16_grouped_mm: b.shape\[2\] \(K/2\) must be a.shape\[1\]/2 = 32; got a.shape=\(7, 64\), "
     r"b.shape=\(4, 64, 64\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b.transpose(1, 2), sb, al, offs),
     r"^w4a16_grouped_mm: b must be contiguous \[E, N, K/2\] .*; got strides \(4096, 1, 64\) for shape \(4, 64, 64\)\. "
     r"It is a transposed view: pass the contiguous \[E, N, K/2\] weight itself, not b.contiguous\(\) \(that is the "
     r"transposed weight\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b[:, :32].transpose(1, 2).contiguous(), sb, al,
                                                             offs),
     r"^w4a16_grouped_mm: b.shape\[2\] \(K/2\) must be a.shape\[1\]/2 = 64; got a.shape=\(7, 128\), "
     r"b.shape=\(4, 64, 32\) \(if b holds each expert's weight transposed, \[E, K/2, N\], pass the \[E, N, K/2\] "
     r"one\)$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al, offs[:3]),
     r"^w4a16_grouped_mm: offs must be 1-D \[E\] with E = b.shape\[0\] = 4"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al, offs - 1),
     r"^w4a16_grouped_mm: offs must be non-decreasing cumulative end rows starting at >= 0"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al.numpy(), offs),
     r"^w4a16_grouped_mm: alpha must be a float32 tensor \[E\]=\[4\] \(one 1/gs_b\[e\] per expert\) or one value "
     r".*; got numpy.ndarray\. Build it with torch.tensor\(values, dtype=torch.float32, device=a.device\)$"),
    # a meta table was read on the host: a raw NotImplementedError
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(*(t.to("meta") for t in (a, b, sb, al, offs))),
     r"^w4a16_grouped_mm: tensors must hold data on a CPU or CUDA device; got device meta\. Meta and fake tensors go "
     r"through torch.compile \(the custom op\), not a direct call$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al[:3], offs),
     r"^w4a16_grouped_mm: alpha must have E=4 elements \(one 1/gs_b\[e\] per expert\) or one"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al.bfloat16(), offs),
     r"^w4a16_grouped_mm: alpha must be float32; got dtype=torch.bfloat16\. Compute each expert's 1/gs_b\[e\] \(each "
     r"expert's weight decode global scale, e.g. its weight_scale_2\) in float32; w4a16_grouped_mm never converts "
     r"it for you$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al[:1].bfloat16(), offs),
     r"^w4a16_grouped_mm: alpha must be float32; got dtype=torch.bfloat16\. Compute 1/gs_b\[e\] \(each expert's "
     r"weight decode global scale, e.g. its weight_scale_2\) in float32 .*; w4a16_grouped_mm never converts it"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb, al, offs, out_dtype=torch.int8),
     r"^w4a16_grouped_mm: out_dtype must be None \(a's dtype\), torch.bfloat16, torch.float16 or torch.float32; "
     r"got torch.int8$"),
    (lambda a, b, sb, al, offs: fp4dispatch.w4a16_grouped_mm(a, b, sb[:, :64].contiguous(), al, offs),
     r"^w4a16_grouped_mm: b_scale with scale_layout='swizzled' must have shape \(4, 128, 8\)"),
])
def test_bad_calls_are_explained(call, message):
    a, b, sb, alpha, offs = _inputs([0, 5, 0, 2])
    with pytest.raises(InvalidInputError, match=message):
        call(a, b, sb, alpha, offs)


TRACED_ERRORS = [
    ("out-vs-out_dtype", {"out_dtype": torch.float16, "out": "f32"},
     r"w4a16_grouped_mm: out must be a contiguous \[T, N\]=\(5, 64\) tensor of dtype torch.float16 on cpu that "
     r"does not require grad; got shape=\(5, 64\), dtype=torch.float32"),
    ("alpha-1e39", {"alpha": 1e39}, r"w4a16_grouped_mm: alpha=1e\+39 does not fit in float32 \(largest 3.403e\+38\)"),
    ("alpha-bool", {"alpha": True},
     r"w4a16_grouped_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got bool"),
    ("alpha-str", {"alpha": "0.5"},
     r"w4a16_grouped_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got str"),
]


@pytest.mark.parametrize("kw, message", [c[1:] for c in TRACED_ERRORS], ids=[c[0] for c in TRACED_ERRORS])
def test_a_compiled_call_fails_at_trace_time_with_the_eager_message(kw, message):
    a, b, sb, alpha, offs = _inputs([0, 3, 2, 0])
    kw = {"alpha": alpha, **kw}
    if kw.get("out") == "f32":
        kw["out"] = torch.empty(5, 64, dtype=torch.float32)
    with pytest.raises(InvalidInputError, match=message):
        fp4dispatch.w4a16_grouped_mm(a, b, sb, offs=offs, check_offs=False, **kw)
    # dynamic=False: alpha is traced as the constant it is (a float Dynamo makes symbolic has no repr to print)
    fn = torch.compile(lambda x: fp4dispatch.w4a16_grouped_mm(x, b, sb, offs=offs, **kw), fullgraph=True,
                       backend="aot_eager", dynamic=False)
    with pytest.raises(Exception, match=message):  # Dynamo's error, which carries the eager one
        fn(a)


def test_a_compiled_call_reads_and_checks_offs_as_the_eager_one_does(tmp_path, monkeypatch):
    """As fp4_grouped_mm's: the custom ops take the caller's check_offs (they had always passed False)."""
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    fp4dispatch.set_dispatcher(_disp([ReferenceBackend()], tmp_path))
    try:
        a, b, sb, alpha, offs = _inputs([3, 0, 5])

        def checked(x, o, flag=True):
            return fp4dispatch.w4a16_grouped_mm(x, b, sb, alpha, o, check_offs=flag)

        fn = torch.compile(checked, fullgraph=True, backend="aot_eager")
        assert torch.equal(fn(a, offs), checked(a, offs))
        bad = torch.tensor([3, 3, 100], dtype=torch.int32)
        msg = r"^w4a16_grouped_mm: offs\[-1\] must equal T = a.shape\[0\] = 8 \(every row belongs to an expert\)"
        for f in (checked, fn):
            with pytest.raises(InvalidInputError, match=msg):
                f(a, bad)
        msg = re.escape("w4a16_grouped_mm: check_offs must be True (offs read on the host and checked: one sync) or "
                        "False (not read: no sync; a swizzled a_scale then needs grouped_scale_rows(T, E) rows); got "
                        "None")
        with pytest.raises(InvalidInputError, match=msg):
            checked(a, offs, None)
        with pytest.raises(Exception, match=msg):
            torch.compile(lambda x: checked(x, offs, None), fullgraph=True, backend="aot_eager", dynamic=False)(a)
    finally:
        fp4dispatch.set_dispatcher(None)


def test_the_public_call_the_custom_ops_and_torch_compile_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    fp4dispatch.set_dispatcher(_disp([ReferenceBackend()], tmp_path))
    try:
        a, b, sb, alpha, offs = _inputs([0, 3, 2, 0])
        out = fp4dispatch.w4a16_grouped_mm(a, b, sb, alpha, offs)
        assert torch.equal(out, torch.ops.fp4dispatch.w4a16_grouped_mm(a, b, sb, alpha, offs, None, "swizzled",
                                                                       None))
        buf = torch.empty_like(out)
        torch.ops.fp4dispatch.w4a16_grouped_mm_out(a, b, sb, alpha, offs, buf, "swizzled", None)
        assert torch.equal(out, buf)
        fn = torch.compile(lambda x, o: fp4dispatch.w4a16_grouped_mm(x, b, sb, alpha, o), fullgraph=True,
                           backend="eager")
        assert torch.equal(fn(a, offs), out)
    finally:
        fp4dispatch.set_dispatcher(None)
