"""Drop-in on a GPU: CUDA-graph capture of fp4_mm after warm-up, torch.compile (Inductor), Fp4Linear, guard mode."""
from __future__ import annotations

import logging

import pytest
import torch

import fp4dispatch
from fp4dispatch import graphs
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.guard import Finding, check
from fp4dispatch.nn import Fp4Linear
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs
from fp4dispatch.dispatch.verify import check_output

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: CUDA graph capture/replay and GPU kernels")

# three different (M, N, K), in different M buckets, with N and K off the usual block sizes where allowed
SHAPES = [(3, 512, 1024), (64, 1024, 512), (300, 768, 2048)]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def _fill(dst: tuple, src: tuple) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def test_cuda_graph_of_three_fp4_mm_calls_equals_eager(caplog):
    picked = graphs.warmup(SHAPES, out_dtype=torch.bfloat16)
    print("warmed up:", picked)
    dev = torch.device("cuda")
    inputs = [make_nvfp4_inputs(m, n, k, device=dev, seed=i) for i, (m, n, k) in enumerate(SHAPES)]
    outs = [torch.empty((m, n), dtype=torch.bfloat16, device=dev) for m, n, _ in SHAPES]
    g = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.INFO, logger="fp4dispatch"), torch.cuda.graph(g):
        for inp, out in zip(inputs, outs):
            fp4dispatch.fp4_mm(*inp, out=out)
    assert caplog.text == ""  # decided keys: nothing probed, tuned or fell back during capture
    for seed in (10, 20):  # new data in the captured buffers, replay, compare with eager calls on that data
        for i, ((m, n, k), inp) in enumerate(zip(SHAPES, inputs)):
            _fill(inp, make_nvfp4_inputs(m, n, k, device=dev, seed=seed + i))
        g.replay()
        torch.cuda.synchronize()
        for (m, n, k), inp, out in zip(SHAPES, inputs, outs):
            eager = fp4dispatch.fp4_mm(*inp)
            # same backend and config as the eager call (cuBLAS, where picked, may choose another algorithm in a graph)
            assert _rel(out, eager) < 1e-3, (m, n, k)
            ref = reference_mm(Problem(m, n, k, torch.bfloat16, dev), Operands(*inp, out))
            assert check_output(out, ref, Problem(m, n, k, torch.bfloat16, dev)) is None


def test_torch_compile_inductor_fullgraph_on_gpu():
    m, n, k = SHAPES[1]
    args = make_nvfp4_inputs(m, n, k, device="cuda", seed=3)

    def f(a, b, sa, sb, alpha):
        return torch.relu(fp4dispatch.fp4_mm(a, b, sa, sb, alpha)) * 2

    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True)(*args)
    assert _rel(compiled, eager) < 1e-3


def test_fp4linear_on_gpu_matches_cpu_and_replays_in_a_graph():
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 768)
    x = torch.randn(4, 8, 1024)
    cpu_y = Fp4Linear.from_linear(lin, input_scale=float(x.abs().amax()) / 2688)(x)
    q = Fp4Linear.from_linear(lin.cuda(), input_scale=float(x.abs().amax()) / 2688)
    xs = x.cuda()
    y = q(xs)
    assert _rel(y.cpu(), cpu_y) < 1e-3  # the quantizer on CUDA (Triton when present) is bit-identical to CPU
    graphs.warmup([(32, 768, 1024)], out_dtype=torch.float32)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gy = q(xs)
    xs.copy_(torch.randn(4, 8, 1024).cuda())
    g.replay()
    torch.cuda.synchronize()
    assert _rel(gy, q(xs)) < 1e-3


def test_guard_flags_set_by_graph_replays(tmp_path):
    bad = FakeBackend("bad", cost=1e-6, nan_rows_for_m=(5,))
    d = Dispatcher([bad, FakeBackend("good", cost=1e-5)], cache_dir=tmp_path, do_bench=fake_do_bench, guard=True)
    graphs.warmup([(6, 256, 512)], out_dtype=torch.float32, dispatcher=d)  # bucket 8 -> "bad", flag created
    inp = make_nvfp4_inputs(5, 256, 512, device="cuda")
    out = torch.empty((5, 256), dtype=torch.float32, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        d.fp4_mm(*inp, out=out, out_dtype=torch.float32)  # "bad" at M=5: NaN rows
    g.replay()
    torch.cuda.synchronize()
    assert bool(torch.isnan(out).any())
    assert check(d) == [Finding("m8-n256-k512-float32", "bad", "good")]
    y = d.fp4_mm(*inp, out_dtype=torch.float32)
    assert bool(torch.isfinite(y).all())
