"""``fp4_grouped_mm`` on the CPU: the grouped scale layouts, exactness against float64 per expert, the contract and
its messages, and the dispatcher's machinery (per-key checks, the key, the probe) with fake backends and a fake
timer. The Triton kernel runs in Triton's interpreter in a child process (as tests/test_triton_kernels.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp4dispatch
from fp4dispatch import InvalidInputError, quantize_nvfp4, swizzle_scales
from fp4dispatch.backends.expert_loop import ExpertLoopBackend
from fp4dispatch.backends.reference import ReferenceBackend, reference_mm
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.records import check_key, key_str
from fp4dispatch.dispatch.verify import PROBE_E, check_run, make_case
from fp4dispatch.format import E2M1_VALUES
from fp4dispatch.format_grouped import (grouped_scale_rows, scale_starts, swizzle_expert_scales,
                                        swizzle_grouped_scales, unswizzle_expert_scales, unswizzle_grouped_scales)
from fp4dispatch.problem import Problem
from fp4dispatch.routing import check_routing, offs_from_counts, topk_counts
from fp4dispatch.testing import FakeBackend, fake_do_bench

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def _disp(backends, tmp_path):
    return Dispatcher(backends, cache_dir=tmp_path / "c", do_bench=fake_do_bench)


def _offs(counts):
    return offs_from_counts(torch.tensor(counts))


def _inputs(counts, n=64, k=128, seed=0, exact=False):
    """(a, b, a_scale, b_scale, alpha, offs), swizzled; ``exact``: power-of-two scales and alphas, so that every
    fp32 partial sum of K=128 products is exact."""
    g = torch.Generator().manual_seed(seed)
    offs = _offs(counts)
    t, e = int(offs[-1]), len(counts)
    a = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    lo, hi = (-1, 2) if exact else (-3, 4)
    sa = torch.exp2(torch.randint(lo, hi, (t, k // 16), generator=g).float()).to(torch.float8_e4m3fn)
    sb = torch.exp2(torch.randint(lo, hi, (e, n, k // 16), generator=g).float()).to(torch.float8_e4m3fn)
    alpha = torch.exp2(torch.randint(-2, 3, (e,), generator=g).float()) * (1 if exact else 0.75)
    return a, b, swizzle_grouped_scales(sa, offs), swizzle_expert_scales(sb), alpha, offs


def _f64(a, b, sa, sb, alpha, offs):
    """Independent float64 oracle: the e2m1 table, the linear scales, one matmul per expert."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    t, k = a.shape[0], a.shape[1] * 2
    e, n = b.shape[:2]

    def dec(p, s):
        v = torch.stack((lut[(p & 15).long()], lut[(p >> 4).long()]), -1).reshape(*p.shape[:-1], k)
        return (v.reshape(*p.shape[:-1], k // 16, 16) * s.double().unsqueeze(-1)).reshape(*p.shape[:-1], k)

    av = dec(a, unswizzle_grouped_scales(sa, offs, t, k // 16).float())
    bv = dec(b, unswizzle_expert_scales(sb, n, k // 16).float())
    out = torch.zeros(t, n, dtype=torch.float64)
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = av[start:end] @ bv[i].T * float(alpha.reshape(-1)[i if alpha.numel() > 1 else 0])
        start = end
    return out


# -- the layouts ----------------------------------------------------------------------------------------------------
def test_each_experts_activation_scales_are_a_dense_swizzled_matrix_at_its_padded_start():
    counts = [0, 3, 0, 197, 1, 128]
    offs = _offs(counts)
    lin = torch.randint(0, 127, (sum(counts), 5), dtype=torch.uint8)
    sw = swizzle_grouped_scales(lin, offs)
    starts = scale_starts(offs).tolist()
    assert starts == [0, 0, 128, 128, 384, 512, 640] and sw.shape == (grouped_scale_rows(329, 6), 8)
    row = 0
    for e, c in enumerate(counts):
        blk = sw[starts[e]:starts[e + 1]]
        assert torch.equal(blk, swizzle_scales(lin[row:row + c])[:blk.shape[0]]) if c else blk.numel() == 0
        row += c
    assert torch.equal(unswizzle_grouped_scales(sw, offs, 329, 5), lin)
    w = torch.randint(0, 127, (3, 130, 5), dtype=torch.uint8)
    ws = swizzle_expert_scales(w)
    assert ws.shape == (3, 256, 8) and torch.equal(ws[1], swizzle_scales(w[1]))
    assert torch.equal(unswizzle_expert_scales(ws, 130, 5), w)


def test_grouped_scale_rows_hold_every_routing():
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        e = int(torch.randint(1, 40, (1,), generator=g))
        counts = torch.randint(0, 300, (e,), generator=g) * (torch.rand(e, generator=g) < 0.5)
        offs = offs_from_counts(counts)
        assert int(scale_starts(offs)[-1]) <= grouped_scale_rows(int(counts.sum()), e)
    assert grouped_scale_rows(1, 256) == 128 and grouped_scale_rows(8, 256) == 8 * 128


def test_check_routings_sum_to_t_leave_an_expert_empty_or_put_every_row_on_one():
    for seed in range(12):
        for t, e in ((1, 4), (3, 4), (300, 4), (77, 256), (5, 1)):
            offs = check_routing(t, e, seed, CPU)
            counts = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long))
            assert offs.dtype == torch.int32 and int(offs[-1]) == t and bool((counts >= 0).all())
            if seed % 4 == 3 or e == 1:
                assert int(counts[-1]) == t
            else:
                assert int(counts[0]) == 0
    counts = topk_counts(64, 256, 8, seed=1)
    assert int(counts.sum()) == 512 and int((counts == 0).sum()) > 0
    # the per-expert bias sets how uneven the load is: the busiest expert's rows grow with it, the total does not
    busiest = [int(topk_counts(512, 256, 8, seed=1, bias=s).max()) for s in (0, 1, 3)]
    assert busiest[0] < busiest[1] < busiest[2] and int(topk_counts(512, 256, 8, seed=1, bias=3).sum()) == 4096
    assert torch.equal(topk_counts(64, 256, 8, seed=1, bias=1.0), counts)  # the default is bias 1
    with pytest.raises(ValueError, match=r"topk_counts: bias must be a finite number >= 0; got -1\. Pass 0 for "
                                         r"uniform routing, 1 for a trained router's spread, larger for a few hot"):
        topk_counts(8, 16, 2, bias=-1)
    for args, shown in (((-1, 16, 2), "tokens must be an int >= 0; got -1"),
                        ((4.5, 16, 2), "tokens must be an int >= 0; got 4.5"),
                        ((8, 16, -2), "top_k must be an int >= 0; got -2")):  # were torch's raw errors, or zeros
        with pytest.raises(InvalidInputError, match=rf"^topk_counts: {shown}\. Pass e\.g\. topk_counts\(64, 256, 8\)"):
            topk_counts(*args)


# -- exactness ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [[0, 5, 0, 2], [7], [0, 0, 130, 1, 0], [1, 1, 1, 1, 1, 1]])
def test_fp32_out_equals_float64_per_expert_where_every_sum_is_exact(tmp_path, counts):
    ops = _inputs(counts, exact=True)
    out = _disp([ReferenceBackend()], tmp_path).fp4_grouped_mm(*ops, out_dtype=torch.float32)
    assert torch.equal(out.double(), _f64(*ops))


def test_one_expert_equals_fp4_mm_and_linear_scales_equal_swizzled_ones(tmp_path):
    d = _disp([ReferenceBackend()], tmp_path)
    a, b, sa, sb, alpha, offs = _inputs([37], exact=False)
    dense = d.fp4_mm(a, b[0], sa[:128], sb[0], alpha, out_dtype=torch.float32)
    assert torch.equal(d.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out_dtype=torch.float32), dense)
    a, b, sa, sb, alpha, offs = _inputs([0, 9, 0, 300], seed=3)
    lin_a = unswizzle_grouped_scales(sa, offs, 309, 8)
    lin_b = unswizzle_expert_scales(sb, 64, 8)
    ref = d.fp4_grouped_mm(a, b, sa, sb, alpha, offs)
    assert torch.equal(d.fp4_grouped_mm(a, b, lin_a, lin_b, alpha, offs, scale_layout="linear"), ref)
    # torch scaled_grouped_mm's flattened [E, round_up(N,128) * round_up(K/16,4)] weight scales are accepted too
    assert torch.equal(d.fp4_grouped_mm(a, b, sa, sb.reshape(4, -1), alpha, offs), ref)
    assert d.fp4_grouped_mm(a[:0], b, sa, sb, alpha, torch.zeros(4, dtype=torch.int32)).shape == (0, 64)


def test_quantized_tokens_through_the_grouped_call_match_the_dense_product(tmp_path):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 256, generator=g), torch.randn(3, 48, 256, generator=g)
    offs = _offs([6, 0, 14])
    xq, xs, xg = quantize_nvfp4(x, scale_layout="linear")
    qs = [quantize_nvfp4(w[e], scale_layout="linear") for e in range(3)]
    alpha = torch.stack([1 / (xg * q[2]) for q in qs]).reshape(3).float()
    out = _disp([ReferenceBackend()], tmp_path).fp4_grouped_mm(
        xq, torch.stack([q[0] for q in qs]), swizzle_grouped_scales(xs, offs),
        swizzle_expert_scales(torch.stack([q[1] for q in qs])), alpha, offs, out_dtype=torch.float32)
    ref = torch.cat([x[:6] @ w[0].T, x[6:] @ w[2].T])
    assert float((out - ref).norm() / ref.norm()) < 0.2  # NVFP4's own rounding of both operands


# -- the dispatcher's machinery -------------------------------------------------------------------------------------
GROUPED_FAILURES = [dict(result="zeros"), dict(result="nan"), dict(result="scaled"), dict(result="abs_alpha"),
                    dict(result="nan_scale_as_zero"), dict(result="one_expert"), dict(mutates="offs"),
                    dict(mutates="a"), dict(out_fault="past_end"), dict(raises=RuntimeError("launch failed"))]


@pytest.mark.parametrize("kw", GROUPED_FAILURES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_failure_mode_of_a_grouped_backend_is_caught_per_key(tmp_path, kw):
    bad = FakeBackend("bad", cost=1e-6, ops=("grouped",), **kw)  # the fastest: only the checks keep it out
    good = FakeBackend("good", cost=1e-3, ops=("grouped",))
    d = _disp([bad, good], tmp_path)
    for counts in ([0, 1, 0, 0], [2, 0, 3, 0], [0, 100, 150, 50]):
        ops = _inputs(counts, seed=len(counts))
        out = d.fp4_grouped_mm(*ops, out_dtype=torch.float32)
        ref = _f64(*ops)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
        p = Problem(sum(counts), 64, 128, torch.float32, CPU, torch.uint8, 4)
        assert d.choose(p).backend is good


def test_a_grouped_key_holds_e_and_only_grouped_backends_compete(tmp_path):
    dense = FakeBackend("dense", cost=1e-9)
    grouped = FakeBackend("grouped", cost=1e-3, ops=("grouped",))
    slow = FakeBackend("slow", cost=1e-2, ops=("grouped",))
    d = _disp([dense, slow, grouped], tmp_path)
    d.fp4_grouped_mm(*_inputs([0, 9, 7, 0]))
    p = Problem(16, 64, 128, torch.bfloat16, CPU, torch.uint8, 4)
    c = d.choose(p)
    assert c.backend is grouped and [b.name for b, _ in c.fallbacks] == ["slow"]  # dense never ran on it
    ks = key_str(p.key)
    assert ks == "grouped-e4-m16-n64-k128-bfloat16" and key_str(p._replace(experts=8).key) != ks
    check_key(ks)
    assert ks in d.cache_for(CPU).decisions and d.choose(p._replace(experts=0)).backend is dense
    with pytest.raises(InvalidInputError, match=r"^fp4_grouped_mm: backend 'dense' computes fp4_mm only; pass one "
                                                r"of \['grouped', 'slow'\] or none"):
        d.choose(p, backend="dense")


def test_a_probe_of_a_grouped_only_backend_uses_grouped_problems(tmp_path):
    seen = []

    class Recording(FakeBackend):
        def run(self, problem, ops, config):
            seen.append((problem.op, problem.experts, tuple(ops.offs.shape)))
            super().run(problem, ops, config)

    d = _disp([Recording("g", ops=("grouped",))], tmp_path)
    assert d.report("cpu")[0].status == "ok"
    assert seen and set(seen) == {("grouped", PROBE_E, (PROBE_E,))}


def test_the_expert_loop_computes_each_expert_with_a_dense_dispatcher(tmp_path):
    loop = ExpertLoopBackend(_disp([ReferenceBackend()], tmp_path))
    for seed in (0, 3):  # a routing with an empty expert, and one with every row on the last expert
        case = make_case(Problem(40, 64, 128, torch.float32, CPU, torch.uint8, 5), 4 + seed, reference_mm)
        assert check_run(loop, case, {}) is None
    decided = set(loop.dense().cache_for(CPU).decisions)
    assert decided and all(ks.startswith("m") and ks.endswith("-n64-k128-float32") for ks in decided)  # dense keys


def test_the_expert_loop_clamps_an_unchecked_offs_as_the_kernels_do_and_is_not_charged_for_it(tmp_path):
    a, b, sa, sb, alpha, _ = _inputs([3, 5, 2])
    sa = torch.cat((sa, sa.new_zeros(grouped_scale_rows(10, 3) - sa.shape[0], sa.shape[1])))
    bad, clamped = (torch.tensor(v, dtype=torch.int32) for v in ([-5, 3, 8], [0, 3, 8]))
    d = Dispatcher([ExpertLoopBackend(_disp([ReferenceBackend()], tmp_path / "inner")), ReferenceBackend()],
                   cache_dir=tmp_path / "c")  # no timer on the CPU: priority order, the loop first
    want = d.fp4_grouped_mm(a, b, sa, sb, alpha, clamped, check_offs=False, backend="reference")
    for _ in range(4):  # the loop sliced a[-5:3] and its fp4_mm raised: a fault per call, a ban after three
        got = d.fp4_grouped_mm(a, b, sa, sb, alpha, bad, check_offs=False)
        assert d.choose(Problem(10, 64, 128, torch.bfloat16, CPU, torch.uint8, 3)).backend.name == "loop:fp4_mm"
        assert torch.equal(got[:8], want[:8])  # rows 8 and 9 belong to no expert: undefined
    got = d.fp4_grouped_mm(a, b, sa, sb, alpha, bad, check_offs=False, backend="loop:fp4_mm")
    assert torch.equal(got[:8], want[:8])
    assert d.cache_for(CPU).faults == {} and d.cache_for(CPU).shape_blacklist == {}


def test_the_expert_loop_keeps_its_cache_under_its_dispatchers_directory(tmp_path, monkeypatch):
    """It took FP4DISPATCH_CACHE_DIR (or the default directory) whatever the dispatcher's cache_dir or tune's
    --cache-dir, so that clear --all there left it, and --self-test's throw-away cache wrote into the real one."""
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "env"))
    d = Dispatcher([ExpertLoopBackend()], cache_dir=tmp_path / "mine", do_bench=fake_do_bench)
    a, b, sa, sb, alpha, offs = _inputs([3, 0, 5])
    d.fp4_grouped_mm(a, b, sa, sb, alpha, offs)
    assert list((tmp_path / "mine" / "expert-loop").glob("decisions-*.json")) and not (tmp_path / "env").exists()


def test_the_expert_loops_own_dispatcher_leaves_out_libraries_that_compile_on_their_first_run(tmp_path, monkeypatch):
    """Its keys are verified in priority order, every candidate of each new expert M bucket: Humming there would
    compile that bucket's kernels (and its probe spawn a worker) only to stand behind fp4dispatch's own kernels."""
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path))
    names = [b.name for b in ExpertLoopBackend().dense().backends]
    assert "triton:fused" in names and "reference" in names
    assert not any(n.startswith("humming:") for n in names) and "loop:fp4_mm" not in names
    # FP4DISPATCH_BACKEND naming one of them keeps it and forces it there; another op's is not forced there (each
    # expert's fp4_mm would refuse it)
    for forced, kept in (("humming:w4a16", "humming:w4a16"), ("triton:grouped", None)):
        monkeypatch.setenv("FP4DISPATCH_BACKEND", forced)
        inner = ExpertLoopBackend().dense()
        assert inner.settings.forced_backend == kept
        assert (kept in [b.name for b in inner.backends]) if kept else forced not in [b.name for b in inner.backends]


