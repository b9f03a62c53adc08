"""GPU: ``humming:w4a16`` with the real Humming library passes the dispatcher's own check (hostile inputs, NaN-poisoned
out inside a guarded buffer, inputs unchanged), gives the same bits twice eagerly and when replayed in a CUDA graph,
and equals ``triton:fused`` where both run (the same exact products, fp32 sums). Skipped without a GPU or Humming."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: Humming compiles CUDA kernels"),
    pytest.mark.skipif(importlib.util.find_spec("humming") is None,
                       reason="needs humming-kernels (pip install fp4dispatch[humming])"),
]

SHAPES = [(m, n, k) for m in (1, 3, 16, 128, 300) for n, k in ((256, 512), (768, 6144))]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_humming_passes_the_hostile_check_and_repeats_its_bits(m, n, k, out_dtype):
    from fp4dispatch.backends.humming import HummingBackend
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.verify import check_run, make_case
    from fp4dispatch.problem import Problem

    backend = HummingBackend()
    problem = Problem(m, n, k, out_dtype, torch.device("cuda", torch.cuda.current_device()))
    why = backend.unavailable(problem.device) or backend.unsupported(problem)
    if why:
        pytest.skip(why)
    case = make_case(problem, 13 * m + n, reference_mm)
    for cfg in backend.configs(problem):
        assert check_run(backend, case, cfg) is None
        first = case.ops.out.clone()
        assert check_run(backend, case, cfg) is None
        assert torch.equal(first.view(torch.int16), case.ops.out.view(torch.int16)), "two calls, different bits"


@pytest.mark.parametrize("m", [1, 128])
def test_humming_in_a_cuda_graph_and_against_triton_fused(m):
    from fp4dispatch.backends.humming import HummingBackend
    from fp4dispatch.backends.triton_fused import TritonFusedBackend
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    problem = Problem(m, 1024, 2048, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    humming, fused = HummingBackend(), TritonFusedBackend()
    if humming.unavailable(problem.device):
        pytest.skip(humming.unavailable(problem.device))
    ops = make_operands(problem, seed=m)
    humming.run(problem, ops, {})  # compiles, prepares the weight
    eager = ops.out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        humming.run(problem, ops, {})
    ops.out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(ops.out.view(torch.int16), eager.view(torch.int16))
    other = ops._replace(out=torch.full_like(ops.out, float("nan")))
    for cfg in fused.configs(problem):
        fused.run(problem, other, cfg)
        # both sum exact products in fp32; the order of the sums may differ: at most a rounding apart
        torch.testing.assert_close(other.out.float(), eager.float(), rtol=8e-3, atol=1e-3 * float(eager.abs().max()))
