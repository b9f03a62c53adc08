"""Reliability defects 13-14 (input and environment errors that escaped), and the also-fix items: a printable report,
CPU decisions that load cannot sway. Each test starts with the defect's reproducer."""
from __future__ import annotations


import re

import pytest
import torch

from _reliability_helpers import CPU, KEY, disp, exact, right
import numpy as np

from fp4dispatch import InvalidInputError, fp4_mm, quantize_nvfp4
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.settings import read_settings
from fp4dispatch.testing import FakeBackend, make_nvfp4_inputs


# -- 13. input errors name the argument -------------------------------------------------------------------------
def _args(**kw):
    a, b, sa, sb, al = make_nvfp4_inputs(5, 48, 64)
    args = dict(a=a, b=b, a_scale=sa, b_scale=sb, alpha=al)
    args.update(kw)
    return args


INPUT_ERRORS = [
    ("alpha-1e300", lambda: fp4_mm(**_args(alpha=1e300)), r"alpha=1e\+300 does not fit in float32"),
    ("alpha-10**40", lambda: fp4_mm(**_args(alpha=10 ** 40)), r"alpha=10000000000000000000\.\.\. does not fit"),
    ("alpha-array", lambda: fp4_mm(**_args(alpha=np.array([1.0, 2.0]))),
     r"alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got numpy\.ndarray"),
    ("meta", lambda: fp4_mm(**{k: v.to("meta") for k, v in _args().items()}),
     r"tensors must hold data on a CPU or CUDA device; got device meta"),
    ("n-equals-k-half", lambda: fp4_mm(**_args(b=torch.zeros(32, 40, dtype=torch.uint8))),
     r"b.shape\[1\] \(K/2\) must equal a.shape\[1\]=32: a and b disagree on K; got a.shape=\(5, 32\), "
     r"b.shape=\(32, 40\) \(if b is a transposed"),
    ("transposed-view", lambda: fp4_mm(**_args(b=torch.zeros(48, 32, dtype=torch.uint8).T)),
     r"the transposed view \[K/2, N\] = FlashInfer's b.T"),
]


@pytest.mark.parametrize("case", [c[1:] for c in INPUT_ERRORS], ids=[c[0] for c in INPUT_ERRORS])
def test_13_input_errors_are_invalid_input_errors_with_the_argument(case):
    call, message = case
    with pytest.raises(InvalidInputError, match=message):
        call()


def test_13_numpy_alpha_and_empty_quantize_work():
    args = _args(alpha=np.float32(-0.5))  # was: "...; got float32"
    out = fp4_mm(**args, out_dtype=torch.float32)
    ref = exact(args["a"], args["b"], args["a_scale"], args["b_scale"], -0.5)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    q, s, g = quantize_nvfp4(torch.randn(0, 64))  # was: raw "amax(): Expected reduction dim"
    assert q.shape == (0, 32) and s.shape == (0, 4) and float(g) == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_13_cuda_asked_for_without_cuda(tmp_path):
    d = disp([FakeBackend("good")], tmp_path)
    for call in (lambda: d.warmup([(4, 48, 64)], device="cuda"), lambda: d.report("cuda")):
        with pytest.raises(InvalidInputError, match=r"device cuda was asked for, but CUDA is not available here"):
            call()
    with pytest.raises(InvalidInputError, match=r"^make_nvfp4_inputs: device cuda was asked for, but CUDA is not "
                                                 r"available here"):
        make_nvfp4_inputs(4, 48, 64, device="cuda")


# -- 14. environment values --------------------------------------------------------------------------------------
ENV_ERRORS = [
    ("FP4DISPATCH_PROBE_TIMEOUT", "abc", r"FP4DISPATCH_PROBE_TIMEOUT='abc' is not valid; accepted: a positive number"),
    ("FP4DISPATCH_LOG", "LOUD", r"FP4DISPATCH_LOG='LOUD' is not valid; accepted: DEBUG, INFO, WARNING"),
    ("FP4DISPATCH_TUNE", "maybe", r"FP4DISPATCH_TUNE='maybe' is not valid; accepted: 1/true/yes/on or 0/false"),
    ("FP4DISPATCH_ISOLATE", "sometimes", r"FP4DISPATCH_ISOLATE='sometimes' is not valid"),
    ("FP4DISPATCH_GUARD", "2", r"FP4DISPATCH_GUARD='2' is not valid"),
]


@pytest.mark.parametrize("name, value, message", ENV_ERRORS, ids=[e[0] for e in ENV_ERRORS])
def test_14_bad_environment_values_name_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError, match=message):
        read_settings()


def test_14_backend_and_disable_typos_name_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "flashinfer:cutlas")
    with pytest.raises(InvalidInputError, match=r"FP4DISPATCH_DISABLE='flashinfer:cutlas' names no backend "
                                                r"\['flashinfer:cutlas'\]; accepted names: .*'flashinfer:cutlass'"):
        Dispatcher(cache_dir=tmp_path)
    monkeypatch.delenv("FP4DISPATCH_DISABLE")
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "garbage")  # no backend's name: refused before any call
    with pytest.raises(InvalidInputError, match=r"^FP4DISPATCH_BACKEND='garbage' names no backend; accepted names: "
                                                r"\[.*'good'.*\]\. Fix the name or unset the variable$"):
        disp([FakeBackend("good")], tmp_path)
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "reference")  # a backend, but not this dispatcher's
    with pytest.raises(InvalidInputError, match=r"FP4DISPATCH_BACKEND must be one of \['good'\]; got 'reference'. "
                                                r"Fix or unset the variable"):
        right(disp([FakeBackend("good")], tmp_path), 4)