def test_the_default_dispatcher_probes_the_expert_loop_without_calling_back_into_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    d = Dispatcher([ReferenceBackend(), ExpertLoopBackend()], cache_dir=tmp_path / "c")
    fp4dispatch.set_dispatcher(d)
    try:
        assert {r.name: r.status for r in d.report("cpu")} == {"reference": "ok", "loop:fp4_mm": "ok"}
    finally:
        fp4dispatch.set_dispatcher(None)


# -- the contract ---------------------------------------------------------------------------------------------------
def _bad(**change):
    a, b, sa, sb, alpha, offs = _inputs([0, 3, 2, 0])
    args = dict(a=a, b=b, a_scale=sa, b_scale=sb, alpha=alpha, offs=offs)
    return {**args, **change}


ERRORS = [
    (dict(offs=torch.tensor([0, 3, 2, 5], dtype=torch.int32)),
     r"^fp4_grouped_mm: offs must be non-decreasing cumulative end rows starting at >= 0; got offs\[2\]=2 < "
     r"offs\[1\]=3\. Build it as torch.cumsum\(rows_per_expert, 0\).to\(torch.int32\)$"),
    (dict(offs=torch.tensor([0, 3, 4, 4], dtype=torch.int32)),
     r"^fp4_grouped_mm: offs\[-1\] must equal T = a.shape\[0\] = 5 \(every row belongs to an expert\); got "
     r"offs\[-1\]=4\."),
    (dict(offs=torch.tensor([0, 3, 5], dtype=torch.int32)),
     r"^fp4_grouped_mm: offs must be 1-D \[E\] with E = b.shape\[0\] = 4 .*; got offs.shape=\(3,\)"),
    (dict(offs=torch.tensor([0, 0, 3, 5, 5])),
     r"^fp4_grouped_mm: offs must be int32; got dtype=torch.int64\. Convert it with offs.to\(torch.int32\)$"),
    (dict(offs=torch.tensor([0, 0, 3, 5, 5], dtype=torch.int32)),
     r"offs.shape=\(5,\)\. If it has E\+1 entries starting with 0 \(a start-offset table\), pass offs\[1:\]$"),
    (dict(alpha=torch.ones(3)),
     r"^fp4_grouped_mm: alpha must have E=4 elements \(one 1/\(gs_a\*gs_b\[e\]\) per expert\) or one; got "
     r"alpha.shape=\(3,\)$"),
    # a list of per-expert values: the dense call's message offered one value, which would serve every expert
    (dict(alpha=[0.5, 1.0, 1.0, 2.0]),
     r"^fp4_grouped_mm: alpha must be a float32 tensor \[E\]=\[4\] \(one 1/\(gs_a\*gs_b\[e\]\) per expert\) or one "
     r"value \(a 1-element tensor, a Python or NumPy float, or None\); got list\. Build it with torch.tensor\(values, "
     r"dtype=torch.float32, device=a.device\)$"),
    (dict(alpha=torch.ones(4, dtype=torch.float64)),
     r"^fp4_grouped_mm: alpha must be float32; got dtype=torch.float64\. Compute each expert's 1/\(gs_a\*gs_b\[e\]\) "
     r"in float32; fp4_grouped_mm never converts it for you$"),
    (dict(b=torch.zeros(64, 64, dtype=torch.uint8)),
     r"^fp4_grouped_mm: b must be 3-D \[E, N, K/2\] .*; got b.shape=\(64, 64\)\. A 2-D weight is one expert: fp4_mm "
     r"takes it, or pass b.unsqueeze\(0\) for E=1$"),
    (dict(a=torch.zeros(5, 32, dtype=torch.uint8)),
     r"^fp4_grouped_mm: b.shape\[2\] \(K/2\) must equal a.shape\[1\]=32; got a.shape=\(5, 32\), "
     r"b.shape=\(4, 64, 64\)$"),
    # torch's scaled_grouped_mm takes b.transpose(-2, -1): "Call b.contiguous()" made the transposed weight, which
    # N == K/2 (here) multiplied silently
    (dict(b=torch.zeros(4, 64, 64, dtype=torch.uint8).transpose(1, 2)),
     r"^fp4_grouped_mm: b must be contiguous \[E, N, K/2\] \(each expert's weight in the nn.Linear layout\); got "
     r"strides \(4096, 1, 64\) for shape \(4, 64, 64\)\. It is a transposed view: pass the contiguous \[E, N, K/2\] "
     r"weight itself, not b.contiguous\(\) \(that is the transposed weight\)$"),
    (dict(b=torch.zeros(4, 64, 128, dtype=torch.uint8)[:, :, ::2]),
     r"^fp4_grouped_mm: b must be contiguous \[E, N, K/2\] .*; got strides \(8192, 128, 2\) for shape "
     r"\(4, 64, 64\)\. Call b.contiguous\(\)$"),
    (dict(a=torch.zeros(5, 32, dtype=torch.uint8), b=torch.zeros(4, 32, 64, dtype=torch.uint8)),
     r"^fp4_grouped_mm: b.shape\[2\] \(K/2\) must equal a.shape\[1\]=32; got a.shape=\(5, 32\), "
     r"b.shape=\(4, 32, 64\) \(if b holds each expert's weight transposed, \[E, K/2, N\], pass the \[E, N, K/2\] "
     r"one\)$"),
    (dict(a_scale=torch.zeros(5, 8, dtype=torch.float8_e4m3fn)),
     r"^fp4_grouped_mm: a_scale with scale_layout='swizzled' must be \[S, round_up\(K/16,4\)=8\] with S a multiple of "
     r"128 .*grouped_scale_rows\(T, E\) = 512 hold any routing.*; got a_scale.shape=\(5, 8\)\. It has the linear "
     r"layout's shape: pass scale_layout='linear'\.$"),
    (dict(b_scale=torch.zeros(4, 64, 8, dtype=torch.float8_e4m3fn)),
     r"^fp4_grouped_mm: b_scale with scale_layout='swizzled' must have shape \(4, 128, 8\) = \(E, round_up\(N=64,"
     r"128\), round_up\(K/16=8,4\)\), each expert 128x4-swizzled .*It has the linear layout's shape: pass "
     r"scale_layout='linear'\.$"),
    (dict(out=torch.empty(5, 64)),
     r"^fp4_grouped_mm: out must be a contiguous \[T, N\]=\(5, 64\) tensor of dtype torch.bfloat16 on cpu that does "
     r"not require grad; got shape=\(5, 64\), dtype=torch.float32.* or pass out_dtype$"),
]


