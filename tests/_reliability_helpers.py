"""Shared by the reliability tests: a dispatcher over fakes, the exact float64 result, a right-result check."""
from __future__ import annotations

import torch

from fp4dispatch import dequantize_nvfp4
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.problem import Problem
from fp4dispatch.testing import fake_do_bench, make_nvfp4_inputs

CPU = torch.device("cpu")
KEY = "m4-n48-k64-float32"


def disp(backends, tmp_path, **kw):
    return Dispatcher(backends, cache_dir=tmp_path / "c", do_bench=fake_do_bench, **kw)


def exact(a, b, sa, sb, alpha):
    return (dequantize_nvfp4(a, sa).double() @ dequantize_nvfp4(b, sb).double().T * float(alpha)).float()


def right(d, m, n=48, k=64, seed=0, alpha=None):
    """Whether ``d.fp4_mm`` returns the exact result (fp32 out) on fresh inputs of (m, n, k)."""
    a, b, sa, sb, al = make_nvfp4_inputs(m, n, k, seed=seed)
    al = al if alpha is None else torch.tensor([alpha], dtype=torch.float32)
    out = d.fp4_mm(a, b, sa, sb, al, out_dtype=torch.float32)
    ref = exact(a, b, sa, sb, al)
    return bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()), equal_nan=True))


def blacklist(d):
    return d.cache_for(CPU).shape_blacklist


def problem(m, n=48, k=64):
    return Problem(m, n, k, torch.float32, CPU)
