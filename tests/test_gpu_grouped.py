"""GPU: every backend that computes ``fp4_grouped_mm`` (or ``w4a16_grouped_mm``) passes the dispatcher's own check
on fresh hostile inputs (NaN-poisoned out inside guard rows, an expert without rows or all rows on one expert,
inputs unchanged) with every config it offers and returns the same bits twice; one CUDA graph captured once replays
any routing with the eager call's bits. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the grouped kernels are CUDA")

# (T, E, N, K): decode (fewer rows than experts), prefill (hundreds of rows per expert), ragged N and K
SHAPES = [(1, 8, 256, 512), (8, 256, 512, 1024), (100, 16, 768, 2048), (37, 6, 1000, 2064), (700, 4, 256, 512)]


def _grouped_backends(op: str = "grouped"):
    from fp4dispatch.backends import default_backends
    from fp4dispatch.backends.base import computes

    return [b for b in default_backends() if computes(b, op) and b.name not in ("reference", "loop:fp4_mm")]


@pytest.mark.parametrize("t, e, n, k", SHAPES)
@pytest.mark.parametrize("seed", [0, 3], ids=["empty-expert", "one-expert"])
@pytest.mark.parametrize("adt", [torch.uint8, torch.bfloat16, torch.float16], ids=["fp4", "w4a16-bf16", "w4a16-fp16"])
def test_every_grouped_backend_and_config_passes_the_hostile_check_twice_with_the_same_bits(t, e, n, k, seed, adt):
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.verify import check_run, make_case
    from fp4dispatch.problem import Problem

    dev = torch.device("cuda", torch.cuda.current_device())
    for odt in (adt if adt is not torch.uint8 else torch.bfloat16, torch.float32):
        problem = Problem(t, n, k, odt, dev, adt, e)
        case = make_case(problem, seed, reference_mm)
        for backend in _grouped_backends(problem.op):
            if backend.unavailable(dev) or backend.unsupported(problem):
                continue
            for cfg in backend.configs(problem):
                assert check_run(backend, case, cfg) is None, (backend.name, cfg)
                first = case.ops.out.clone()
                assert check_run(backend, case, cfg) is None, (backend.name, cfg)
                assert torch.equal(first.view(torch.uint8), case.ops.out.view(torch.uint8)), (backend.name, cfg)


def test_one_captured_graph_replays_every_routing_with_the_eager_bits(tmp_path, monkeypatch):
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.format_grouped import grouped_scale_rows, swizzle_grouped_scales
    from fp4dispatch.routing import offs_from_counts, topk_counts

    e, n, k, tokens, top_k = 32, 512, 1024, 12, 4
    t = tokens * top_k
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "loop:fp4_mm")  # it cannot be captured; tuning it tunes dense keys
    d = Dispatcher(cache_dir=tmp_path / "c")
    g = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    sb = torch.randint(0x30, 0x48, (e, 128 * -(-n // 128), k // 16), dtype=torch.uint8, device="cuda", generator=g)
    alpha = torch.rand(e, device="cuda", generator=g)
    routings = []
    for seed in range(3):
        offs = offs_from_counts(topk_counts(tokens, e, top_k, seed=seed, device="cuda"))
        a = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        lin = torch.randint(0x30, 0x48, (t, k // 16), dtype=torch.uint8, device="cuda", generator=g)
        sa = swizzle_grouped_scales(lin, offs, grouped_scale_rows(t, e))
        routings.append((a, sa.view(torch.float8_e4m3fn), offs))
    sbv = sb.view(torch.float8_e4m3fn)
    eager = [d.fp4_grouped_mm(a, b, sa, sbv, alpha, offs) for a, sa, offs in routings]  # decides and proves
    _assert_replays_match(lambda a, sa, offs, out: d.fp4_grouped_mm(a, b, sa, sbv, alpha, offs, out=out), routings,
                          eager)


def _assert_replays_match(call, routings, eager) -> None:
    """``call(a, a_scale, offs, out)`` captured once in a CUDA graph (warmed on a side stream first) on copies of the
    first routing; replayed with each routing copied in, out NaN-poisoned, it must give that routing's ``eager``
    bits."""
    a_in, sa_in, offs_in = (x.clone() for x in routings[0])
    out = torch.empty_like(eager[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(a_in, sa_in, offs_in, out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(a_in, sa_in, offs_in, out)
    for (a, sa, offs), want in zip(routings, eager):
        a_in.copy_(a)
        sa_in.copy_(sa)
        offs_in.copy_(offs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


# (T, E, N, K, rows of each expert or None for a top-k routing): experts of 1-7 rows (several passes of 2 rows), more
# experts than one pass of the expert search reads (E = 300: the producer warp reads 32 at a time, the consumers 128),
# all rows on one expert, one expert, one row, a routing whose last experts own nothing, experts with rows in every
# quarter of a 128-row scale group (their scales' box holds all four) and past it
_TMA_ROUTINGS = [(96, 300, 256, 512, None), (60, 16, 384, 1024, [0, 1, 2, 3, 4, 5, 6, 7, 0, 7, 6, 5, 4, 3, 2, 1]),
                 (9, 8, 256, 2048, [0, 0, 0, 9, 0, 0, 0, 0]), (5, 1, 512, 512, [5]), (1, 64, 128, 512, None),
                 (33, 40, 256, 512, [3] * 11 + [0] * 29), (128, 8, 256, 512, [20, 1, 0, 33, 5, 2, 64, 3]),
                 (231, 3, 256, 1024, [130, 1, 100])]


def _tma_weights(e: int, n: int, k: int, g: torch.Generator) -> tuple:
    """Random expert weights [E, N, K/2] and their swizzled scales (uint8, as the launcher takes them)."""
    from fp4dispatch.format_grouped import swizzle_expert_scales

    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    sb = swizzle_expert_scales(torch.randint(0x28, 0x48, (e, n, k // 16), dtype=torch.uint8, device="cuda",
                                             generator=g).view(torch.float8_e4m3fn)).view(torch.uint8)
    return b, sb


def _tma_tokens(offs: torch.Tensor, e: int, k: int, g: torch.Generator) -> tuple:
    """Random routed tokens [T, K/2] for ``offs`` and their grouped swizzled scales (uint8)."""
    from fp4dispatch.format_grouped import grouped_scale_rows, swizzle_grouped_scales

    t = int(offs[-1])
    a = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    lin = torch.randint(0x28, 0x48, (t, k // 16), dtype=torch.uint8, device="cuda", generator=g)
    return a, swizzle_grouped_scales(lin.view(torch.float8_e4m3fn), offs, grouped_scale_rows(t, e)).view(torch.uint8)


@pytest.mark.parametrize("t, e, n, k, rows", _TMA_ROUTINGS)
def test_tma_gemv_grouped_every_config_exact_on_uneven_routings(t, e, n, k, rows):
    """The TMA-fed grouped GEMV (SM90 with Gluon) against the exact result with every config it can take, fp32 and
    bf16 out poisoned with NaN (nothing written past T), per-expert and one alpha, the same bits twice."""
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.kernels import target
    from fp4dispatch.kernels.config_grouped import TmaGemvGroupedConfig
    from fp4dispatch.kernels.heuristics import TMA_GEMV_TILES
    from fp4dispatch.problem import GroupedOperands, Problem
    from fp4dispatch.routing import offs_from_counts, topk_counts

    dev = torch.device("cuda", torch.cuda.current_device())
    if not target.gluon_ok(dev):
        pytest.skip("the TMA-fed grouped GEMV needs SM90 and Triton's Gluon")
    run = __import__("fp4dispatch.kernels.gemv.tma_warp_specialized_grouped", fromlist=["run"]).run
    g = torch.Generator(device="cuda").manual_seed(t + e)
    counts = (torch.tensor(rows, device="cuda") if rows else topk_counts(t // 8 or 1, e, min(8, t), seed=1,
                                                                          device="cuda"))
    offs = offs_from_counts(counts)
    t = int(offs[-1])
    a, sa = _tma_tokens(offs, e, k, g)
    b, sb = _tma_weights(e, n, k, g)
    cfgs = [TmaGemvGroupedConfig(mb, r, bw, st, warps=4, ctas_per_sm=c, int8_dot=True) for r, bw, st, c in
            TMA_GEMV_TILES for mb in (1, 2)]
    for alpha in (torch.rand(e, device="cuda", generator=g) - 0.5, torch.full((1,), -0.75, device="cuda")):
        ops = GroupedOperands(a, b, sa.view(torch.float8_e4m3fn), sb.view(torch.float8_e4m3fn), alpha, None, offs)
        want = reference_mm(Problem(t, n, k, torch.float32, dev, torch.uint8, e), ops)
        for odt in (torch.float32, torch.bfloat16):
            for cfg in cfgs:
                out = torch.full((t + 3, n), float("nan"), dtype=odt, device="cuda")
                run(a, b, sa, sb, alpha, out[:t], offs, cfg)
                got = out[:t].float()
                assert torch.isnan(out[t:]).all(), cfg  # nothing written past T
                err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                assert torch.isfinite(got).all() and err < (1e-5 if odt == torch.float32 else 4e-3), (cfg, odt, err)
                again = torch.full_like(out, float("nan"))
                run(a, b, sa, sb, alpha, again[:t], offs, cfg)
                assert torch.equal(again[:t].view(torch.uint8 if odt == torch.float32 else torch.int16),
                                   out[:t].view(torch.uint8 if odt == torch.float32 else torch.int16)), cfg


def test_tma_gemv_grouped_one_graph_replays_every_routing_with_the_eager_bits():
    """Captured once, the TMA-fed grouped GEMV gives every routing (top-k ones, all rows on one expert past its first
    32) the eager call's bits: it counts its items from offs on the GPU."""
    from fp4dispatch.kernels import target
    from fp4dispatch.kernels.config_grouped import TmaGemvGroupedConfig
    from fp4dispatch.kernels.heuristics import TMA_GEMV_TILES
    from fp4dispatch.routing import offs_from_counts, topk_counts

    if not target.gluon_ok(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("the TMA-fed grouped GEMV needs SM90 and Triton's Gluon")
    run = __import__("fp4dispatch.kernels.gemv.tma_warp_specialized_grouped", fromlist=["run"]).run
    e, n, k, t = 64, 256, 1024, 48
    g = torch.Generator(device="cuda").manual_seed(5)
    b, sb = _tma_weights(e, n, k, g)
    alpha = torch.rand(e, device="cuda", generator=g)
    counts = [topk_counts(12, e, 4, seed=s, device="cuda") for s in range(3)]
    counts.append(torch.nn.functional.pad(torch.tensor([t], device="cuda"), (5, e - 6)))
    routings = []
    for c in counts:
        offs = offs_from_counts(c)
        routings.append((*_tma_tokens(offs, e, k, g), offs))
    (r, bw, st, c), (r2, bw2, st2, c2) = TMA_GEMV_TILES
    for cfg in (TmaGemvGroupedConfig(2, r, bw, st, warps=4, ctas_per_sm=c, int8_dot=True),
                TmaGemvGroupedConfig(1, r2, bw2, st2, warps=4, ctas_per_sm=c2, int8_dot=True)):
        eager = []
        for a, sa, offs in routings:
            eager.append(torch.empty(t, n, dtype=torch.bfloat16, device="cuda"))
            run(a, b, sa, sb, alpha, eager[-1], offs, cfg)
        _assert_replays_match(lambda a, sa, offs, out, c=cfg: run(a, b, sa, sb, alpha, out, offs, c), routings, eager)