@pytest.mark.parametrize("change, message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_every_contract_error_names_argument_expected_got_and_fix(tmp_path, change, message):
    d = _disp([ReferenceBackend()], tmp_path)
    args = _bad(**change)
    out = args.pop("out", None)
    with pytest.raises(InvalidInputError, match=message):
        d.fp4_grouped_mm(*args.values(), out=out)


@pytest.mark.parametrize("offs, message", [
    ([-5, 0], r"offs must be non-decreasing cumulative end rows starting at >= 0; got offs\[0\]=-5 < 0\. Build it"),
    ([3, 0], r"offs must be non-decreasing cumulative end rows starting at >= 0; got offs\[1\]=0 < offs\[0\]=3\."),
    ([0, 2], r"offs\[-1\] must equal T = a.shape\[0\] = 0 \(every row belongs to an expert\); got offs\[-1\]=2\."),
])
def test_the_offs_of_a_call_without_rows_is_checked_too(tmp_path, offs, message):
    d = _disp([ReferenceBackend()], tmp_path)
    a, b, sb = torch.zeros(0, 32, dtype=torch.uint8), torch.zeros(2, 64, 32, dtype=torch.uint8), torch.zeros(
        2, 128, 4, dtype=torch.float8_e4m3fn)
    sa, x, bad = torch.zeros(0, 4, dtype=torch.float8_e4m3fn), torch.zeros(0, 64), torch.tensor(offs, dtype=torch.int32)
    for call, run in (("fp4_grouped_mm", lambda o, **kw: d.fp4_grouped_mm(a, b, sa, sb, None, o, **kw)),
                      ("w4a16_grouped_mm", lambda o, **kw: d.w4a16_grouped_mm(x.bfloat16(), b, sb, None, o, **kw))):
        assert run(torch.zeros(2, dtype=torch.int32)).shape == (0, 64)
        with pytest.raises(InvalidInputError, match=f"^{call}: {message}"):  # was accepted at T = 0
            run(bad)
        assert run(bad, check_offs=False).shape == (0, 64)  # unchecked: nothing to compute


def test_a_swizzled_a_scale_must_fit_the_routing_and_any_routing_when_offs_is_not_read(tmp_path):
    d = _disp([ReferenceBackend()], tmp_path)
    a, b, sa, sb, alpha, offs = _inputs([0, 3, 2, 0])  # needs 256 rows; grouped_scale_rows(5, 4) = 512
    assert d.fp4_grouped_mm(a, b, sa[:256], sb, alpha, offs).shape == (5, 64)
    with pytest.raises(InvalidInputError, match=r"^fp4_grouped_mm: a_scale \(swizzled\) has 128 rows; this routing "
                                                r"needs 256 .*Allocate grouped_scale_rows\(T, E\) = 512 rows"):
        d.fp4_grouped_mm(a, b, sa[:128], sb, alpha, offs)
    with pytest.raises(InvalidInputError, match=r"^fp4_grouped_mm: a_scale \(swizzled\) must have "
                                                r"grouped_scale_rows\(T, E\) = 512 rows when offs is not read on the "
                                                r"host \(CUDA graph capture or check_offs=False\).*; got 256$"):
        d.fp4_grouped_mm(a, b, sa[:256], sb, alpha, offs, check_offs=False)


TRACED_ERRORS = [
    ("out-vs-out_dtype", {"out_dtype": torch.float16, "out": "f32"},
     r"fp4_grouped_mm: out must be a contiguous \[T, N\]=\(5, 64\) tensor of dtype torch.float16 on cpu that does not "
     r"require grad; got shape=\(5, 64\), dtype=torch.float32"),
    ("alpha-1e39", {"alpha": 1e39}, r"fp4_grouped_mm: alpha=1e\+39 does not fit in float32 \(largest 3.403e\+38\)"),
    ("alpha-bool", {"alpha": True},
     r"fp4_grouped_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got bool"),
    ("alpha-str", {"alpha": "0.5"},
     r"fp4_grouped_mm: alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got str"),
]


@pytest.mark.parametrize("kw, message", [c[1:] for c in TRACED_ERRORS], ids=[c[0] for c in TRACED_ERRORS])
def test_a_compiled_call_fails_at_trace_time_with_the_eager_message(kw, message):
    a, b, sa, sb, alpha, offs = _inputs([0, 3, 2, 0])
    kw = {"alpha": alpha, **kw}
    if kw.get("out") == "f32":
        kw["out"] = torch.empty(5, 64, dtype=torch.float32)
    with pytest.raises(InvalidInputError, match=message):
        fp4dispatch.fp4_grouped_mm(a, b, sa, sb, offs=offs, check_offs=False, **kw)
    # dynamic=False: alpha is traced as the constant it is (a float Dynamo makes symbolic has no repr to print)
    fn = torch.compile(lambda x: fp4dispatch.fp4_grouped_mm(x, b, sa, sb, offs=offs, **kw), fullgraph=True,
                       backend="aot_eager", dynamic=False)
    with pytest.raises(Exception, match=message):  # Dynamo's error, which carries the eager one
        fn(a)


def test_the_public_call_the_custom_ops_and_torch_compile_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    fp4dispatch.set_dispatcher(_disp([ReferenceBackend()], tmp_path))
    try:
        a, b, sa, sb, alpha, offs = _inputs([0, 3, 2, 0])
        out = fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs)
        assert torch.equal(out, torch.ops.fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs, torch.bfloat16,
                                                                     "swizzled", None))
        buf = torch.empty_like(out)
        torch.ops.fp4dispatch.fp4_grouped_mm_out(a, b, sa, sb, alpha, offs, buf, "swizzled", None)
        assert torch.equal(out, buf)
        fn = torch.compile(lambda x, o: fp4dispatch.fp4_grouped_mm(x, b, sa, sb, alpha, o), fullgraph=True,
                           backend="eager")
        assert torch.equal(fn(a, offs), out)
    finally:
        fp4dispatch.set_dispatcher(None)


