"""GPU tests of the Triton NVFP4 kernels: exactness vs a float64 reference of the dequantized inputs (fresh random
inputs per check, NaN-poisoned out, M in {1, 3, 127, 4096}, N and K off the block sizes), NaN-scale propagation,
and bit-identity of the Triton quantize kernel with the torch definition."""
from __future__ import annotations

import math

import pytest
import torch

from fp4dispatch.kernels import config as C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the Triton kernels are compiled for the device")

N, K = 1000, 2064  # off every tile size; K/16 = 129 blocks
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 4e-3}


def _ops(m: int, out_dtype: torch.dtype, seed: int):
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    return make_operands(Problem(m, N, K, out_dtype, torch.device("cuda")), seed=seed)


def _ref64(ops) -> torch.Tensor:
    from fp4dispatch.format import dequantize_nvfp4

    a = dequantize_nvfp4(ops.a, ops.a_scale).double()
    b = dequantize_nvfp4(ops.b, ops.b_scale).double()
    return (a @ b.t()) * ops.alpha.double()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    return math.inf if not bool(torch.isfinite(o).all()) else float((o - ref).norm() / ref.norm())


@pytest.mark.parametrize("m", [1, 3, 127, 4096])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_every_config_exact(m, out_dtype):
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import configs_for

    cfgs = configs_for(m, N, K, torch.device("cuda"))
    for i, cfg in enumerate(cfgs):
        ops = _ops(m, out_dtype, seed=1000 * m + i)  # fresh inputs per check; out is NaN-filled
        fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
        err = _rel(ops.out, _ref64(ops))
        assert err <= TOL[out_dtype], (cfg, err)


def _wgws_missing() -> str | None:
    from fp4dispatch.kernels import gluon_missing

    if torch.cuda.get_device_capability()[0] != 9:
        return f"wgws is SM90 only; this GPU is SM{''.join(map(str, torch.cuda.get_device_capability()))}"
    return gluon_missing()


@pytest.mark.parametrize("variant", [{}, {"persistent": True}, {"swap": True}, {"persistent": True, "swap": True}],
                         ids=["tiles", "persist", "swap", "persist-swap"])
@pytest.mark.parametrize("m", [1, 3, 127, 300, 4096])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_wgws_every_tile_exact(m, out_dtype, variant):
    """The Gluon kernel at every M (configs_for offers it from M = 129), K % 32 == 0 as its TMA needs, K/16 = 130
    blocks: half a scale group and a last step past K; N off the tile. Persistent (several tiles per CTA, the ring
    running on across them) and swapped operands (the weight decoded first) alike."""
    if _wgws_missing():
        pytest.skip(_wgws_missing())
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import WARP_SPECIALIZED_TILES
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    for i, (bm, bn, bkb, stages) in enumerate(WARP_SPECIALIZED_TILES):
        ops = make_operands(Problem(m, N, 2080, out_dtype, torch.device("cuda")), seed=77 * m + i)  # NaN-filled out
        if out_dtype == torch.float16:
            ops.alpha.mul_(1 / 64)  # random sums reach ~1e5: keep the true result inside fp16's range
        fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out,
               C.WgmmaWarpSpecializedConfig(bm, bn, bkb, stages, **variant))
        err = _rel(ops.out, _ref64(ops))
        assert err <= TOL[out_dtype], (bm, bn, err)


def test_wgws_repeats_through_direct_launch(monkeypatch):
    """The second call of a key launches the compiled Gluon kernel directly (its TMA descriptors are new objects each
    call); fresh operands each time, so a stale descriptor would show."""
    if _wgws_missing():
        pytest.skip(_wgws_missing())
    from fp4dispatch.kernels import runtime as L
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.gemm import wgmma_warp_specialized as _gluon
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    monkeypatch.setattr(L, "_COMPILED", {})
    cfg = C.WgmmaWarpSpecializedConfig(256, 128, 4, 5)
    for i in range(3):
        ops = make_operands(Problem(300, N, 2080, torch.bfloat16, torch.device("cuda")), seed=500 + i)
        fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
        assert _rel(ops.out, _ref64(ops)) <= TOL[torch.bfloat16], i
    assert L._fast and [key[0] for key in L._COMPILED].count(id(_gluon.wgws_kernel)) == 1


@pytest.mark.parametrize("variant", [{}, {"persistent": True}, {"decode_partitions": 1}, {"split_k": 6},
                                     {"split_k": 17, "persistent": True}],
                         ids=["tiles", "persist", "one-decoder", "split", "split-persist"])
