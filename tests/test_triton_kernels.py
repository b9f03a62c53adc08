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
from fp4dispatch.kernels.fused import configs_for, fused_mm
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

extra = [{"kernel": "mma", "BM": 16, "BN": 16, "BKB": 2, "split": 3},
         {"kernel": "gemv", "MB": 4, "BN": 16, "BKB": 2, "split": 2},
         {"kernel": "gemv2", "MB": 4, "BN": 16, "BKB": 4, "split": 2, "PAIR": False},
         {"kernel": "gemv2", "MB": 2, "BN": 8, "BKB": 8, "split": 3, "PAIR": True},
         # fp16x2 products: whole K steps (EVEN_K when K/16 % BKB == 0), split-K and the register double buffer
         {"kernel": "gemv2", "MB": 2, "BN": 8, "BKB": 4, "split": 2, "H2": True, "prefetch": True},
         {"kernel": "gemv2", "MB": 4, "BN": 16, "BKB": 4, "split": 1, "H2": False, "prefetch": True},
         # swapped-operand tensor-core tiles: A decoded in the kernel (no APRE), several M tiles, split-K
         {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 2},
         {"kernel": "wmma", "BM": 16, "BN": 32, "BKB": 8, "split": 1, "APRE": True},
         # stream-K: one K step per CTA (the interpreter's 8 "SMs" hold 32), and 3 CTAs that each run pieces of
         # several tiles, with tiles cut between CTAs
         {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 1, "stream": True},
         {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 1, "stream": True, "ctas": 3, "APRE": True}]
seed = 0
for m, n, k in [(1, 40, 96), (2, 24, 128), (3, 70, 160), (17, 33, 272), (127, 20, 48)]:
    for odt in (torch.float32, torch.bfloat16, torch.float16):
        for cfg in configs_for(m, n, k, cpu) + extra:
            if (cfg["kernel"] == "gemv" and cfg["MB"] < m or cfg["kernel"] == "gemv2" and 8 * cfg["MB"] < m
                    or cfg["kernel"] == "wmma" and 4 * cfg["BM"] < m):
                continue  # gemv covers M <= MB only; gemv2 tiles M (kept to few M tiles: interpreter time)
            seed += 1
            ops = make_operands(Problem(m, n, k, odt, cpu), seed=seed)
            fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
            res["fused"].append({"m": m, "n": n, "k": k, "out": str(odt), "cfg": cfg, "err": rel(ops.out, ref64(ops))})

