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


def _count_compiles(monkeypatch) -> list:
    """Each compiler run Humming starts from now on (a cubin found in its disk cache starts none)."""
    from humming.jit import compiler

    runs = []
    for cls in (compiler.NVRTCCompiler, compiler.NVCCCompiler):
        real = cls._compile.__func__

        def counted(c, *args, real=real, **kw):
            runs.append(c.__name__)
            return real(c, *args, **kw)
        monkeypatch.setattr(cls, "_compile", classmethod(counted))
    return runs


def test_a_shapes_other_buckets_compile_in_the_background_into_the_cubins_its_next_keys_load(tmp_path, monkeypatch):
    from fp4dispatch.backends import humming_compile
    from fp4dispatch.backends.humming import HummingBackend
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.dispatch.verify import check_output
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    dev = torch.device("cuda", torch.cuda.current_device())
    n, k = 1536, 2560  # a shape no other test compiles: its cubins are new to Humming's disk cache
    d = Dispatcher([HummingBackend()], cache_dir=tmp_path)
    before = len(humming_compile.started)

    def call(m):
        problem = Problem(m, n, k, torch.bfloat16, dev)
        ops = make_operands(problem, seed=m)
        out = d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha)
        assert check_output(out, reference_mm(problem, ops), problem) is None

    call(1)  # decided on its first call: the rest of the shape's table is handed to the background
    assert humming_compile.wait_idle(600)
    assert len(humming_compile.started) > before and humming_compile.failures == []
    runs = _count_compiles(monkeypatch)
    for m in (100, 700, 3000):  # buckets 128, 1024, 4096: new keys, whose first runs find their kernels compiled
        call(m)
    assert runs == []


def test_a_cuda_graph_captured_while_humming_compiles_in_the_background_is_sound(tmp_path):
    from fp4dispatch.backends import humming_compile
    from fp4dispatch.backends.humming import HummingBackend
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands

    dev = torch.device("cuda", torch.cuda.current_device())
    ops = make_operands(Problem(1, 1280, 2112, torch.bfloat16, dev), seed=3)  # a shape of its own: a cold compile
    Dispatcher([HummingBackend()], cache_dir=tmp_path).fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha)
    x, w = torch.randn(64, 512, device=dev), torch.randn(512, 256, device=dev)
    captures = overlapped = 0
    # captured in the default (global) mode: a CUDA call from another thread that is unsafe then fails the capture
    while humming_compile._jobs.unfinished_tasks and captures < 2000:
        g, y = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(g):
            y = x @ w
        overlapped += bool(humming_compile._jobs.unfinished_tasks)
        captures += 1
        y.zero_()
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, x @ w)
    assert humming_compile.wait_idle(600)
    assert overlapped > 0, "the background compile ended before a capture: nothing was checked"
    assert humming_compile.failures == []


@pytest.mark.parametrize("n, k", [(768, 6144), (2048, 1024)])
def test_the_direct_launch_gives_humming_forwards_bits_at_every_m_of_its_buckets(n, k):
    """``HummingBackend.run`` calls Humming's launcher op itself for a dense W4A16 layer: the same kernels as
    ``humming_forward`` (same tuning string), so the same bits, at M across several buckets and inside one."""
    from fp4dispatch.backends.humming import HummingBackend
    from fp4dispatch.problem import Operands, Problem
    from fp4dispatch.testing import make_nvfp4_inputs

    dev = torch.device("cuda", torch.cuda.current_device())
    backend = HummingBackend()
    if why := backend.unavailable(dev):
        pytest.skip(why)
    _, b, _, sb, alpha = (t.to(dev) for t in make_nvfp4_inputs(1, n, k, seed=3))
    for m in (1, 2, 5, 16, 17, 100, 128, 129, 300, 1000):
        problem = Problem(m, n, k, torch.bfloat16, dev, torch.bfloat16)
        a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        ops = Operands(a, b, torch.empty(0, dtype=torch.float8_e4m3fn, device=dev), sb, alpha,
                       torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev))
        backend.run(problem, ops, {})
        direct = ops.out.clone()
        backend.direct_launch = False
        ops.out.fill_(float("nan"))
        backend.run(problem, ops, {})
        backend.direct_launch = True
        assert torch.equal(direct.view(torch.int16), ops.out.view(torch.int16)), f"M={m}: the direct launch differs"
        assert torch.isfinite(direct).all(), f"M={m}: rows left unwritten"