@pytest.mark.parametrize("m", [1, 3, 127, 300])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_wgds_exact(m, out_dtype, variant):
    """The Gluon kernel with the decode in warps of its own (offered at 64 < M <= 128) at every M: K/16 = 130 blocks
    leave half a scale group and a last step past K; N = 992 a partial 128-row group, N = 32 three empty 32-row
    quarters (zero-filled boxes); M = 300 three tiles along M, and persistent CTAs run several tiles each. Split K:
    17 steps in 6 parts of 3 (the last of 2), or 17 of one step on persistent CTAs; the last part of a tile to finish
    sums them and leaves the tile's counter at zero for the next launch."""
    if _wgws_missing():
        pytest.skip(_wgws_missing())
    from dataclasses import replace

    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import DECODE_WARPS
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    for i, n in enumerate((992, 32)):
        ops = make_operands(Problem(m, n, 2080, out_dtype, torch.device("cuda")), seed=53 * m + i)  # NaN-filled out
        if out_dtype == torch.float16:
            ops.alpha.mul_(1 / 64)  # random sums reach ~1e5: keep the true result inside fp16's range
        fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, replace(DECODE_WARPS, **variant))
        err = _rel(ops.out, _ref64(ops))
        assert err <= TOL[out_dtype], (n, err)
    if "split_k" in variant:
        from fp4dispatch.kernels import workspace
        assert int(workspace._COUNTERS[workspace._key(torch.device("cuda"), None)].count_nonzero()) == 0


def test_wgds_nan_block_scale_propagates():
    """A NaN block scale (0x7F) of weight row 7 reaches exactly out's column 7, through the decode warps' tile."""
    if _wgws_missing():
        pytest.skip(_wgws_missing())
    from fp4dispatch.format import swizzle_scales, unswizzle_scales
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import DECODE_WARPS
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    n, k = 992, 2080
    ops = make_operands(Problem(100, n, k, torch.float32, torch.device("cuda")), seed=3)
    lin = unswizzle_scales(ops.b_scale, n, k // 16).clone()
    lin.view(torch.uint8)[7, 3] = 0x7F
    ops = ops._replace(b_scale=swizzle_scales(lin))
    fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, DECODE_WARPS)
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    keep[7] = False
    assert bool(torch.isnan(ops.out[:, 7]).all())
    assert _rel(ops.out[:, keep], _ref64(ops)[:, keep]) <= 1e-5


@pytest.mark.parametrize("dp", [True, False], ids=["dp4a", "f16x2"])
@pytest.mark.parametrize("mb", [1, 2])
@pytest.mark.parametrize("n, k", [(992, 2080), (4064, 1152), (32, 8192)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gvws_every_tile_exact(mb, n, k, out_dtype, dp):
    """The Gluon GEMV at M = 1..MB, every offered tile, with either product path (DP: int8 dot products, offered;
    else fp16 pairs). K/16 = 130 and 72 blocks leave a last step past K and half a scale group; N = 992 and 4064 a
    partial 128-row group, N = 32 three empty 32-row quarters (zero-filled boxes)."""
    if _wgws_missing():
        pytest.skip(_wgws_missing())
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import TMA_GEMV_TILES
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    for m in range(1, mb + 1):
        for i, (r, bw, stages, ctas) in enumerate(TMA_GEMV_TILES):
            ops = make_operands(Problem(m, n, k, out_dtype, torch.device("cuda")), seed=91 * m + i)  # NaN-filled
            if out_dtype == torch.float16:
                ops.alpha.mul_(1 / 64)  # random sums reach ~1e5: keep the true result inside fp16's range
            fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out,
                   C.TmaGemvConfig(mb, r, bw, stages, warps=4, ctas_per_sm=ctas, int8_dot=dp))
            err = _rel(ops.out, _ref64(ops))
            assert err <= TOL[out_dtype], (m, r, bw, err)


@pytest.mark.parametrize("m", [1, 127, 4096])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_dequant_backend_exact(m, out_dtype):
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.problem import Problem

    be = TritonDequantBackend()
    p = Problem(m, N, K, out_dtype, torch.device("cuda"))
    for i, cfg in enumerate(be.configs(p)):
        ops = _ops(m, out_dtype, seed=7 + i + m)
        if out_dtype == torch.float16:
            ops.alpha.mul_(1 / 64)  # random sums over K=2064 reach ~1e5: keep the true result inside fp16's range
        be.run(p, ops, cfg)
        assert _rel(ops.out, _ref64(ops)) <= TOL[out_dtype], cfg


def test_nan_block_scale_propagates():
    from fp4dispatch.format import swizzle_scales, unswizzle_scales
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import configs_for

    for m in (1, 37):
        ops = _ops(m, torch.float32, seed=m)
        lin = unswizzle_scales(ops.b_scale, N, K // 16).clone()
        lin.view(torch.uint8)[7, 3] = 0x7F
        ops = ops._replace(b_scale=swizzle_scales(lin))
        ref = _ref64(ops)
        for cfg in configs_for(m, N, K, torch.device("cuda")):
            fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
            assert bool(torch.isnan(ops.out[:, 7]).all()), cfg
            keep = torch.ones(N, dtype=torch.bool, device="cuda")
            keep[7] = False
            assert _rel(ops.out[:, keep], ref[:, keep]) <= 1e-5, cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("swizzled", [True, False], ids=["swizzled", "linear"])
def test_quantize_bit_identical(dtype, swizzled):
    from fp4dispatch.format import _quantize_torch, swizzle_scales
    from fp4dispatch.kernels import quantize as tq

    assert tq.available()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(300, 4112, device="cuda", generator=g) * 3).to(dtype)
    # exact e2m1 midpoints (ties) in row 0, values far above 448*6/gs (saturating scales) in row 1
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -5.0, -6.0], device="cuda").to(dtype)
    x[1, :16] = 1e4
    gs = torch.tensor([1.0], device="cuda")
    p0, s0 = _quantize_torch(x, gs)
    if swizzled:
        s0 = swizzle_scales(s0)
    p1, s1 = tq.quantize(x, gs, swizzled=swizzled)
    assert torch.equal(p0, p1)
    assert s1.dtype == torch.float8_e4m3fn and s1.shape == s0.shape
    assert torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))


