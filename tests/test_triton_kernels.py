"""CPU tests of the Triton kernels and backends through Triton's interpreter (TRITON_INTERPRET=1).

Triton decides interpret-or-compile when a ``@triton.jit`` function is *defined*, so the kernel checks run in one
child process started with TRITON_INTERPRET=1 (this pytest process, which may hold compiled kernels for GPU tests,
is never switched). Each test asserts on that child's results: fresh random inputs per check, NaN-poisoned out,
float64 reference of the dequantized inputs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton backends are unavailable")

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r'''
import json, math, sys
import torch
from fp4dispatch.format import _quantize_torch, dequantize_nvfp4, swizzle_scales, unswizzle_scales
from fp4dispatch.kernels import quantize as tq
from fp4dispatch.kernels.dequant import dequantize_rows
from fp4dispatch.kernels import config as C
from fp4dispatch.kernels.fp4_mm import fp4_mm
from fp4dispatch.kernels.heuristics import configs_for
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands

res = {"fused": [], "dequant": [], "quant": [], "nan": [], "dispatch": [], "split": []}
cpu = torch.device("cpu")

def ref64(ops):
    a = dequantize_nvfp4(ops.a, ops.a_scale).double()
    b = dequantize_nvfp4(ops.b, ops.b_scale).double()
    return (a @ b.t()) * ops.alpha.double()

def rel(out, ref):
    o = out.double()
    return math.inf if not bool(torch.isfinite(o).all()) else float((o - ref).norm() / ref.norm())

RA = C.WgmmaRegisterAConfig
extra = [C.MmaBf16Config(16, 16, 2, 3, 4, 3), C.BytewiseGemvConfig(4, 16, 2, 2, 4),
         C.CudaCoreGemvConfig(4, 16, 4, 2, 4, pair_decode=False), C.CudaCoreGemvConfig(2, 8, 8, 3, 4),
         # fp16x2 products: whole K steps (EVEN_K when K/16 % k_blocks == 0), split-K and the register double buffer
         C.CudaCoreGemvConfig(2, 8, 4, 2, 4, fp16x2=True, prefetch=True),
         C.CudaCoreGemvConfig(4, 16, 4, 1, 4, prefetch=True),
         # weight-as-register-operand tensor-core tiles: A decoded in the kernel, several M tiles, split-K
         RA(16, 16, 4, 2, 4, 3), RA(16, 32, 8, 1, 4, 3, predecode_a=True),
         # stream-K: one K step per CTA (the interpreter's 8 "SMs" hold 32), and 3 CTAs that each run pieces of
         # several tiles, with tiles cut between CTAs
         RA(16, 16, 4, 1, 4, 3, stream_k=True), RA(16, 16, 4, 1, 4, 3, stream_k=True, stream_ctas=3, predecode_a=True)]
seed = 0
for m, n, k in [(1, 40, 96), (2, 24, 128), (3, 70, 160), (17, 33, 272), (127, 20, 48)]:
    for odt in (torch.float32, torch.bfloat16, torch.float16):
        for cfg in configs_for(m, n, k, cpu) + extra:
            if (isinstance(cfg, C.BytewiseGemvConfig) and cfg.rows < m or isinstance(cfg, C.CudaCoreGemvConfig)
                    and 8 * cfg.rows < m or isinstance(cfg, RA) and 4 * cfg.block_m < m):
                continue  # the byte-wise GEMV covers M <= rows only; the others tile M (few tiles: interpreter time)
            seed += 1
            ops = make_operands(Problem(m, n, k, odt, cpu), seed=seed)
            fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
            res["fused"].append({"m": m, "n": n, "k": k, "out": str(odt), "cfg": cfg.to_json(), "err": rel(ops.out, ref64(ops))})

# split-K in one launch: the last CTA of a tile sums the partials in split order, so a repeated call gives the same
# bits, and every counter is back at zero afterwards (the next launch on the stream relies on that)
from fp4dispatch.kernels import workspace
for cfg in (RA(16, 16, 4, 3, 4, 3, predecode_a=True), RA(16, 16, 4, 1, 4, 3, stream_k=True, stream_ctas=5),
            C.CudaCoreGemvConfig(2, 8, 4, 3, 4, fp16x2=True), C.MmaBf16Config(16, 16, 2, 3, 4, 3)):
    ops = make_operands(Problem(20, 40, 192, torch.float32, cpu), seed=7)
    fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
    first = ops.out.clone()
    ops.out.fill_(float("nan"))
    fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
    cnt = workspace._COUNTERS[("cpu", 0)]
    res["split"].append({"cfg": cfg.to_json(), "same": bool(torch.equal(first, ops.out)), "err": rel(ops.out, ref64(ops)),
                         "zero": int(cnt.count_nonzero()) == 0, "counters": cnt.numel()})

# NaN block scale -> NaN in exactly that output column; e4m3 subnormal scales stay exact
nan_cfgs = [(1, configs_for(1, 24, 64, cpu)[0]), (5, configs_for(5, 24, 64, cpu)[0]),
            (3, configs_for(3, 24, 64, cpu)[1]),
            (1, C.BytewiseGemvConfig(1, 16, 2, 1, 4)), (3, C.CudaCoreGemvConfig(2, 16, 4, 1, 4, pair_decode=False)),
            (3, RA(16, 16, 4, 1, 4, 3)), (5, RA(16, 16, 4, 1, 4, 3, predecode_a=True))]
for m, cfg in nan_cfgs:
    ops = make_operands(Problem(m, 24, 64, torch.float32, cpu), seed=99)
    lin = torch.randint(1, 8, (24, 4), dtype=torch.uint8)
    lin[5, 2] = 0x7F
    ops = ops._replace(b_scale=swizzle_scales(lin.view(torch.float8_e4m3fn)))
    fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
    ref = ref64(ops)
    keep = [j for j in range(24) if j != 5]
    res["nan"].append({"m": m, "cfg": cfg.to_json(), "nan_col": bool(torch.isnan(ops.out[:, 5]).all()),
                       "err": rel(ops.out[:, keep], ref[:, keep])})

for r, k in [(5, 48), (130, 272)]:
    for dt in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(r + k)
        p = torch.randint(0, 256, (r, k // 2), dtype=torch.uint8, generator=g)
        s = swizzle_scales(torch.randint(1, 0x7E, (r, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn))
        d = dequantize_rows(p, s, dt)
        exact = bool(torch.equal(d.float(), dequantize_nvfp4(p, s)))
        alpha = torch.tensor([0.37], dtype=torch.float32)
        df = dequantize_rows(p, s, torch.bfloat16, factor=alpha)
        want = dequantize_nvfp4(p, s) * alpha
        fold_rel = float(((df.float() - want).abs() / want.abs().clamp_min(1e-30)).max())
        res["dequant"].append({"r": r, "k": k, "dtype": str(dt), "exact": exact, "fold_rel": fold_rel})

for m, k in [(3, 48), (5, 48), (130, 272)]:  # tiles of 1 and 4 rows, a part of the last one padding
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])
    x[1, :16] = 1e6
    gs = torch.tensor([1.0])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        xx = x.to(dt)
        p0, s0 = _quantize_torch(xx, gs)
        for sw in (True, False):
            p1, s1 = tq.quantize(xx, gs, swizzled=sw)
            s0c = swizzle_scales(s0) if sw else s0
            res["quant"].append({"m": m, "k": k, "dtype": str(dt), "swizzled": sw,
                                 "same": bool(torch.equal(p0, p1) and torch.equal(s0c.view(torch.uint8), s1.view(torch.uint8))),
                                 "shape": list(s1.shape), "want_shape": list(s0c.shape)})

# the dynamic quantize (amax kernel, then the quantize kernel) and the static one on inputs holding NaN, inf, zeros
# and tiny values: the same bits and global scale as format.default_global_scale + _quantize_torch
from fp4dispatch.format import default_global_scale
res["quant_dynamic"] = []
small_limit = tq._SMALL_AMAX_ELEMENTS
for m, k in [(1, 16), (130, 272)]:
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for case in ("rand", "nan", "zero", "inf", "tiny", "overflow"):
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(dt)
            if case == "nan":
                x[m // 2, k // 3] = float("nan")
            elif case == "zero":
                x.zero_()
            elif case == "inf":
                x[0, 0] = float("inf")
            elif case == "tiny" and dt == torch.float32:
                x = x * 1e-30
            elif case == "overflow" and dt == torch.float32:  # 2688 / amax overflows: gs 1.0
                x = x * 1e-37
            g0 = default_global_scale(x)
            p0, s0 = _quantize_torch(x, g0)
            # small inputs: the quantize kernel reduces the amax kernel's partial maxima; larger (limit 0 here):
            # the amax kernel's last program does
            for sw, limit in ((True, None), (False, None), (True, 0), (False, 0)):
                tq._SMALL_AMAX_ELEMENTS = small_limit if limit is None else limit
                p1, s1, g1 = tq.quantize_dynamic(x, swizzled=sw)
                tq._SMALL_AMAX_ELEMENTS = small_limit
                s0c = swizzle_scales(s0) if sw else s0
                res["quant_dynamic"].append({"m": m, "dtype": str(dt), "case": case, "swizzled": sw, "limit": limit,
                                             "same_gs": bool(torch.equal(g0.view(torch.int32), g1.view(torch.int32))),
                                             "same": bool(torch.equal(p0, p1) and torch.equal(s0c.view(torch.uint8),
                                                                                              s1.view(torch.uint8)))})

_launch, launched = tq.launch, []
tq.launch = lambda fn, grid, *a, **kw: (launched.append(getattr(fn, "__name__", str(fn))), _launch(fn, grid, *a, **kw))
tq.quantize_dynamic(torch.randn(3, 64))
tq.quantize(torch.randn(3, 64), torch.ones(1))
tq.launch = _launch
res["quant_launches"] = launched

# the pre-decode (A once per call, before the register-A GEMM with predecode_a and the Gluon GEMMs) writes the same
# values whatever its CTA tile
from fp4dispatch.kernels.gemm.wgmma_register_a import predecode
res["predecode"] = []
for r, k in [(3, 80), (20, 272)]:
    ops = make_operands(Problem(r, 16, k, torch.float32, cpu), seed=r)
    args = (ops.a.view(torch.int64), ops.a_scale.view(torch.uint8), False)
    want = predecode(*args).clone()  # the result lives in kept scratch, which the next call reuses
    for tile in ((32, 32, 4), (8, 4, 2)):
        res["predecode"].append({"r": r, "k": k, "tile": tile, "same": bool(torch.equal(predecode(*args, tile), want))})

import fp4dispatch
from fp4dispatch.backends.triton_dequant import TritonDequantBackend
from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.testing import make_nvfp4_inputs
d = Dispatcher([TritonFusedBackend(), TritonDequantBackend()], cache_dir=sys.argv[1])
for name in ("triton:fused", "triton:dequant+matmul"):
    for m, odt in ((1, torch.bfloat16), (3, torch.float32), (20, torch.float16)):
        a, b, sa, sb, al = make_nvfp4_inputs(m, 48, 160, seed=m)
        out = d.fp4_mm(a, b, sa, sb, al, out_dtype=odt, backend=name)
        ref = (dequantize_nvfp4(a, sa).double() @ dequantize_nvfp4(b, sb).double().t()) * al.double()
        res["dispatch"].append({"backend": name, "m": m, "out": str(odt), "err": rel(out, ref)})
rep = {r.name: r.status for r in d.report(cpu)}
res["report"] = rep

# w4a16_mm: every offered config and a few more (several M tiles, split-K), bf16/fp16 activations as given, the
# dispatcher's own hostile check (NaN scale, subnormal scale, negative alpha, guard rows) per backend and config
from fp4dispatch.backends.triton_w4a16 import TritonW4A16Backend
from fp4dispatch.dispatch.verify import check_run, make_case
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.kernels.heuristics import w4a16_configs_for
res["w4a16"] = []
w4 = [TritonW4A16Backend(), TritonDequantBackend()]
for m, n, k in [(1, 40, 96), (3, 64, 256), (17, 33, 272), (70, 48, 160)]:
    for adt in (torch.bfloat16, torch.float16):
        for odt in (torch.float32, adt):
            p = Problem(m, n, k, odt, cpu, adt)
            case = make_case(p, m + n, reference_mm)
            # several M and N tiles, split-K
            extra_w4 = [C.MmaW4A16Config(16, 16, 2, 3, 4, 3), C.CudaCoreW4A16Config(2, 16, 4, 2, 4),
                        C.WgmmaRegisterAW4A16Config(16, 16, 4, 2, 4, 3),
                        C.WgmmaRegisterAW4A16Config(16, 32, 8, 3, 4, 3),
                        # stream-K: as many CTAs as fit the interpreter's "SMs", and 3 CTAs that cut tiles
                        C.WgmmaRegisterAW4A16Config(16, 16, 4, 1, 4, 3, stream_k=True),
                        C.WgmmaRegisterAW4A16Config(16, 16, 4, 1, 4, 3, stream_k=True, stream_ctas=3)]
            for b in w4:
                cfgs = b.configs(p) + (extra_w4 if b is w4[0] else [])
                for cfg in cfgs:
                    why = check_run(b, case, cfg)
                    fam = cfg.family if hasattr(cfg, "family") else str(cfg)
                    res["w4a16"].append({"backend": b.name, "m": m, "n": n, "k": k, "a": str(adt), "out": str(odt),
                                         "cfg": fam, "why": why, "err": rel(case.ops.out[:, :n - 1],
                                                                           case.ref.double()[:, :n - 1])})
# an activation and an alpha that require grad: every config runs (torch's out= variants refuse such inputs) and
# writes the bits it writes without, with no autograd history on out
res["grad"] = []
p = Problem(3, 64, 256, torch.bfloat16, cpu, torch.bfloat16)
ops = make_case(p, 5, reference_mm).ops
for b in w4:
    for cfg in b.configs(p):
        want = torch.full_like(ops.out, float("nan"))
        b.run(p, ops._replace(out=want), cfg)
        got = torch.full_like(ops.out, float("nan"))
        grad = ops._replace(a=ops.a.clone().requires_grad_(), alpha=ops.alpha.clone().requires_grad_(), out=got)
        try:
            b.run(p, grad, cfg)
            why = None
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits: the case's last column is NaN
        res["grad"].append({"backend": b.name, "cfg": str(cfg), "why": why, "same": bool(same),
                            "history": got.requires_grad or got.grad_fn is not None})
print("RESULT " + json.dumps(res))
'''

# Triton's interpreter casts fp32 -> bf16 by truncation (round toward zero: up to 1 ulp = 2**-7 relative), not
# round-to-nearest-even as GPUs do (<= 2**-8; the GPU tests hold bf16 to 4e-3). fp32 out is the exactness check.
TOL = {"torch.float32": 1e-5, "torch.bfloat16": 2**-7, "torch.float16": 4e-3}


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    cache = tmp_path_factory.mktemp("fp4cache")
    env["FP4DISPATCH_CACHE_DIR"] = str(cache)
    p = subprocess.run([sys.executable, "-c", _CHILD, str(cache)], env=env, capture_output=True, text=True,
                       timeout=600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise AssertionError(f"interpreter child failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def test_fused_configs_exact(child):
    rows = child["fused"]
    assert len(rows) >= 40
    kinds = {r["cfg"]["family"] for r in rows}
    assert kinds == {"gemv_cuda_core_bytes", "gemv_cuda_core", "gemm_mma_bf16", "gemm_wgmma_register_a"}
    wm = [r for r in rows if r["cfg"]["family"] == "gemm_wgmma_register_a"]
    assert {r["cfg"]["predecode_a"] for r in wm} == {True, False}
    assert {r["cfg"]["stream_k"] for r in wm} == {True, False}  # stream-K, incl. tiles cut between CTAs
    assert any(r["cfg"]["block_m"] < r["m"] for r in wm)  # several M tiles (program_id(2))
    # K in groups of 4 blocks: whole and partial last groups (the pre-decode pads A's K order to whole groups)
    assert {(r["k"] // 16) % 4 == 0 for r in wm if r["cfg"]["predecode_a"]} == {True, False}
    g2 = [r for r in rows if r["cfg"]["family"] == "gemv_cuda_core"]
    assert {r["m"] for r in g2} >= {1, 3, 17} and {r["cfg"]["pair_decode"] for r in g2} == {True, False}
    assert any(r["cfg"]["rows"] < r["m"] for r in g2)  # several M tiles (program_id(2))
    h2 = [r for r in g2 if r["cfg"]["fp16x2"]]
    assert {r["m"] for r in h2} >= {1, 3} and {r["cfg"]["prefetch"] for r in h2} == {True, False}
    # both load paths: whole K steps (no K mask) and a partial last step
    assert {(r["k"] // 16) % r["cfg"]["k_blocks"] == 0 for r in h2} == {True, False}
    assert any(r["cfg"].get("split_k", 1) > 1 for r in rows)  # split-K (the last CTA sums) is covered
    bad = [r for r in rows if not r["err"] <= TOL[r["out"]]]
    assert not bad, bad[:3]
    worst32 = max(r["err"] for r in rows if r["out"] == "torch.float32")
    assert worst32 <= 1e-5


def test_split_k_in_one_launch_deterministic_and_rearmed(child):
    rows = child["split"]
    assert {r["cfg"]["family"] for r in rows} == {"gemm_wgmma_register_a", "gemv_cuda_core", "gemm_mma_bf16"}
    for r in rows:
        assert r["same"] and r["zero"], r
        assert r["err"] <= 1e-5, r
        assert r["counters"] == 1 << 14  # one buffer for the stream, made once, reused


@pytest.mark.parametrize("tiles, steps, ctas", [(6, 5, 3), (2, 2, 3), (224, 64, 132), (64, 32, 528), (7, 3, 40),
                                                 (1, 1, 1), (3, 17, 5)])
def test_stream_k_schedule_covers_every_step_once(tiles, steps, ctas):
    """The CTA ranges of ``wmma_sk_kernel`` (CTA c: steps [c*T//P, (c+1)*T//P), walked tile piece by tile piece)
    cover every K step of every tile once; each tile's pieces get part numbers 0..parts-1 from its first CTA on, and
    ``stream_parts`` is the workspace depth they need."""
    from fp4dispatch.kernels.gemm.wgmma_register_a import stream_parts

    total = tiles * steps
    ctas = min(ctas, total)
    seen = {}
    for c in range(ctas):
        it, hi = c * total // ctas, (c + 1) * total // ctas
        while it < hi:  # the kernel's loop, in Python
            tile = it // steps
            s1 = min(steps, it - tile * steps + hi - it)
            first = ((tile * steps + 1) * ctas - 1) // total
            last = ((tile + 1) * steps * ctas - 1) // total
            seen.setdefault(tile, []).append((c - first, last - first + 1, it - tile * steps, s1))
            it = tile * steps + s1
    assert sorted(seen) == list(range(tiles))
    depth = 0
    for tile, pieces in seen.items():
        parts = pieces[0][1]
        assert [p[0] for p in pieces] == list(range(parts)) and all(p[1] == parts for p in pieces)
        assert [(p[2], p[3]) for p in pieces] == [(a, b) for a, b in zip([0] + [p[3] for p in pieces[:-1]],
                                                                          [p[3] for p in pieces])]
        assert pieces[-1][3] == steps
        depth = max(depth, parts)
    assert stream_parts(tiles, steps, ctas) == depth


def test_a_stream_k_launch_that_cuts_no_tile_still_gets_buffers_of_the_compiled_types(monkeypatch):
    """One K step per tile (N=4096 K=128 at M=128): no tile is cut, yet ``wmma_sk_kernel`` compiles its cut-tile
    branch, whose atomic needs int32 counters and whose partials are fp32 (with out, bf16, in their place Triton
    refused the atomic or crashed in a pass on the H200)."""
    from fp4dispatch.kernels import runtime, workspace
    from fp4dispatch.kernels.config import WgmmaRegisterAConfig
    from fp4dispatch.kernels.gemm.wgmma_register_a import stream_grid

    monkeypatch.setattr(workspace, "_COUNTERS", {})
    monkeypatch.setattr(runtime, "num_sms", lambda device: 132)
    cfg = WgmmaRegisterAConfig(block_m=128, block_n=128, k_blocks=8, split_k=1, warps=8, stages=3, predecode_a=True,
                               stream_k=True)
    out = torch.empty(128, 4096, dtype=torch.bfloat16)
    nt, tiles, steps, ctas, ws, cnt = stream_grid(128, 4096, 8, cfg, out)
    assert (tiles, steps, ctas) == (32, 1, 32) and ws.dtype == torch.float32 and ws.numel() == 1
    assert cnt.dtype == torch.int32 and int(cnt.count_nonzero()) == 0
    *_, ws, cnt = stream_grid(128, 4096, 64, cfg, out)  # 8 steps per tile: tiles are cut, a real workspace
    assert ws.dtype == torch.float32 and cnt.dtype == torch.int32


@pytest.mark.parametrize("w4a16", [False, True])
def test_a_stream_k_config_with_one_k_step_per_tile_runs_the_tile_per_cta_kernel(monkeypatch, w4a16):
    """Nothing to stream at one K step per tile, and Triton 3.6 could not compile the stream-K kernel there (its
    coalesce pass crashed on the H200 at N=4096 K=128): the plain kernel runs; two steps per tile stream."""
    from fp4dispatch.kernels import runtime
    from fp4dispatch.kernels.config import WgmmaRegisterAConfig, WgmmaRegisterAW4A16Config
    from fp4dispatch.kernels.gemm import wgmma_register_a, wgmma_register_a_w4a16

    launched = []
    monkeypatch.setattr(runtime, "launch", lambda fn, grid, *args, **kw: launched.append(fn))
    monkeypatch.setattr(runtime, "num_sms", lambda device: 132)
    m, n = 128, 256
    for k, kernel in ((128, "plain"), (256, "sk")):
        common = dict(block_m=128, block_n=128, k_blocks=8, split_k=1, warps=8, stages=3, stream_k=True)
        out, alpha = torch.empty(m, n, dtype=torch.bfloat16), torch.ones(1)
        b, sb = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.uint8)
        launched.clear()
        if w4a16:
            monkeypatch.setattr(wgmma_register_a_w4a16, "permute_a", lambda a, pdl: (a, a.shape[1]))
            wgmma_register_a_w4a16.run(torch.zeros(m, k, dtype=torch.bfloat16), b, sb, alpha, out,
                                       WgmmaRegisterAW4A16Config(**common))
            want = {"plain": wgmma_register_a_w4a16.wmma_w4a16_kernel,
                    "sk": wgmma_register_a_w4a16.wmma_w4a16_sk_kernel}[kernel]
        else:
            wgmma_register_a.run(torch.zeros(m, k // 2, dtype=torch.uint8), b, torch.zeros(m, k // 16,
                                 dtype=torch.uint8), sb, alpha, out, WgmmaRegisterAConfig(**common, predecode_a=False))
            want = {"plain": wgmma_register_a.wmma_kernel, "sk": wgmma_register_a.wmma_sk_kernel}[kernel]
        assert launched == [want], (k, launched)


def test_split_buffers_per_stream_and_under_capture(monkeypatch):
    from fp4dispatch.kernels import workspace

    monkeypatch.setattr(workspace, "_COUNTERS", {})
    cpu = torch.device("cpu")
    ws, cnt = workspace.buffers(3, 5, 2, 7, cpu)
    assert ws.shape == (2, 3, 5) and ws.dtype == torch.float32
    assert cnt.dtype == torch.int32 and cnt.numel() == workspace.MIN_COUNTERS and int(cnt.count_nonzero()) == 0
    assert workspace.buffers(3, 5, 2, 7, cpu)[1] is cnt  # zeroed once, then reused
    big = workspace.buffers(1, 1, 2, workspace.MIN_COUNTERS + 1, cpu)[1]
    assert big.numel() == workspace.MIN_COUNTERS + 1 and workspace.buffers(1, 1, 2, 7, cpu)[1] is big  # grown, kept
    # capturing with no buffer for the stream: a fresh zeroed one per launch, not kept (its zero-fill is captured)
    monkeypatch.setattr(workspace, "_COUNTERS", {})
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    c1, c2 = workspace.buffers(1, 1, 2, 9, cpu)[1], workspace.buffers(1, 1, 2, 9, cpu)[1]
    assert c1 is not c2 and c1.numel() == 9 and int(c1.count_nonzero()) == 0 and workspace._COUNTERS == {}
    workspace.prepare(cpu)  # prepared outside capture: captured launches reuse it
    assert workspace.buffers(1, 1, 2, 9, cpu)[1] is workspace._COUNTERS[("cpu", 0)]


def test_prepare_capture_only_for_a_capture_stream_on_that_device(monkeypatch):
    from types import SimpleNamespace

    from fp4dispatch.kernels import workspace

    made = []
    monkeypatch.setattr(workspace, "prepare", lambda device, stream=None, tiles=0: made.append((device, stream)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    workspace.prepare_capture(torch.device("cuda", 1))  # not the current device: torch would capture elsewhere
    assert torch.cuda.graph.default_capture_stream is None and made == []
    workspace.prepare_capture(torch.device("cuda"))  # the current device: the stream is made the way torch makes it
    stream = torch.cuda.graph.default_capture_stream
    assert stream is not None and made == [(torch.device("cuda", 0), stream)]
    workspace.prepare_capture(torch.device("cuda", 1))  # the existing capture stream lives on device 0
    assert len(made) == 1
    workspace.prepare_capture(torch.device("cpu"))
    assert len(made) == 1


def test_pdl_only_on_sm90_gpus(monkeypatch):
    from fp4dispatch.kernels import runtime

    assert runtime.pdl(torch.device("cpu"), True) == {}
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for cap, want in (((9, 0), True), ((12, 0), True), ((8, 9), False)):
        runtime._pdl_capable.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None, cap=cap: cap)
        assert bool(runtime.pdl(torch.device("cuda", 0), True)) is want
        assert runtime.pdl(torch.device("cuda", 0), False) == {}
    runtime._pdl_capable.cache_clear()


def test_predecode_same_values_whatever_its_tile(child):
    rows = child["predecode"]
    assert len(rows) == 4 and all(r["same"] for r in rows), rows


def test_predecode_refuses_a_tile_that_cuts_a_scale_group():
    from fp4dispatch.kernels.gemm.wgmma_register_a import predecode

    a64 = torch.zeros(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"predecode: tile\[1\] \(16-blocks per CTA\) must be a multiple of 4; got "
                                         r"tile=\(16, 6, 4\)"):
        predecode(a64, torch.zeros(512 * 2, dtype=torch.uint8), False, (16, 6, 4))


def test_nan_scale_propagates_and_subnormal_scales_exact(child):
    assert {r["cfg"]["family"] for r in child["nan"]} == {"gemv_cuda_core_bytes", "gemv_cuda_core", "gemm_mma_bf16",
                                                          "gemm_wgmma_register_a"}
    assert {r["m"] for r in child["nan"]} == {1, 3, 5}
    for r in child["nan"]:
        assert r["nan_col"], r
        assert r["err"] <= 1e-5, r


def test_dequant_kernel_exact_and_fold(child):
    assert len(child["dequant"]) == 4
    for r in child["dequant"]:
        assert r["exact"], r
        assert r["fold_rel"] <= 2**-7, r  # alpha folded in: one bf16 cast (truncating in the interpreter)


def test_quantize_bit_identical(child):
    assert len(child["quant"]) == 18
    for r in child["quant"]:
        assert r["same"], r
        assert r["shape"] == r["want_shape"]


def test_backends_through_dispatcher(child):
    assert child["report"] == {"triton:fused": "ok", "triton:dequant+matmul": "ok"}
    assert len(child["dispatch"]) == 6
    for r in child["dispatch"]:
        assert r["err"] <= TOL[r["out"]], r


def test_unavailable_without_interpreter_on_cpu(monkeypatch):
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.backends.triton_fused import TritonFusedBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for b in (TritonFusedBackend(), TritonDequantBackend()):
        assert b.unavailable(torch.device("cpu")) == "needs a CUDA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonFusedBackend().unavailable(torch.device("cpu")) is None


def test_fp4_mm_rejects_what_is_not_a_kernel_config():
    from fp4dispatch.errors import InvalidInputError
    from fp4dispatch.kernels.fp4_mm import fp4_mm

    t = torch.zeros(1, 8, dtype=torch.uint8)
    with pytest.raises(InvalidInputError, match=r"fp4_mm: config must be one of CudaCoreGemvConfig, .* \(from "
                                                r"heuristics.configs_for\); got dict"):
        fp4_mm(t, t, t, t, torch.ones(1), torch.empty(1, 1), {"kernel": "gemv2", "MB": 1, "BN": 16, "BKB": 4})


def test_dequant_backend_configs():
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.problem import Problem

    b = TritonDequantBackend()
    cpu = torch.device("cpu")
    assert b.configs(Problem(4, 8, 16, torch.bfloat16, cpu)) == [{"alpha": "fold"}, {"alpha": "epilogue"}]
    assert b.configs(Problem(4, 8, 16, torch.float32, cpu)) == [{"alpha": "epilogue"}]
    # w4a16: alpha folded into the weight's bf16 values (the activations are the user's), never into fp16 ones nor
    # into the alpha-free cached weight
    w4a16 = [Problem(4, 8, 16, dt, cpu, adt) for dt, adt in ((torch.bfloat16, torch.bfloat16),
                                                                (torch.float16, torch.float16),
                                                                (torch.float32, torch.bfloat16))]
    assert [b.configs(p) for p in w4a16] == [[{"alpha": "fold"}, {"alpha": "epilogue"}], [{"alpha": "epilogue"}],
                                             [{"alpha": "epilogue"}]]
    cached = TritonDequantBackend(cache_weight=True)
    assert cached.name == "triton:dequant+matmul(cached)" and cached.configs(w4a16[0]) == [{"alpha": "epilogue"}]


def test_dequant_backend_asks_once_whether_mm_takes_out_dtype(monkeypatch):
    """triton:dequant+matmul's fp32-output GEMM: a torch whose mm lacks out_dtype for the device is asked once per
    process (a raised error per call would cost more host time than the GEMM), and the fallback is exact."""
    from fp4dispatch.backends import triton_dequant as D

    monkeypatch.setattr(D, "_MM_OUT_DTYPE", {})
    tries = []
    real_mm = torch.mm

    def mm(a, b, *, out_dtype=None, out=None):
        if out_dtype is not None:
            tries.append(out_dtype)
            raise NotImplementedError("Could not run 'aten::mm.dtype' with arguments from the 'CPU' backend")
        return real_mm(a, b) if out is None else real_mm(a, b, out=out)
    monkeypatch.setattr(D.torch, "mm", mm)
    a, b = torch.randn(3, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    for _ in range(3):
        got = D._mm_f32(a, b, None)
        assert got.dtype == torch.float32 and torch.equal(got, a.float() @ b.float().t())
    assert len(tries) == 1 and D._MM_OUT_DTYPE == {"cpu": False}


def test_inputs_that_require_grad_run_every_config_without_autograd_history(child):
    rows = child["grad"]
    assert {r["backend"] for r in rows} == {"triton:w4a16", "triton:dequant+matmul"}
    bad = [r for r in rows if r["why"] or not r["same"] or r["history"]]
    assert not bad, bad


def test_w4a16_kernels_pass_the_dispatchers_check_for_every_config(child):
    rows = child["w4a16"]
    assert {r["cfg"] for r in rows if r["backend"] == "triton:w4a16"} == {"w4a16_gemv_cuda_core", "w4a16_mma",
                                                                         "w4a16_wgmma_register_a"}
    assert {r["backend"] for r in rows} == {"triton:w4a16", "triton:dequant+matmul"}
    # bf16 in and out: dequant+matmul also with alpha folded into the weight's bf16 values (checked like the rest)
    assert {r["cfg"] for r in rows if r["backend"] == "triton:dequant+matmul" and r["a"] == r["out"]
            == "torch.bfloat16"} == {str({"alpha": "fold"}), str({"alpha": "epilogue"})}
    assert {(r["a"], r["out"]) for r in rows} >= {("torch.bfloat16", "torch.float32"), ("torch.float16",
                                                                                       "torch.float16")}
    bad = [r for r in rows if r["why"] is not None]
    assert not bad, bad[:3]
    # fp32 out: the sums are fp32, every product exact (the last column, a NaN block scale's, left out)
    assert max(r["err"] for r in rows if r["out"] == "torch.float32") <= 1e-5


def test_dynamic_quantize_is_two_launches_with_the_reference_bits(child):
    rows = child["quant_dynamic"]
    assert {r["case"] for r in rows} == {"rand", "nan", "zero", "inf", "tiny", "overflow"} and len(rows) == 144
    assert {r["limit"] for r in rows} == {None, 0}
    bad = [r for r in rows if not (r["same"] and r["same_gs"])]
    assert not bad, bad[:3]
    # dynamic: the amax kernel then the quantize kernel; static: the quantize kernel alone (it writes the swizzled
    # layout's zero padding itself, so there is no memset before it)
    assert child["quant_launches"] == ["amax_scale_kernel", "quant_kernel", "quant_kernel"]
