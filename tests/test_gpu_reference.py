"""GPU: the CUDA reference and quantizer agree with the CPU definitions (fresh random inputs, poisoned outputs)."""
from __future__ import annotations

import pytest
import torch

import fp4dispatch
from fp4dispatch import dequantize_nvfp4, quantize_nvfp4
from fp4dispatch.format import _quantize_torch, swizzle_scales
from fp4dispatch.testing import make_nvfp4_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compares CUDA with CPU")


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (3, 100, 4096), (127, 40, 16), (300, 96, 1024)])
@pytest.mark.parametrize("out_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_reference_matches_float64(m, n, k, out_dtype, tol):
    a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k, seed=m * 31 + k)
    ref = (dequantize_nvfp4(a, sa).double() @ dequantize_nvfp4(b, sb).double().T) * float(alpha)
    dev = "cuda"
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev)
    fp4dispatch.fp4_mm(*(t.to(dev) for t in (a, b, sa, sb, alpha)), out_dtype=out_dtype, out=out,
                       backend="reference")
    rel = float((out.cpu().double() - ref).norm() / ref.norm())
    assert rel <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_quantize_bit_identical_to_torch_definition(dtype):
    torch.manual_seed(0)
    x = (torch.randn(300, 1024) * torch.logspace(-4, 4, 300).unsqueeze(1)).to(dtype)
    x[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # e2m1 ties with gs = 1
    gs = torch.tensor([448 * 6 / float(x.float().abs().max())])
    p_cpu, s_cpu = _quantize_torch(x, gs)
    p_gpu, s_gpu, _ = quantize_nvfp4(x.cuda(), gs.cuda())
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(s_gpu.cpu().view(torch.uint8), swizzle_scales(s_cpu).view(torch.uint8))