@pytest.mark.parametrize("call, message", [
    (lambda sa, offs: swizzle_grouped_scales(sa, offs.tolist()),
     r"^swizzle_grouped_scales: offs must be an integer tensor \[E\] of cumulative end rows; got list\. Build it as "
     r"torch.cumsum\(rows_per_expert, 0\).to\(torch.int32\)$"),
    (lambda sa, offs: swizzle_grouped_scales(sa.tolist(), offs),
     r"^swizzle_grouped_scales: linear must be a float8_e4m3fn \(or uint8 bytes\) tensor of block scales \[T, "
     r"K/16\]; got list\. Pass the scales as quantize_nvfp4\(\.\.\., scale_layout='linear'\) returns them$"),
    (lambda sa, offs: swizzle_grouped_scales(sa.float(), offs),
     r"^swizzle_grouped_scales: linear must be .*; got dtype=torch.float32\."),
    (lambda sa, offs: swizzle_expert_scales(sa.float()[None]),
     r"^swizzle_expert_scales: linear must be a float8_e4m3fn \(or uint8 bytes\) tensor of block scales \[E, N, "
     r"K/16\]; got dtype=torch.float32\."),
])
def test_the_grouped_scale_helpers_refuse_what_is_not_scales(call, message):
    """A list raised AttributeError, float32 scales a RuntimeError of index_copy_."""
    offs = _offs([2, 0, 3])
    sa = torch.ones(5, 4).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match=message):
        call(sa, offs)


