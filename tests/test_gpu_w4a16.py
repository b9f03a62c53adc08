"""GPU: every backend that computes ``w4a16_mm`` passes the dispatcher's own check on fresh hostile inputs (bf16 and
fp16 activations, NaN-poisoned out inside guard rows, inputs unchanged) for every config it offers, returns the same
bits twice, and replays the same bits from a CUDA graph. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the W4A16 kernels are CUDA")

SHAPES = [(m, n, k) for m in (1, 3, 8, 16, 100, 300) for n, k in ((256, 512), (768, 6144), (1000, 2064))]


def _w4a16_backends():
    from fp4dispatch.backends import default_backends
    from fp4dispatch.backends.base import computes

    return [b for b in default_backends() if computes(b, "w4a16") and b.name != "reference"]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("adt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_w4a16_backend_and_config_passes_the_hostile_check_twice_with_the_same_bits(m, n, k, adt):
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.verify import check_run, make_case
    from fp4dispatch.problem import Problem

    dev = torch.device("cuda", torch.cuda.current_device())
    for odt in (adt, torch.float32):
        problem = Problem(m, n, k, odt, dev, adt)
        case = make_case(problem, 7 * m + n, reference_mm)
        for backend in _w4a16_backends():
            if backend.unavailable(dev) or backend.unsupported(problem):
                continue
            for cfg in backend.configs(problem):
                assert check_run(backend, case, cfg) is None, (backend.name, cfg)
                first = case.ops.out.clone()
                assert check_run(backend, case, cfg) is None, (backend.name, cfg)
                assert torch.equal(first.view(torch.uint8), case.ops.out.view(torch.uint8)), (backend.name, cfg)


@pytest.mark.parametrize("m", [1, 16, 128])
def test_w4a16_mm_in_a_cuda_graph_replays_the_eager_bits(m, tmp_path):
    import fp4dispatch
    from fp4dispatch.dispatch.dispatcher import Dispatcher

    d = Dispatcher(cache_dir=tmp_path / "c")
    x = torch.randn(m, 2048, dtype=torch.bfloat16, device="cuda")
    wq, ws, wg = fp4dispatch.quantize_nvfp4(torch.randn(1024, 2048, dtype=torch.bfloat16, device="cuda"))
    alpha = (1.0 / wg).float().reshape(1)
    eager = d.w4a16_mm(x, wq, ws, alpha)  # decides and proves the key at this M
    out = torch.full_like(eager, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        d.w4a16_mm(x, wq, ws, alpha, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        d.w4a16_mm(x, wq, ws, alpha, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("m", [1, 16, 128])
def test_w4a16_launch_plans_replay_every_config_with_the_bits_of_the_ordinary_path(m):
    """kernels/plan.py through w4a16_mm: the first call of a config at M records its plan; replays on fresh operands
    (other addresses, NaN-poisoned out) give the ordinary path's bits, eagerly and from a CUDA graph; every triton
    config gets a plan."""
    import fp4dispatch
    from fp4dispatch.kernels import w4a16_mm as W
    from fp4dispatch.kernels.heuristics import w4a16_configs_for

    n, k = 1024, 2048
    dev = torch.device("cuda", torch.cuda.current_device())
    wq, ws, wg = fp4dispatch.quantize_nvfp4(torch.randn(n, k, dtype=torch.bfloat16, device=dev))
    alpha = (1.0 / wg).float().reshape(1)
    unplanned = []
    for i, cfg in enumerate(w4a16_configs_for(m, n, k, dev)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        first = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        W.w4a16_mm(x, wq, ws, alpha, first, cfg)
        if W.PLANS.table[(id(cfg), x.shape, x.dtype, n, torch.bfloat16, dev.index)][1] is None:
            unplanned.append(cfg)
            continue
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        W.w4a16_mm(x, wq.clone(), ws.clone(), alpha.clone(), out, cfg)  # the replay, on other addresses
        replayed = out.clone()
        out.fill_(float("nan"))
        W._run(x, wq, ws, alpha, out, cfg)  # the ordinary path
        assert torch.equal(out.view(torch.int16), replayed.view(torch.int16)), cfg
        assert not out.isnan().any(), cfg
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            W.w4a16_mm(x, wq, ws, alpha, out, cfg)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), replayed.view(torch.int16)), cfg
    assert not unplanned, unplanned


@pytest.mark.parametrize("m", [129, 300, 4096])
@pytest.mark.parametrize("adt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_w4a16_warp_specialized_every_tile_passes_the_hostile_check(m, adt):
    """The Gluon warp-specialized GEMM with 16-bit activations (offered from M = 129) at every tile, plain and
    persistent: K = 2080 (130 blocks: half a scale group and a last step past K, as its TMA needs K % 32 == 0),
    N = 1000 off every tile; bf16/fp16 activations, their dtype and fp32 out."""
    from dataclasses import replace

    from fp4dispatch.backends import default_backends
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.verify import check_run, make_case
    from fp4dispatch.kernels import gluon_missing
    from fp4dispatch.kernels.config import WgmmaWarpSpecializedW4A16Config
    from fp4dispatch.kernels.heuristics import WARP_SPECIALIZED_TILES
    from fp4dispatch.problem import Problem

    if torch.cuda.get_device_capability()[0] != 9 or gluon_missing():
        pytest.skip(gluon_missing() or "the warp-specialized Gluon GEMM is SM90 only")
    backend = next(b for b in default_backends() if b.name == "triton:w4a16")
    dev = torch.device("cuda", torch.cuda.current_device())
    for odt in (adt, torch.float32):
        case = make_case(Problem(m, 1000, 2080, odt, dev, adt), 11 * m + 1, reference_mm)
        for tile in WARP_SPECIALIZED_TILES:
            cfg = WgmmaWarpSpecializedW4A16Config(*tile)
            for c in (cfg, replace(cfg, persistent=True)):
                assert check_run(backend, case, c) is None, (odt, c)


@pytest.mark.parametrize("m", [1, 2, 8, 9, 16])
@pytest.mark.parametrize("adt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_w4a16_tma_mma_every_tile_passes_the_hostile_check(m, adt):
    """The Gluon mma.sync GEMV (offered at M <= 16) at every tile its heuristics offer for M: K = 2080 (130 blocks: a
    last step and a last 8-block chunk past K, zero-filled by its TMA; boxes of whole token rows) and K = 2112 (132
    blocks, the same with swizzled token lines: ``swizzled_tokens``), N = 1056 (a last 128-row group of one 32-row
    quarter); bf16/fp16 activations, their dtype and fp32 out; the same bits twice."""
    from fp4dispatch.backends import default_backends
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.verify import check_run, make_case
    from fp4dispatch.kernels import gluon_missing
    from fp4dispatch.kernels.heuristics import tma_mma_w4a16
    from fp4dispatch.problem import Problem

    if torch.cuda.get_device_capability()[0] != 9 or gluon_missing():
        pytest.skip(gluon_missing() or "the mma.sync Gluon GEMV is SM90 only")
    backend = next(b for b in default_backends() if b.name == "triton:w4a16")
    dev = torch.device("cuda", torch.cuda.current_device())
    for odt, k in ((adt, 2080), (torch.float32, 2080), (adt, 2112), (torch.float32, 2112)):
        case = make_case(Problem(m, 1056, k, odt, dev, adt), 13 * m + k, reference_mm)
        for cfg in tma_mma_w4a16(m):
            assert check_run(backend, case, cfg) is None, (odt, k, cfg)
            first = case.ops.out.clone()
            assert check_run(backend, case, cfg) is None, (odt, k, cfg)
            assert torch.equal(first.view(torch.uint8), case.ops.out.view(torch.uint8)), (odt, k, cfg)