def test_dequant_and_quantize_repeat_through_direct_launch(monkeypatch):
    """dequant.py and quantize.py launch through kernels/runtime.py: calls after the first reuse the compiled kernel
    (with other data each time, an 8-byte-aligned input and a folded factor), and every result stays exact."""
    from fp4dispatch.format import _quantize_torch, dequantize_nvfp4, swizzle_scales
    from fp4dispatch.kernels import runtime as L
    from fp4dispatch.kernels import quantize as tq
    from fp4dispatch.kernels._dequant import dequant_kernel
    from fp4dispatch.kernels._quantize import quant_kernel
    from fp4dispatch.kernels.dequant import dequantize_rows

    monkeypatch.setattr(L, "_COMPILED", {})  # earlier tests may have compiled these keys already
    g = torch.Generator(device="cuda").manual_seed(11)
    for i in range(3):
        ops = _ops(127, torch.bfloat16, seed=100 + i)
        b = ops.b
        if i == 1:  # same shape, address 8 mod 16: a compiled variant of its own
            b = torch.empty(ops.b.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(ops.b.shape)
            b.copy_(ops.b)
        want = dequantize_nvfp4(ops.b, ops.b_scale, dtype=torch.float32)
        for _ in range(2):
            got = dequantize_rows(b, ops.b_scale, torch.bfloat16)
            assert torch.equal(got.float(), want)
        f = torch.tensor([0.37], device="cuda")
        got = dequantize_rows(b, ops.b_scale, torch.bfloat16, factor=f)
        assert torch.equal(got, (want * f).to(torch.bfloat16))
        x = (torch.randn(300, 4112, device="cuda", generator=g) * 3).to(torch.bfloat16)
        gs = torch.tensor([0.5 + i], device="cuda")
        p0, s0 = _quantize_torch(x, gs)
        for _ in range(2):
            p1, s1 = tq.quantize(x, gs)
            assert torch.equal(p0, p1) and torch.equal(swizzle_scales(s0).view(torch.uint8), s1.view(torch.uint8))
    fns = [key[0] for key in L._COMPILED]
    # dequant: aligned and shifted, each with and without the factor; quantize: one key (same shape each time)
    assert fns.count(id(dequant_kernel)) == 4 and fns.count(id(quant_kernel)) == 1


def test_dispatcher_uses_a_triton_backend_on_hopper(tmp_path):
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.problem import Problem

    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("native FP4 tensor cores present: a native backend may win")
    d = Dispatcher(cache_dir=tmp_path)
    names = {r.name: r.status for r in d.report()}
    assert names["triton:fused"] == "ok" and names["triton:dequant+matmul"] == "ok"
    c = d.choose(Problem(1, 4096, 4096, torch.bfloat16, torch.device("cuda", torch.cuda.current_device())))
    assert c.backend.name.startswith("triton:")


@pytest.mark.parametrize("cfg", [
    C.WgmmaRegisterAConfig(16, 64, 16, 4, 4, 3, predecode_a=True),
    C.WgmmaRegisterAConfig(16, 64, 16, 4, 4, 3, pdl=False),
    C.CudaCoreGemvConfig(4, 16, 32, 3, 4, fp16x2=True),
    # stream-K: 16 tiles x 9 K steps over 7 CTAs, so tiles are cut between CTAs and summed by the last to arrive
    C.WgmmaRegisterAConfig(16, 64, 16, 1, 4, 3, predecode_a=True, stream_k=True, stream_ctas=7)],
    ids=["register-a-predecode", "register-a-nopdl", "cuda-core-gemv", "register-a-stream"])
def test_split_k_one_launch_deterministic_eager_and_in_graphs(cfg):
    """The last CTA of a tile sums the split-K partials in split order: every call gives the same bits, the counters
    are back at zero after each launch (also in graph replays), and a graph captured on a stream with no prepared
    counters (fresh ones, zeroed inside the graph) matches too."""
    from fp4dispatch.kernels import workspace
    from fp4dispatch.kernels.fp4_mm import fp4_mm

    m = 16 if isinstance(cfg, C.WgmmaRegisterAConfig) else 4
    ops = _ops(m, torch.float32, seed=5)
    run = lambda: fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)  # noqa: E731
    run()
    first = ops.out.clone()
    assert _rel(first, _ref64(ops)) <= 1e-5
    for _ in range(3):
        ops.out.fill_(float("nan"))
        run()
        assert torch.equal(ops.out, first)
    dev = torch.device("cuda", torch.cuda.current_device())
    assert int(workspace._COUNTERS[workspace._key(dev, None)].count_nonzero()) == 0
    for prepared in (True, False):
        s = torch.cuda.Stream()
        if prepared:
            workspace.prepare(dev, s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            run()
        assert (workspace._key(dev, s) in workspace._COUNTERS) is prepared  # unprepared: fresh counters, not kept
        for _ in range(2):
            ops.out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(ops.out, first)
        if prepared:
            assert int(workspace._COUNTERS[workspace._key(dev, s)].count_nonzero()) == 0


@pytest.mark.parametrize("kernel", ["CudaCoreGemvConfig", "WgmmaRegisterAConfig"])
def test_direct_launch_cache_follows_pointer_alignment(kernel):
    """Repeated calls launch the cached compiled kernel (kernels/runtime.py); an A whose address is only 8-byte
    aligned must get its own compiled variant, and going back to an aligned A must still be exact."""
    from fp4dispatch.kernels import runtime as L
    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.heuristics import configs_for

    m = 1 if kernel == "CudaCoreGemvConfig" else 16
    cfg = next(c for c in configs_for(m, N, K, torch.device("cuda")) if type(c).__name__ == kernel)
    ops = _ops(m, torch.float32, seed=77)
    shifted = torch.empty(ops.a.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(ops.a.shape)
    shifted.copy_(ops.a)
    assert shifted.data_ptr() % 16 == 8
    ref = _ref64(ops)
    before = len(L._COMPILED)
    for a in (ops.a, ops.a, shifted, shifted, ops.a):
        ops.out.fill_(float("nan"))
        fp4_mm(a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
        assert _rel(ops.out, ref) <= 1e-5
    assert len(L._COMPILED) > before  # the direct-launch path was taken (compiled kernels were kept)


@pytest.mark.parametrize("m", [1, 16, 128, 300])
def test_launch_plan_replays_every_config_exactly(m):
    """kernels/plan.py: the first call of a config at M records its launch plan; later calls on fresh operands (other
    addresses, NaN-poisoned out) replay it. Every replay must equal the reference and have the bits of the ordinary
    path on the same inputs, eagerly and captured in a CUDA graph (which gets its scratch from the graph's pool: an
    eager call that grows the kept scratch afterwards must not change the graph's result)."""
    from fp4dispatch.kernels import fp4_mm as F
    from fp4dispatch.kernels import workspace
    from fp4dispatch.kernels.heuristics import configs_for
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    n, k = 1024, 2048  # N % 32 == 0 and K % 32 == 0: the TMA families are offered too
    problem = Problem(m, n, k, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    unplanned = []
    for i, cfg in enumerate(configs_for(m, n, k, problem.device)):
        first = make_operands(problem, seed=31 * m + i)
        F.fp4_mm(*first, cfg)
        entry = F.PLANS.table[(id(cfg), first.a.shape, n, torch.bfloat16, problem.device.index)]
        if entry[1] is None:
            unplanned.append(cfg)
            continue
        for r in range(2):
            ops = make_operands(problem, seed=7000 + 31 * m + 2 * i + r)
            F.fp4_mm(*ops, cfg)  # the replay
            assert _rel(ops.out, _ref64(ops)) <= TOL[torch.bfloat16], (cfg, r)
            replayed = ops.out.clone()
            ops.out.fill_(float("nan"))
            F._run(*ops, cfg)  # the ordinary path
            assert torch.equal(ops.out.view(torch.int16), replayed.view(torch.int16)), cfg
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            F.fp4_mm(*ops, cfg)
        for purpose in ("predecode", "splitk"):  # grow the kept scratch and scribble over it
            workspace.scratch(purpose, (1 << 24,), torch.uint8, problem.device).fill_(255)
        ops.out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(ops.out.view(torch.int16), replayed.view(torch.int16)), cfg
    assert not unplanned, unplanned