def test_a_compiled_call_reads_and_checks_offs_as_the_eager_one_does(tmp_path, monkeypatch):
    """The grouped custom ops take the caller's check_offs. They had always passed False: a compiled call took a
    wrong routing table without a word, and refused an a_scale of the routing's own rows that the eager call takes."""
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(tmp_path / "c"))
    fp4dispatch.set_dispatcher(_disp([ReferenceBackend()], tmp_path))
    try:
        a, b, sa, sb, alpha, offs = _inputs([3, 0, 5])
        sa = sa[:int(scale_starts(offs)[-1])]  # the routing's own rows: enough where offs is read
        assert sa.shape[0] < grouped_scale_rows(8, 3)

        def checked(x, o):
            return fp4dispatch.fp4_grouped_mm(x, b, sa, sb, alpha, o)

        def unchecked(x, o):
            return fp4dispatch.fp4_grouped_mm(x, b, sa, sb, alpha, o, check_offs=False)

        fn = torch.compile(checked, fullgraph=True, backend="aot_eager")
        assert torch.equal(fn(a, offs), checked(a, offs))
        bad = torch.tensor([5, 3, 8], dtype=torch.int32)
        msg = (r"^fp4_grouped_mm: offs must be non-decreasing cumulative end rows starting at >= 0; got offs\[1\]=3 < "
               r"offs\[0\]=5")
        for f in (checked, fn):
            with pytest.raises(InvalidInputError, match=msg):
                f(a, bad)
        with pytest.raises(Exception, match=r"a_scale \(swizzled\) must have grouped_scale_rows\(T, E\) = 384 rows "
                                            r"when offs is not read on the host"):
            torch.compile(unchecked, fullgraph=True, backend="aot_eager")(a, offs)
    finally:
        fp4dispatch.set_dispatcher(None)