# split-K in one launch: the last CTA of a tile sums the partials in split order, so a repeated call gives the same
# bits, and every counter is back at zero afterwards (the next launch on the stream relies on that)
from fp4dispatch.kernels import splitk
for cfg in ({"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 3, "APRE": True},
            {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 1, "stream": True, "ctas": 5},
            {"kernel": "gemv2", "MB": 2, "BN": 8, "BKB": 4, "split": 3, "H2": True},
            {"kernel": "mma", "BM": 16, "BN": 16, "BKB": 2, "split": 3}):
    ops = make_operands(Problem(20, 40, 192, torch.float32, cpu), seed=7)
    fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
    first = ops.out.clone()
    ops.out.fill_(float("nan"))
    fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
    cnt = splitk._COUNTERS[("cpu", 0)]
    res["split"].append({"cfg": cfg, "same": bool(torch.equal(first, ops.out)), "err": rel(ops.out, ref64(ops)),
                         "zero": int(cnt.count_nonzero()) == 0, "counters": cnt.numel()})

# NaN block scale -> NaN in exactly that output column; e4m3 subnormal scales stay exact
nan_cfgs = [(1, configs_for(1, 24, 64, cpu)[0]), (5, configs_for(5, 24, 64, cpu)[0]),
            (3, configs_for(3, 24, 64, cpu)[1]),
            (1, {"kernel": "gemv", "MB": 1, "BN": 16, "BKB": 2, "split": 1}),
            (3, {"kernel": "gemv2", "MB": 2, "BN": 16, "BKB": 4, "split": 1, "PAIR": False}),
            (3, {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 1}),
            (5, {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 4, "split": 1, "APRE": True})]
for m, cfg in nan_cfgs:
    ops = make_operands(Problem(m, 24, 64, torch.float32, cpu), seed=99)
    lin = torch.randint(1, 8, (24, 4), dtype=torch.uint8)
    lin[5, 2] = 0x7F
    ops = ops._replace(b_scale=swizzle_scales(lin.view(torch.float8_e4m3fn)))
    fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
    ref = ref64(ops)
    keep = [j for j in range(24) if j != 5]
    res["nan"].append({"m": m, "cfg": cfg, "nan_col": bool(torch.isnan(ops.out[:, 5]).all()),
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

for m, k in [(5, 48), (130, 272)]:
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

# the pre-decode (A once per call, before wmma with APRE, wgws and wgds) writes the same values whatever its CTA tile;
# benchmarks/predecode.py times the tiles on a GPU
from fp4dispatch.kernels.fused import predecode
res["predecode"] = []
for r, k in [(3, 80), (20, 272)]:
    ops = make_operands(Problem(r, 16, k, torch.float32, cpu), seed=r)
    args = (ops.a.view(torch.int64), ops.a_scale.view(torch.uint8), False)
    want = predecode(*args)
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
    kinds = {r["cfg"]["kernel"] for r in rows}
    assert kinds == {"gemv", "gemv2", "mma", "wmma"}
    wm = [r for r in rows if r["cfg"]["kernel"] == "wmma"]
    assert {bool(r["cfg"].get("APRE")) for r in wm} == {True, False}
    assert {bool(r["cfg"].get("stream")) for r in wm} == {True, False}  # stream-K, incl. tiles cut between CTAs
    assert any(r["cfg"]["BM"] < r["m"] for r in wm)  # several M tiles (program_id(2))
    # K in groups of 4 blocks: whole and partial last groups (APRE pads A's K order to whole groups)
    assert {(r["k"] // 16) % 4 == 0 for r in wm if r["cfg"].get("APRE")} == {True, False}
    g2 = [r for r in rows if r["cfg"]["kernel"] == "gemv2"]
    assert {r["m"] for r in g2} >= {1, 3, 17} and {r["cfg"].get("PAIR", True) for r in g2} == {True, False}
    assert any(r["cfg"]["MB"] < r["m"] for r in g2)  # several M tiles (program_id(2))
    h2 = [r for r in g2 if r["cfg"].get("H2")]
    assert {r["m"] for r in h2} >= {1, 3} and {bool(r["cfg"].get("prefetch")) for r in h2} == {True, False}
    # both load paths: whole K steps (no K mask) and a partial last step
    assert {(r["k"] // 16) % r["cfg"]["BKB"] == 0 for r in h2} == {True, False}
    assert any(r["cfg"].get("split", 1) > 1 for r in rows)  # split-K (the last CTA sums) is covered
    bad = [r for r in rows if not r["err"] <= TOL[r["out"]]]
    assert not bad, bad[:3]
    worst32 = max(r["err"] for r in rows if r["out"] == "torch.float32")
    assert worst32 <= 1e-5


def test_split_k_in_one_launch_deterministic_and_rearmed(child):
    rows = child["split"]
    assert {r["cfg"]["kernel"] for r in rows} == {"wmma", "gemv2", "mma"}
    for r in rows:
        assert r["same"] and r["zero"], r
        assert r["err"] <= 1e-5, r
        assert r["counters"] == 1 << 14  # one buffer for the stream, made once, reused


@pytest.mark.parametrize("tiles, steps, ctas", [(6, 5, 3), (2, 2, 3), (224, 64, 132), (64, 32, 528), (7, 3, 40),
                                                 (1, 1, 1), (3, 17, 5)])
def test_stream_k_schedule_covers_every_step_once(tiles, steps, ctas):
    """The CTA ranges of ``wmma_sk_kernel`` (CTA c: steps [c*T//P, (c+1)*T//P), walked tile piece by tile piece)
    cover every K step of every tile once; each tile's pieces get part numbers 0..parts-1 from its first CTA on, and
    ``_stream_parts`` is the workspace depth they need."""
    from fp4dispatch.kernels.fused import _stream_parts

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
    assert _stream_parts(tiles, steps, ctas) == depth


def test_split_buffers_per_stream_and_under_capture(monkeypatch):
    from fp4dispatch.kernels import splitk

    monkeypatch.setattr(splitk, "_COUNTERS", {})
    cpu = torch.device("cpu")
    ws, cnt = splitk.buffers(3, 5, 2, 7, cpu)
    assert ws.shape == (2, 3, 5) and ws.dtype == torch.float32
    assert cnt.dtype == torch.int32 and cnt.numel() == splitk.MIN_COUNTERS and int(cnt.count_nonzero()) == 0
    assert splitk.buffers(3, 5, 2, 7, cpu)[1] is cnt  # zeroed once, then reused
    big = splitk.buffers(1, 1, 2, splitk.MIN_COUNTERS + 1, cpu)[1]
    assert big.numel() == splitk.MIN_COUNTERS + 1 and splitk.buffers(1, 1, 2, 7, cpu)[1] is big  # grown, kept
    # capturing with no buffer for the stream: a fresh zeroed one per launch, not kept (its zero-fill is captured)
    monkeypatch.setattr(splitk, "_COUNTERS", {})
    monkeypatch.setattr(splitk, "_capturing", lambda device: True)
    c1, c2 = splitk.buffers(1, 1, 2, 9, cpu)[1], splitk.buffers(1, 1, 2, 9, cpu)[1]
    assert c1 is not c2 and c1.numel() == 9 and int(c1.count_nonzero()) == 0 and splitk._COUNTERS == {}
    splitk.prepare(cpu)  # prepared outside capture: captured launches reuse it
    assert splitk.buffers(1, 1, 2, 9, cpu)[1] is splitk._COUNTERS[("cpu", 0)]


def test_wgds_split_buffers_typed_even_unsplit(monkeypatch):
    """wgds compiles its split epilogue whatever SPLIT is: unsplit, alpha stands in as an fp32 workspace and int32
    counters (never touched); split, a [BN, BM] fp32 block per (tile, part) and the stream's zeroed counters."""
    from fp4dispatch.kernels import splitk
    from fp4dispatch.kernels.fused import wgds_split_args

    monkeypatch.setattr(splitk, "_COUNTERS", {})
    alpha, out = torch.ones(1), torch.empty(3, 5)
    ws, cnt = wgds_split_args(1, 12, 64 * 128, alpha, out)
    assert ws is alpha and cnt.dtype == torch.int32 and cnt.data_ptr() == alpha.data_ptr()
    ws, cnt = wgds_split_args(4, 12, 64 * 128, alpha, out)
    assert ws.dtype == torch.float32 and ws.numel() == 4 * 12 * 64 * 128
    assert cnt.dtype == torch.int32 and cnt.numel() >= 12 and int(cnt.count_nonzero()) == 0


def test_prepare_capture_only_for_a_capture_stream_on_that_device(monkeypatch):
    from types import SimpleNamespace

    from fp4dispatch.kernels import splitk

    made = []
    monkeypatch.setattr(splitk, "prepare", lambda device, stream=None, tiles=0: made.append((device, stream)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    splitk.prepare_capture(torch.device("cuda", 1))  # not the current device: torch would capture elsewhere
    assert torch.cuda.graph.default_capture_stream is None and made == []
    splitk.prepare_capture(torch.device("cuda"))  # the current device: the stream is made the way torch makes it
    stream = torch.cuda.graph.default_capture_stream
    assert stream is not None and made == [(torch.device("cuda", 0), stream)]
    splitk.prepare_capture(torch.device("cuda", 1))  # the existing capture stream lives on device 0
    assert len(made) == 1
    splitk.prepare_capture(torch.device("cpu"))
    assert len(made) == 1


def test_pdl_only_on_sm90_gpus(monkeypatch):
    from fp4dispatch.kernels import fused

    assert fused._pdl(torch.device("cpu"), {}) == {}
    monkeypatch.setattr(fused, "_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for cap, want in (((9, 0), True), ((12, 0), True), ((8, 9), False)):
        fused._pdl_capable.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None, cap=cap: cap)
        assert bool(fused._pdl(torch.device("cuda", 0), {})) is want
        assert fused._pdl(torch.device("cuda", 0), {"pdl": False}) == {}
    fused._pdl_capable.cache_clear()


def test_predecode_same_values_whatever_its_tile(child):
    rows = child["predecode"]
    assert len(rows) == 4 and all(r["same"] for r in rows), rows


def test_predecode_refuses_a_tile_that_cuts_a_scale_group():
    from fp4dispatch.kernels.fused import predecode

    a64 = torch.zeros(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"predecode: tile\[1\] \(16-blocks per CTA\) must be a multiple of 4; got "
                                         r"tile=\(16, 6, 4\)"):
        predecode(a64, torch.zeros(512 * 2, dtype=torch.uint8), False, (16, 6, 4))


def test_nan_scale_propagates_and_subnormal_scales_exact(child):
    assert {r["cfg"]["kernel"] for r in child["nan"]} == {"gemv", "gemv2", "mma", "wmma"}
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
    assert len(child["quant"]) == 12
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


def test_fused_mm_rejects_unknown_kernel():
    from fp4dispatch.kernels.fused import fused_mm

    t = torch.zeros(1, 8, dtype=torch.uint8)
    with pytest.raises(ValueError,
                       match=r"config\['kernel'\] must be 'gemv', 'gemv2', 'mma', 'wmma', 'wgws', 'wgds' or 'gvws'; "
                             r"got 'nope'"):
        fused_mm(t, t, t, t, torch.ones(1), torch.empty(1, 1), {"kernel": "nope", "BKB": 1})
    with pytest.raises(ValueError, match=r"gemv2 needs BKB % 4 == 0"):
        fused_mm(t, t, t, t, torch.ones(1), torch.empty(1, 1), {"kernel": "gemv2", "MB": 1, "BN": 16, "BKB": 2})
    with pytest.raises(ValueError, match=r"wgws needs BKB % 4 == 0 \(whole swizzled scale groups\); got 6"):
        fused_mm(t, t, t, t, torch.ones(1), torch.empty(1, 1), {"kernel": "wgws", "BM": 256, "BN": 128, "BKB": 6,
                                                                 "stages": 5})
    with pytest.raises(ValueError, match=r"wmma needs BKB % 4 == 0"):
        fused_mm(t, t, t, t, torch.ones(1), torch.empty(1, 1), {"kernel": "wmma", "BM": 16, "BN": 16, "BKB": 6})


def test_configs_are_short_and_json(child):
    from fp4dispatch.kernels.fused import configs_for

    for m in (1, 2, 3, 16, 17, 64, 128, 512, 1024, 8192):
        cfgs = configs_for(m, 8192, 8192, torch.device("cpu"))
        assert 1 <= len(cfgs) <= 7
        assert json.loads(json.dumps(cfgs)) == cfgs
        assert all(c["BKB"] >= 2 for c in cfgs)  # dot K = 8 * BKB must be >= 16


def test_dequant_backend_configs():
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.problem import Problem

    b = TritonDequantBackend()
    cpu = torch.device("cpu")
    assert b.configs(Problem(4, 8, 16, torch.bfloat16, cpu)) == [{"alpha": "fold"}, {"alpha": "epilogue"}]
    assert b.configs(Problem(4, 8, 16, torch.float32, cpu)) == [{"alpha": "epilogue"}]
    assert TritonDequantBackend(cache_weight=True).name == "triton:dequant+matmul(cached)"


@pytest.mark.parametrize("cap, want", [((9, 0), True), ((8, 9), True), ((8, 0), False)])
def test_cvt_configs_only_where_the_instruction_exists(monkeypatch, cap, want):
    from fp4dispatch.kernels import fused

    monkeypatch.setattr(fused, "_num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for m in (1, 3):
        cfgs = fused.configs_for(m, 8192, 8192, torch.device("cuda", 0))
        assert any(c.get("CVT") for c in cfgs) is want
        assert not cfgs[0].get("CVT")  # the untuned default never needs SM89
        assert len(cfgs) <= 7
    assert not any(c.get("CVT") for c in fused.configs_for(1, 8192, 8192, torch.device("cpu")))


@pytest.mark.parametrize("m, n, k, grown", [(16, 768, 6144, True), (128, 768, 6144, True), (16, 2048, 6144, True),
                                            (128, 2048, 6144, True), (16, 8192, 8192, False),
                                            (128, 8192, 8192, False), (128, 6144, 2048, False)])
def test_wmma_split_fills_the_gpu_on_small_shapes(monkeypatch, m, n, k, grown):
    from fp4dispatch.kernels import fused

    monkeypatch.setattr(fused, "_num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    every = [c for c in fused.configs_for(m, n, k, torch.device("cuda", 0)) if c["kernel"] == "wmma"]
    assert len(every) == len({json.dumps(c, sort_keys=True) for c in every})  # no duplicates
    assert [c.get("stream", False) for c in every].count(True) == (m > 16)  # stream-K: its split is unused
    cfgs = [c for c in every if not c.get("stream")]
    for bm, bn, bkb, warps, stages, split, *apre in fused._WMMA_TILES[min(b for b in fused._WMMA_TILES if m <= b)]:
        tiles = -(-n // bn) * -(-m // bm)
        steps = k // 16 // bkb
        if tiles * split < 132:  # under one wave: as many CTAs as the SMs hold, keeping >= 2 K steps per split
            want = min(max(split, fused._wmma_resident(bm, warps) * 132 // tiles), steps // 2)
        else:  # a full wave already: the tuned split stays
            want = min(split, steps // 2)
        got = [c["split"] for c in cfgs if (c["BM"], c["BN"], c["BKB"], c["warps"], c["stages"], c.get("APRE", False))
               == (bm, bn, bkb, warps, stages, apre[0] if apre else True)]
        assert want in got, (bm, bn, split, want, got)
    # the small shapes get a larger split than the table's on some tile; the large ones keep the table's splits
    tabled = {t[5] for t in fused._WMMA_TILES[min(b for b in fused._WMMA_TILES if m <= b)]}
    assert any(c["split"] not in tabled for c in cfgs) is grown


@pytest.mark.parametrize("cap, rank", [((9, 0), 2), ((8, 9), 1), ((12, 0), 1), ((8, 0), 0)])
def test_wmma_first_on_hopper_offered_from_sm89(monkeypatch, cap, rank):
    from fp4dispatch.kernels import fused

    monkeypatch.setattr(fused, "_gluon_ok", lambda device: False)  # the Gluon kernels: their own tests below
    monkeypatch.setattr(fused, "_num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for m in (3, 16, 17, 128, 4096):
        cfgs = fused.configs_for(m, 8192, 8192, torch.device("cuda", 0))
        kinds = [c["kernel"] for c in cfgs]
        assert ("wmma" in kinds) is (rank > 0) and len(cfgs) <= 7
        assert (kinds[0] == "wmma") is (rank == 2)
        assert ("mma" in kinds) is (rank < 2)  # SM90 drops the older bf16 tiles; elsewhere they stay
        if rank == 2 and m <= 16:  # the last M <= 16 tile decodes A in its loop (one launch for small shapes)
            assert not cfgs[len([k for k in kinds if k == "wmma"]) - 1].get("APRE")
        assert all(c["BKB"] % 4 == 0 and c["split"] >= 1 for c in cfgs if c["kernel"] == "wmma")
    # M <= 2 keeps the CUDA-core GEMV first everywhere
    assert fused.configs_for(1, 8192, 8192, torch.device("cuda", 0))[0]["kernel"] == "gemv2"


def _gluon_gpu(monkeypatch, cap: tuple) -> torch.device:
    """A CUDA device of capability ``cap`` with 132 SMs, compiled kernels and the Gluon the kernels need (no GPU)."""
    from fp4dispatch import kernels
    from fp4dispatch.kernels import fused

    monkeypatch.setattr(fused, "_num_sms", lambda device: 132)
    monkeypatch.setattr(fused, "_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kernels, "gluon_missing", lambda: None)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((10, 0), False), ((12, 0), False)])
def test_wgws_first_above_m128_on_sm90_only(monkeypatch, cap, offered):
    from fp4dispatch import kernels
    from fp4dispatch.kernels import fused

    cuda = _gluon_gpu(monkeypatch, cap)
    big, narrow, small = (256, 128, ""), (256, 64, ""), (128, 128, "")  # (BM, BN, variant)
    persist, swap, swap64 = (256, 128, "persist"), (256, 128, "swap"), (256, 64, "swap")
    for m, n, tiles in ((64, 8192, []), (128, 8192, []), (129, 8192, [small]),
                        (300, 8192, [persist, big, narrow, small]), (512, 8192, [persist, big, narrow, small]),
                        (513, 8192, [persist, big, narrow]), (8192, 8192, [persist, big, narrow]),
                        (4096, 2048, [swap, persist, big, narrow, swap64]),
                        (300, 256, [swap, persist, big, narrow, small, swap64])):
        cfgs = fused.configs_for(m, n, 8192, cuda)
        ws = [c for c in cfgs if c["kernel"] == "wgws"]
        got = [(c["BM"], c["BN"], "persist" if c.get("persist") else "swap" if c.get("swap") else "") for c in ws]
        assert got == (tiles if offered else []), (m, n, cfgs)
        assert cfgs[:len(ws)] == ws and len(cfgs) <= 7  # first: the untuned default above M = 128
        assert any(c["kernel"] == "wmma" for c in cfgs)  # the tuner still compares
        assert all(c["BKB"] % 4 == 0 for c in ws)
    # TMA needs 16-byte weight rows (K % 32 == 0); a Triton without the Gluon it is written for offers none
    assert not [c for c in fused.configs_for(1024, 8192, 8208, cuda) if c["kernel"] == "wgws"]
    monkeypatch.setattr(kernels, "gluon_missing", lambda: "no gluon here")
    assert not [c for c in fused.configs_for(1024, 8192, 8192, cuda) if c["kernel"] == "wgws"]
    monkeypatch.setattr(kernels, "gluon_missing", lambda: None)
    monkeypatch.setattr(fused, "_interpreted", lambda: True)
    assert not [c for c in fused.configs_for(1024, 8192, 8192, cuda) if c["kernel"] == "wgws"]


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((12, 0), False)])
def test_gvws_first_at_m_le_2_on_sm90_only(monkeypatch, cap, offered):
    from fp4dispatch.kernels import fused

    cuda = _gluon_gpu(monkeypatch, cap)
    for m in (1, 2):
        cfgs = fused.configs_for(m, 8192, 8192, cuda)
        gv = [c for c in cfgs if c["kernel"] == "gvws"]
        assert [(c["R"], c["BW"], c["stages"], c["ctas"]) for c in gv] == (list(fused._GVWS_TILES) if offered else [])
        assert cfgs[:len(gv)] == gv and all(c["MB"] == m for c in gv)  # first: the untuned default
        assert any(c["kernel"] == "gemv2" for c in cfgs) and len(cfgs) <= 7  # the tuner still compares
    assert not [c for c in fused.configs_for(3, 8192, 8192, cuda) if c["kernel"] == "gvws"]
    # its boxes need N % 32 == 0 (a box of a 32-row quarter) and K % 32 == 0 (16-byte rows)
    assert not [c for c in fused.configs_for(1, 8200, 8192, cuda) if c["kernel"] == "gvws"]
    assert not [c for c in fused.configs_for(1, 8192, 8208, cuda) if c["kernel"] == "gvws"]


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((12, 0), False)])
def test_wgds_offered_at_m_65_to_128_on_sm90_only(monkeypatch, cap, offered):
    from fp4dispatch.kernels import fused

    cuda = _gluon_gpu(monkeypatch, cap)
    for m in (64, 65, 100, 128, 129):
        cfgs = fused.configs_for(m, 8192, 8192, cuda)
        ds = [c for c in cfgs if c["kernel"] == "wgds"]
        want = [fused._WGDS, dict(fused._WGDS, persist=True)] if offered and 64 < m <= 128 else []
        assert ds == want, (m, cfgs)
        if want:  # after the first wmma tile, which stays the untuned default; the tuner compares them
            assert cfgs[0]["kernel"] == "wmma" and cfgs[1:3] == want and len(cfgs) <= 7
    # its boxes need N % 32 == 0 (rows taken the way the scales are stored) and K % 32 == 0 (16-byte rows)
    assert not [c for c in fused.configs_for(128, 8200, 8192, cuda) if c["kernel"] == "wgds"]
    assert not [c for c in fused.configs_for(128, 8192, 8208, cuda) if c["kernel"] == "wgds"]


def test_wgds_splits_k_where_its_tiles_leave_sms_idle(monkeypatch):
    """Fewer tiles than SMs (N <= 2048 at M = 128 on 132 SMs): a split-K wgds comes first among the wgds candidates,
    in the parts that minimize the busiest SM's K steps plus the partials' cost, one wave of them; else none."""
    from fp4dispatch.kernels import fused

    cuda = _gluon_gpu(monkeypatch, (9, 0))
    # (N, K) -> parts: 2048x6144 32 tiles of 48 steps -> 4 parts of 12 (at most 132 // 32); 768x6144 12 tiles -> 4
    # (12 + 18 against 5 + 36 for 10 parts); 6144x2048 96 tiles: a second wave of parts, none
    for (n, k), split in {(2048, 6144): 4, (768, 6144): 4, (6144, 2048): 1, (8192, 8192): 1, (28672, 8192): 1}.items():
        cfgs = fused.configs_for(128, n, k, cuda)
        want = ([dict(fused._WGDS, split=split)] if split > 1 else []) + [fused._WGDS, dict(fused._WGDS, persist=True)]
        assert [c for c in cfgs if c["kernel"] == "wgds"] == want, (n, k)
        assert cfgs[0]["kernel"] == "wmma" and cfgs[1:1 + len(want)] == want and len(cfgs) <= 7
    # (N tiles, tiles, K steps): 992 rows make 8 groups of 2 N tiles, M = 300 three M tiles, K = 2080 17 steps
    assert fused.wgds_work(300, 992, 130, 128, 64, 8) == (16, 48, 17)
    assert fused._wgds_split(12, 3, 132) == 1  # parts of >= 2 steps
    assert fused._wgds_split(12, 96, 132) == 6 and fused._wgds_split(132, 48, 132) == 1


def test_wgds_refuses_rings_that_deadlock_or_race_and_what_tma_cannot_describe():
    from fp4dispatch.kernels.fused import _WGDS
    from fp4dispatch.kernels.gluon_host import run_wgds as _wgds

    a, s = torch.zeros(128, 1024, dtype=torch.uint8), torch.zeros(128, 128, dtype=torch.uint8)
    b = torch.zeros(1024, 1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"wgds needs BN 64, parts 1 or 2, rings of >= max\(2, parts\) slots and "
                                         r"stages a multiple of parts; got BN=64, parts=2, \{'stages': 4, 'astages': 4, "
                                         r"'dstages': 1\}\. Use a config from configs_for\(\)"):
        _wgds(a, b, s, s, s, s, dict(_WGDS, dstages=1), {})
    with pytest.raises(ValueError, match=r"got BN=64, parts=2, \{'stages': 3, "):  # a weight slot per partition
        _wgds(a, b, s, s, s, s, dict(_WGDS, stages=3), {})
    with pytest.raises(ValueError, match=r"got BN=128, parts=2"):
        _wgds(a, b, s, s, s, s, dict(_WGDS, BN=128), {})
    with pytest.raises(ValueError, match=r"got BN=64, parts=3"):
        _wgds(a, b, s, s, s, s, dict(_WGDS, parts=3, dstages=3), {})
    with pytest.raises(ValueError, match=r"wgds needs N % 32 == 0, K % 32 == 0 and a 16-byte aligned b and b_scale; "
                                         r"got N=1000, K=2048, data_ptr\(\) % 16 of \(b, b_scale\) = \(0, 0\)"):
        _wgds(a, torch.zeros(1000, 1024, dtype=torch.uint8), s, s, s, s, _WGDS, {})
    with pytest.raises(ValueError, match=r"got N=1024, K=2064"):
        _wgds(torch.zeros(4, 8 * 129, dtype=torch.uint8), torch.zeros(1024, 8 * 129, dtype=torch.uint8), s, s, s, s,
              _WGDS, {})


def test_gvws_refuses_what_tma_cannot_describe():
    from fp4dispatch.kernels.gluon_host import run_gvws as _gvws

    cfg = {"kernel": "gvws", "MB": 1, "R": 16, "BW": 32, "stages": 5, "warps": 4, "ctas": 2}
    a, s = torch.zeros(1, 1024, dtype=torch.uint8), torch.zeros(128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"gvws needs M <= MB, N % 32 == 0, K % 32 == 0 and 16-byte aligned operands; "
                                         r"got M=1, MB=1, N=1000, K=2048"):
        _gvws(a, torch.zeros(1000, 1024, dtype=torch.uint8), s, s, s, s, cfg)
    with pytest.raises(ValueError, match=r"got M=2, MB=1, N=256, K=2048"):
        _gvws(torch.zeros(2, 1024, dtype=torch.uint8), torch.zeros(256, 1024, dtype=torch.uint8), s, s, s, s, cfg)


def test_gvws_descriptors_are_cached_and_hold_no_tensor():
    import gc
    import weakref

    from fp4dispatch.kernels import gluon_missing
    if gluon_missing():
        pytest.skip(gluon_missing())
    from fp4dispatch.kernels import _gvws

    a, sa = torch.zeros(1, 4096, dtype=torch.uint8), torch.zeros(128, 512, dtype=torch.uint8)
    b, sb = torch.zeros(8192, 4096, dtype=torch.uint8), torch.zeros(8192, 512, dtype=torch.uint8)
    first = _gvws.descriptors(a, b, sa, sb, 16, 32, 1)
    assert all(x is y for x, y in zip(first, _gvws.descriptors(a, b, sa, sb, 16, 32, 1)))  # a hit: no rebuilding
    assert [d.block_shape for d in first] == [[4, 16, 32], [1, 8, 64], [1, 32], [1, 8, 4]]
    assert first[0].shape == [256, 32, 512] and first[1].shape == [64, 128, 128] and first[1].strides == [16384, 128, 1]
    gone = weakref.ref(b)
    del b, first
    gc.collect()
    assert gone() is None  # the cache keeps an address, not the weight


@pytest.mark.parametrize("swap", [False, True])
def test_wgws_cached_descriptors_describe_what_from_tensor_did(monkeypatch, swap):
    """wgws's descriptors come from ``launch.tma_desc`` now: every field Triton's launcher reads (address, dtype,
    shape, strides, block, layout) equals what ``TensorDescriptor.from_tensor`` built from the tensors before."""
    from fp4dispatch.kernels import gluon_missing
    if gluon_missing():
        pytest.skip(gluon_missing())
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4dispatch.kernels import _gluon, gluon_host

    m, n, k = 300, 1024, 2048
    yd = torch.zeros(n if swap else m, k // 4, dtype=torch.float16)  # what predecode returns: [rows, K/64 * 64]
    monkeypatch.setattr(gluon_host, "predecode", lambda *args, **kw: yd)
    got = []
    monkeypatch.setattr(gluon_host, "launch", lambda fn, grid, *args, **kw: got.append(args[:2]))
    a, b = torch.zeros(m, k // 2, dtype=torch.uint8), torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.zeros(1, dtype=torch.uint8)
    gluon_host.run_wgws(a, b, s, s, s, s, {"BM": 256, "BN": 128, "BKB": 4, "stages": 5, "swap": swap}, {})
    xl, yl = _gluon.layouts(128, 256, 4)
    want = (TensorDescriptor.from_tensor((a if swap else b).view(torch.int64), [128, 4], xl),
            TensorDescriptor.from_tensor(yd, [256, 64], yl))
    for d, w in zip(got[0], want):
        assert (d.base.data_ptr(), d.base.dtype, list(d.shape), list(d.strides), list(d.block_shape), d.layout,
                d.padding) == (w.base.data_ptr(), w.base.dtype, list(w.shape), list(w.strides), list(w.block_shape),
                               w.layout, w.padding)


def test_gluon_kernels_wait_for_the_predecode_only_with_pdl(monkeypatch):
    """With PDL (``fused._pdl``'s options) the pre-decode before wgws and wgds triggers its dependents early (EARLY)
    and they launch with launch_pdl (only the partition that loads the pre-decoded operand waits; neither kernel has
    a PDL parameter); without, neither."""
    from fp4dispatch.kernels import gluon_missing
    if gluon_missing():
        pytest.skip(gluon_missing())
    from fp4dispatch.kernels import _wgds, fused, gluon_host
    from fp4dispatch.kernels.fused import _WGDS, gluon_pdl

    assert gluon_pdl({}) == ({}, {})
    assert gluon_pdl({"launch_pdl": True, "PDL": True}) == ({"launch_pdl": True, "PDL": True, "EARLY": True},
                                                            {"launch_pdl": True})
    m, n, k = 300, 1024, 2048
    pre, got = [], []
    monkeypatch.setattr(gluon_host, "predecode", lambda *args, **kw: pre.append(kw) or
                        torch.zeros(m, k // 4, dtype=torch.float16))
    monkeypatch.setattr(gluon_host, "launch", lambda fn, grid, *args, **kw: got.append(kw))
    a, b = torch.zeros(m, k // 2, dtype=torch.uint8), torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.zeros(1, dtype=torch.uint8)
    cfg = {"BM": 256, "BN": 128, "BKB": 4, "stages": 5}
    gluon_host.run_wgws(a, b, s, s, s, s, cfg, {"launch_pdl": True, "PDL": True})
    gluon_host.run_wgws(a, b, s, s, s, s, cfg, {})
    # wgds (_wgds.run takes predecode from fused): 128 x 768, K = 6144
    monkeypatch.setattr(fused, "predecode", lambda *args, **kw: pre.append(kw) or
                        torch.zeros(128, 6144 // 4, dtype=torch.float16))
    monkeypatch.setattr(_wgds, "launch", lambda fn, grid, *args, **kw: got.append(kw))
    a, b = torch.zeros(128, 3072, dtype=torch.uint8), torch.zeros(768, 3072, dtype=torch.uint8)
    sa, sb = torch.zeros(128 * 384, dtype=torch.uint8), torch.zeros(768 * 384, dtype=torch.uint8)
    for pdl in ({"launch_pdl": True, "PDL": True}, {}):
        _wgds.run(a, b, sa, sb, torch.ones(1), torch.empty(128, 768), _WGDS, 132, pdl)
    for i, on in ((0, True), (1, False), (2, True), (3, False)):
        assert bool(pre[i].get("EARLY")) == on and bool(pre[i].get("PDL")) == on, i
        assert bool(got[i].get("launch_pdl")) == on and "PDL" not in got[i], i


def test_gluon_missing_names_the_triton_it_needs(monkeypatch):
    import triton

    from fp4dispatch import kernels

    kernels.gluon_missing.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    try:
        assert kernels.gluon_missing() == ("the Gluon kernels (wgws, wgds, gvws) are written for Triton 3.6's Gluon; "
                                           "this is Triton 3.9.0")
    finally:
        kernels.gluon_missing.cache_clear()


def test_wgws_refuses_what_tma_cannot_describe():
    from fp4dispatch.kernels.gluon_host import run_wgws as _wgws

    a = torch.zeros(4, 8 * 129, dtype=torch.uint8)  # K = 2064: K/16 = 129 words per row, 1032-byte rows
    with pytest.raises(ValueError, match=r"wgws needs K % 32 == 0 and a 16-byte aligned b; got K=2064"):
        _wgws(a, torch.zeros(8, 8 * 129, dtype=torch.uint8), a, a, a, a, {"BM": 256, "BN": 128, "BKB": 4,
                                                                           "stages": 5}, {})
    # swapped, the activation's words are the ones TMA loads: its base must be aligned
    words = torch.zeros(4 * 1024 + 1, dtype=torch.uint8)[1:].view(4, 1024)  # K = 2048, base 1 byte off
    with pytest.raises(ValueError, match=r"wgws needs K % 32 == 0 and a 16-byte aligned a; got K=2048, "
                                         r"data_ptr\(\) % 16 = 1"):
        _wgws(words, torch.zeros(8, 1024, dtype=torch.uint8), a, a, a, a,
              {"BM": 256, "BN": 128, "BKB": 4, "stages": 5, "swap": True}, {})


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode) in Python: byte i of the result from nibble i of sel's low 16 bits."""
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        v = src[nib & 7]
        out |= ((0xFF if v & 0x80 else 0) if nib & 8 else v) << (8 * i)
    return out


def _i8(word: int) -> list[int]:
    return [int.from_bytes(word.to_bytes(4, "little")[i:i + 1], "little", signed=True) for i in range(4)]


def test_dp4_table_and_sign_split_give_twice_e2m1_for_every_code():
    """gvws's DP path (kernels/_dp4.py), its PTX steps replayed in Python: the two-register table holds 2*|e2m1| of
    codes 0..7; prmt of a word gives the positive codes' magnitudes (0 for the negative ones, since every table byte
    has its sign bit clear), prmt of the word with its sign bits flipped the negative ones'; A's signed bytes come
    from (p | 0x80) - n per byte without borrows. So dp4a sums are exactly 4 * w * a, for all 16 x 16 code pairs."""
    from fp4dispatch.format import E2M1_VALUES
    from fp4dispatch.kernels import _dp4

    t0, t1 = _dp4.TABLE
    for code in range(16):
        word = code * 0x11111111  # the code in all 8 nibbles
        pos, neg = _prmt(t0, t1, word & 0xFFFF), _prmt(t0, t1, (word ^ 0x88888888) & 0xFFFF)
        want = 2 * E2M1_VALUES[code]
        assert (pos & 0xFF, neg & 0xFF) == ((want, 0) if want >= 0 else (0, -want)), code
        signed = (((pos | 0x80808080) - neg) & 0xFFFFFFFF) ^ 0x80808080  # act_i8's bytewise p - n
        assert _i8(signed) == [want] * 4, code
    for a in range(16):
        for b in range(16):
            wa, wb = a * 0x1111, b * 0x1111
            sa = _i8((((_prmt(t0, t1, wa) | 0x80808080) - _prmt(t0, t1, wa ^ 0x8888)) & 0xFFFFFFFF) ^ 0x80808080)
            p, n = _prmt(t0, t1, wb), _prmt(t0, t1, wb ^ 0x8888)  # dp_block: dp4a(p, a) - dp4a(n, a)
            got = sum(x * y for x, y in zip(p.to_bytes(4, "little"), sa)) - sum(
                x * y for x, y in zip(n.to_bytes(4, "little"), sa))
            assert got == 16 * E2M1_VALUES[a] * E2M1_VALUES[b], (a, b)