# -- also: readable report, cheap and load-proof CPU decisions --------------------------------------------------
def test_report_prints_a_table_and_keeps_its_records(tmp_path):
    d = disp([FakeBackend("fast", cost=1e-6), FakeBackend("zeros", result="zeros")], tmp_path)
    assert right(d, 4)
    rep = d.report(CPU)
    assert [r.name for r in rep] == ["fast", "zeros"] and rep[0].wins == [KEY]
    lines = str(rep).splitlines()
    assert lines[0].split() == ["backend", "status", "wins", "reason"]
    assert lines[1].split()[:4] == ["fast", "ok", "1", "-"] and lines[2].split()[:2] == ["zeros", "incorrect"]


def test_cpu_decisions_are_not_timed(tmp_path):
    slow_first, fast = FakeBackend("first", cost=1.0), FakeBackend("second", cost=1e-9)
    d = Dispatcher([slow_first, fast], cache_dir=tmp_path / "c")  # no do_bench: the CPU default
    assert right(d, 4)
    entry = d.cache_for(CPU).decisions[KEY]
    assert entry["backend"] == "first" and entry["mode"] == "priority"  # priority order, whatever the load


TRACED = r"^fp4_mm: called directly under {}, whose tensors hold no data to choose a backend with\. Trace it with " \
         r"torch\.compile or torch\.export, or call torch\.ops\.fp4dispatch\.fp4_mm \(the custom op: its fake " \
         r"implementation gives the output's shape\)$"


@pytest.mark.parametrize("tracer", ["FakeTensorMode", "make_fx"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "decided"])
def test_a_direct_call_under_a_fake_or_proxy_mode_records_nothing_against_the_backends(tmp_path, tracer, warm):
    """Before: the dispatcher probed and checked the backends on fake (or proxy) tensors, and the check that could not
    read them was saved as 'incorrect': every later real call raised NoUsableBackendError, in new processes too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp4dispatch.backends.reference import ReferenceBackend

    d = disp([ReferenceBackend()], tmp_path)
    ops = make_nvfp4_inputs(4, 48, 64)
    if warm:
        assert right(d, 4)
    try:
        if tracer == "FakeTensorMode":
            with FakeTensorMode() as mode:
                d.fp4_mm(*(mode.from_tensor(t) for t in ops), out_dtype=torch.float32)
        else:
            make_fx(lambda *t: d.fp4_mm(*t, out_dtype=torch.float32), tracing_mode="real")(*ops)
        assert warm  # a decided key may run its backend's ops on them (make_fx "real" traces them)
    except InvalidInputError as e:  # refused where it would decide, or where the backend raised on them
        name = tracer if tracer != "make_fx" else "make_fx (a proxy tensor mode)"
        assert re.match(TRACED.format(re.escape(name)), str(e)), str(e)
    cache = d.cache_for(CPU)
    assert cache.shape_blacklist == {} and all(v["status"] == "ok" for v in cache.health.values())
    assert right(d, 4) and right(Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c"), 4)


OVERLAP = r"^{}: out must not share memory with {}: the backends write out while they still read {}, so the result " \
          r"would be wrong; got out overlapping {}'s storage\. Pass a separate out \(or none: one is allocated\)$"


def test_an_out_that_shares_memory_with_an_input_is_refused_on_every_path(tmp_path):
    """An in-place layer (out=x, N == K, one dtype) was accepted: the Triton kernels write output tiles while other
    tiles still read x, and returned garbage (30x off), silently; only the reference read everything first. Refused
    on the first call, and on a call the memo would have repeated without its checks."""
    import fp4dispatch
    from fp4dispatch.backends.reference import ReferenceBackend
    from fp4dispatch.format_grouped import swizzle_expert_scales

    d = disp([ReferenceBackend()], tmp_path)
    w, ws, gs = quantize_nvfp4(torch.randn(64, 64))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    al = (1 / gs).reshape(1)
    d.w4a16_mm(x, w, ws, al, out=torch.empty(5, 64, dtype=torch.bfloat16))  # remembered by the memo
    d.w4a16_mm(x, w, ws, al, out=torch.empty(5, 64, dtype=torch.bfloat16))
    for _ in range(2):
        with pytest.raises(InvalidInputError, match=OVERLAP.format("w4a16_mm", *["a"] * 3)):
            d.w4a16_mm(x, w, ws, al, out=x)
    a, b, sa, sb, alpha = make_nvfp4_inputs(4, 8, 64)
    out = torch.empty(4, 8)
    with pytest.raises(InvalidInputError, match=OVERLAP.format("fp4_mm", *["a"] * 3)):
        d.fp4_mm(out.view(torch.uint8)[:, :32], b, sa, sb, alpha, out=out, out_dtype=torch.float32)
    with pytest.raises(InvalidInputError, match=OVERLAP.format("fp4_mm", *["a"] * 3)):  # the slow path's check
        d.fp4_mm(out.view(torch.uint8)[:, :32], b, fp4dispatch.unswizzle_scales(sa, 4, 4),
                 fp4dispatch.unswizzle_scales(sb, 8, 4), alpha, out=out, out_dtype=torch.float32, scale_layout="linear")
    wb = torch.stack([w, w])
    offs = torch.tensor([2, 5], dtype=torch.int32)
    sbe = swizzle_expert_scales(torch.stack([fp4dispatch.unswizzle_scales(ws, 64, 4)] * 2))
    with pytest.raises(InvalidInputError, match=OVERLAP.format("w4a16_grouped_mm", *["a"] * 3)):
        d.w4a16_grouped_mm(x, wb, sbe, torch.cat([al, al]), offs, out=x)
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    assert d.w4a16_mm(x, w, ws, al, out=out) is out  # apart: as before