@pytest.mark.parametrize("flag", [None, "no", 1])
def test_check_offs_must_be_a_bool_eager_and_compiled(tmp_path, flag):
    """None turned the check off and "no" on; a compiled call stopped at the op's schema."""
    a, b, sa, sb, alpha, offs = _inputs([3, 0, 5])
    msg = re.escape(f"fp4_grouped_mm: check_offs must be True (offs read on the host and checked: one sync) or False "
                    f"(not read: no sync; a swizzled a_scale then needs grouped_scale_rows(T, E) rows); got {flag!r}")
    with pytest.raises(InvalidInputError, match=msg):
        _disp([ReferenceBackend()], tmp_path).fp4_grouped_mm(a, b, sa, sb, alpha, offs, check_offs=flag)
    fn = torch.compile(lambda x: fp4dispatch.fp4_grouped_mm(x, b, sa, sb, alpha, offs, check_offs=flag),
                       fullgraph=True, backend="aot_eager", dynamic=False)
    with pytest.raises(Exception, match=msg):
        fn(a)


# -- the Triton kernel, interpreted ---------------------------------------------------------------------------------
_CHILD = r'''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_grouped import _inputs, _f64
from fp4dispatch.backends.triton_grouped import TritonGroupedBackend
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.dispatch.verify import SENTINEL, check_run, make_case
from fp4dispatch.kernels.config_grouped import GemvGroupedConfig, MmaGroupedConfig, MmaW4A16GroupedConfig
from fp4dispatch.kernels.grouped_mm import grouped_mm
from fp4dispatch.problem import Problem

res = {"exact": [], "hostile": [], "bad_offs": [], "decode": [], "table": [], "w4a16": [], "k_order": []}
# the last three: the tokens decoded first, then w4a16's register-operand tile (16 blocks per K step: more than K has)
cfgs = [MmaGroupedConfig(16, 32, 4, 4, 1), MmaGroupedConfig(32, 16, 8, 4, 1),
        GemvGroupedConfig(2, 16, 8, 4, prefetch=True), GemvGroupedConfig(1, 32, 8, 4),
        MmaW4A16GroupedConfig(16, 32, 4, 4, 1, register_a=True),
        MmaW4A16GroupedConfig(32, 16, 8, 4, 1, register_a=True),
        MmaW4A16GroupedConfig(16, 32, 16, 4, 1, register_a=True)]
for counts in ([0, 5, 0, 2], [0, 0, 20, 1, 0], [1, 1, 1, 1, 1, 1], [17]):
    a, b, sa, sb, alpha, offs = _inputs(counts, exact=True)
    ref = _f64(a, b, sa, sb, alpha, offs)
    for cfg in cfgs:
        out = torch.full((a.shape[0], 64), float("nan"))
        grouped_mm(a, b, sa, sb, alpha, out, offs, cfg)
        res["exact"].append([counts, torch.equal(out.double(), ref)])
backend = TritonGroupedBackend()
for t, e, seed in ((3, 4, 3), (21, 6, 1)):
    p = Problem(t, 64, 128, torch.bfloat16, torch.device("cpu"), torch.uint8, e)
    case = make_case(p, seed, reference_mm)
    res["hostile"].append([t, e, seed, [check_run(backend, case, c) for c in cfgs]])
a, b, sa, sb, alpha, offs = _inputs([0, 5, 0, 2], exact=True)
for bad in ([0, 9, 3, 7], [-4, 5, 0, 100], [7, 7, 7, 7]):
    frame = torch.full((9, 64), SENTINEL)
    for cfg in (cfgs[0], cfgs[2]):
        grouped_mm(a, b, sa, sb, alpha, frame[1:8], torch.tensor(bad, dtype=torch.int32), cfg)
        res["bad_offs"].append([bad, bool((frame[[0, 8]] == SENTINEL).all())])
from fp4dispatch.format_grouped import dequantize_grouped
from fp4dispatch.kernels.dequant import dequantize_grouped_rows
for counts, bad in (([0, 5, 0, 2], None), ([130, 0, 3], None), ([4], None), ([0, 5, 0, 2], [6, 2, 2, 3])):
    a, b, sa, sb, alpha, offs = _inputs(counts)
    use = offs if bad is None else torch.tensor(bad, dtype=torch.int32)
    for dt in (torch.bfloat16, torch.float16):
        x = torch.full((a.shape[0], a.shape[1] * 2), float("nan"), dtype=dt)
        layout = torch.full((offs.numel() + 1,), -9, dtype=torch.int32)
        dequantize_grouped_rows(a, sa, use, x, layout)
        want = dequantize_grouped(a, sa, layout[1:], dt)  # each row in its expert of the table as clamped
        owned = int(layout[-1])  # rows past the (clamped) table's end belong to no expert: zero
        same = torch.equal(x[:owned].view(torch.int16), want[:owned].view(torch.int16))
        res["decode"].append([counts, bad, layout.tolist(), same and bool((x[owned:] == 0).all())])
from fp4dispatch.kernels.gemm.wgmma_register_a_w4a16 import permute_a
for counts, k in (([0, 5, 0, 2], 128), ([3, 17], 80), ([20], 272)):  # K/16 = 8, 5 and 17: partial scale groups
    a, b, sa, sb, alpha, offs = _inputs(counts, k=k)
    for dt in (torch.bfloat16, torch.float16):
        plain = torch.full((a.shape[0], k), float("nan"), dtype=dt)
        dequantize_grouped_rows(a, sa, offs, plain, torch.empty(len(counts) + 1, dtype=torch.int32))
        want, kp = permute_a(plain, {})
        got = torch.full((a.shape[0], kp), float("nan"), dtype=dt)
        dequantize_grouped_rows(a, sa, offs, got, torch.empty(len(counts) + 1, dtype=torch.int32), k_order=True)
        res["k_order"].append([counts, k, kp, torch.equal(got.view(torch.int16), want.view(torch.int16))])
from fp4dispatch.kernels.routing_table import routing_table
for bad in ([0, 5, 5, 7], [0, 9, 3, 7], [-4, 5, 0, 100]):
    table = torch.full((5,), -9, dtype=torch.int32)
    res["table"].append(routing_table(torch.tensor(bad, dtype=torch.int32), 7, table).tolist())
for t, e, seed, adt in ((3, 4, 3, torch.bfloat16), (21, 6, 1, torch.float16), (150, 3, 0, torch.bfloat16)):
    for odt in (adt, torch.float32):
        p = Problem(t, 64, 128, odt, torch.device("cpu"), adt, e)
        case = make_case(p, seed, reference_mm)
        res["w4a16"].append([t, e, str(adt), [check_run(backend, case, c) for c in backend.configs(p)]])
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton is not installed: the grouped kernel is a Triton kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "tests")], env=env, capture_output=True, text=True,
                       timeout=900)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise AssertionError(f"interpreter child failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def test_the_grouped_kernel_is_bit_exact_where_every_sum_is_exact(interpreted):
    assert interpreted["exact"] and all(ok for _, ok in interpreted["exact"]), interpreted["exact"]


def test_the_grouped_kernel_passes_the_hostile_check_with_every_config(interpreted):
    for t, e, seed, outcomes in interpreted["hostile"]:
        assert outcomes == [None] * len(outcomes), (t, e, seed, outcomes)


def test_a_wrong_routing_table_cannot_make_the_kernel_write_outside_out(interpreted):
    assert [ok for _, ok in interpreted["bad_offs"]] == [True] * 6


def test_the_tuner_times_a_grouped_key_on_a_top_k_routing_not_on_the_checks_one_expert_case(tmp_path):
    """The check case may hold every row on one expert (one dense GEMM on one small weight); timing there would pick
    what is fast for that, not for a MoE layer's routing."""
    from fp4dispatch.routing import timing_routing

    timed: list[list[int]] = []

    class Recording(FakeBackend):
        def run(self, problem, ops, config):
            timed.append(torch.diff(ops.offs.long(), prepend=ops.offs.new_zeros(1)).tolist())
            super().run(problem, ops, config)

    d = Dispatcher([Recording("rec", cost=1e-3, ops=("grouped",))], cache_dir=tmp_path / "c",
                   do_bench=lambda fn: fn() or 1.0)
    a, b, sa, sb, alpha, offs = _inputs([40, 0, 30, 30, 0, 0, 28, 0])
    d.fp4_grouped_mm(a, b, sa, sb, alpha, offs)
    want = torch.diff(timing_routing(128, 8, 7, "cpu").long(), prepend=torch.zeros(1, dtype=torch.long)).tolist()
    assert want in timed and max(want) < 128  # timed on the top-k routing (every expert gets rows here)
    assert [0] * 7 + [128] in timed  # and still checked on the one-expert case
    assert timing_routing(128, 8, 7, "cpu")[-1] == 128
    assert (torch.diff(timing_routing(1000, 64, 1, "cpu")) > 0).sum() > 32


def test_the_routing_table_is_offs_clamped_and_non_decreasing_after_a_zero(interpreted):
    assert interpreted["table"] == [[0, 0, 5, 5, 7], [0, 0, 7, 7, 7], [0, 0, 5, 5, 7]]


def test_the_w4a16_grouped_kernel_passes_the_hostile_check_with_every_config(interpreted):
    assert interpreted["w4a16"] and all(o == [None] * len(o) for *_, o in interpreted["w4a16"]), interpreted["w4a16"]


def test_the_grouped_decode_reads_each_experts_scale_block_and_writes_the_clamped_table(interpreted):
    """humming:grouped's activation decode (kernels/dequant.dequantize_grouped_rows): the exact bf16/fp16 values of
    format_grouped's decode, and Humming's routing table [0, offs...] clamped to [0, T], non-decreasing."""
    assert [(c, b, lay) for c, b, lay, _ in interpreted["decode"][::2]] == [
        ([0, 5, 0, 2], None, [0, 0, 5, 5, 7]), ([130, 0, 3], None, [0, 130, 130, 133]), ([4], None, [0, 4]),
        ([0, 5, 0, 2], [6, 2, 2, 3], [0, 6, 6, 6, 6])]
    assert all(ok for *_, ok in interpreted["decode"]), interpreted["decode"]


def test_the_grouped_decode_in_k_order_writes_what_permute_a_makes_of_the_plain_decode(interpreted):
    """fp4_grouped_mm's register-operand path decodes the tokens straight into the tile's K order (one launch less):
    bit for bit what ``permute_a`` writes from the plain decode, K padded to whole scale groups with zeros."""
    assert [(c, k, kp) for c, k, kp, _ in interpreted["k_order"][::2]] == [([0, 5, 0, 2], 128, 128), ([3, 17], 80, 128),
                                                                         ([20], 272, 320)]
    assert all(ok for *_, ok in interpreted["k_order"]), interpreted["k_order"]


def test_a_config_of_another_op_is_refused_by_the_grouped_launcher():
    from fp4dispatch.kernels.config import MmaBf16Config, TmaGemvConfig
    from fp4dispatch.kernels.config_grouped import TmaGemvGroupedConfig
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.grouped_mm import grouped_mm

    a, b, sa, sb, alpha, offs = _inputs([0, 3, 2, 0])
    for cfg in (MmaBf16Config(16, 64, 8, 1, 4, 3), TmaGemvConfig(1, 16, 32, 5)):
        with pytest.raises(InvalidInputError, match=r"^grouped_mm: config must be one of GemvGroupedConfig, "
                                                    r"TmaGemvGroupedConfig, MmaGroupedConfig, MmaW4A16GroupedConfig "
                                                    r"\(from heuristics.grouped_configs_for or "
                                                    rf"w4a16_grouped_configs_for\); got {type(cfg).__name__}$"):
            grouped_mm(a, b, sa, sb, alpha, torch.empty(5, 64), offs, cfg)
    # the grouped GEMV's config is a TmaGemvConfig by class, and still not the dense op's
    with pytest.raises(InvalidInputError, match=r"^fp4_mm: config must be one of .*TmaGemvConfig.*; got "
                                                r"TmaGemvGroupedConfig$"):
        fp4_mm(a, b[0], sa, sb, alpha, torch.empty(5, 64), TmaGemvGroupedConfig(1, 16, 32, 5))


def test_warmup_decides_grouped_keys_of_both_ops_before_capture(tmp_path):
    d = _disp([ReferenceBackend()], tmp_path)
    got = fp4dispatch.warmup([(8, 64, 128), (300, 64, 128)], experts=6, dispatcher=d, device="cpu")
    assert got == {(8, 64, 128): "reference", (300, 64, 128): "reference"}
    assert {"grouped-e6-m8-n64-k128-bfloat16", "grouped-e6-m512-n64-k128-bfloat16"} <= set(d.cache_for(CPU).decisions)
    got = fp4dispatch.warmup([(8, 64, 128)], experts=6, activations=torch.bfloat16, dispatcher=d, device="cpu")
    assert got == {(8, 64, 128): "reference"}
    assert "w4a16-bfloat16-grouped-e6-m8-n64-k128-bfloat16" in d.cache_for(CPU).decisions
    with pytest.raises(InvalidInputError, match=r"^warmup: experts must be 0 \(dense calls\) or the E > 0 of "
                                                r"fp4_grouped_mm / w4a16_grouped_mm calls; got experts=-1$"):
        fp4dispatch.warmup([(8, 64, 128)], experts=-1, dispatcher=d, device="cpu")


@pytest.mark.parametrize("value", ["0,-1", "x", "1,inf"])
def test_bench_grouped_refuses_biases_it_cannot_route_with(value):
    """bench_grouped's --biases goes to topk_counts: a bad list is a usage error at once, not a failure mid-run."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grouped.py"
    p = subprocess.run([sys.executable, str(script), "--biases", value], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert (f"error: --biases must be comma-separated finite numbers >= 0 (e.g. 0,1,3); got {value!r}"
            in p.stderr), p.stderr


def test_bench_grouped_plots_a_runs_json(tmp_path):
    """bench_grouped --plot: from a run's JSON (rows as a run writes them), the PNG and the table, without a GPU."""
    import json
    import pathlib
    import subprocess
    import sys

    def row(b, pick):
        us = {"pick": pick, "grouped best": pick * 1.1, "humming": pick * 0.9, "bf16": pick * 3}
        return {"layer": "deepseek-down", "e": 256, "n": 7168, "k": 2048, "top_k": 8, "b": b, "bias": 1.0, "t": 8 * b,
                "touched": 8.0 * b, "us": us, "pct_bw": {c: 2000.0 / v for c, v in us.items()},
                "pick_name": "triton:grouped"}
    src = tmp_path / "bench_grouped-deepseek-down.json"
    src.write_text(json.dumps({"copy_bw": 4.25e12, "rows": [row(1, 31.8), row(8, 112.4)]}))
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grouped.py"
    p = subprocess.run([sys.executable, str(script), "--plot", str(src), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "bench_grouped.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = "| deepseek-down (256, 7168x2048, 8) | 8 | 1 | 64 | 112.4 (18 %) | 123.6 (16 %) | - | 101.2 (20 %)"
    assert row in p.stdout, p.stdout


def test_the_routing_helpers_name_a_bad_argument():
    """check_routing(rows, 0, ...) returned a table covering no rows, or raised a raw IndexError (every fourth seed);
    offs_from_counts of a list raised a raw TypeError."""
    from fp4dispatch import routing

    assert routing.offs_from_counts([2, 0, 3]).tolist() == [2, 2, 5]
    assert routing.offs_from_counts([2, 0, 3]).dtype == torch.int32
    for call, message in [
        (lambda: routing.check_routing(5, 0, 3, "cpu"),
         r"^check_routing: experts must be an int >= 1 \(a table has one end row per expert\); got 0$"),
        (lambda: routing.check_routing(5, 0, 0, "cpu"), r"^check_routing: experts must be an int >= 1"),
        (lambda: routing.timing_routing(-1, 4, 0, "cpu"), r"^timing_routing: rows must be an int >= 0; got -1$"),
        (lambda: routing.offs_from_counts(["a"]),
         r"^offs_from_counts: counts must be rows per expert, an integer tensor \[E\] or a sequence of ints; got "
         r"list$"),
        (lambda: routing.offs_from_counts(torch.ones(3)),
         r"^offs_from_counts: counts must be a 1-D integer tensor \[E\] of rows per expert; got dtype=torch.float32, "
         r"shape=\(3,\)$"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            call()
