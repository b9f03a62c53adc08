"""GPU check of the foundation: the CUDA reference agrees with the CPU reference, and its time at M = 1 and
M = 4096 (N = K = 8192), next to cuBLAS bf16 on pre-dequantized weights in the same run.

    python benchmarks/h200_foundation.py
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import make_nvfp4_inputs


def main() -> None:
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("1) CUDA reference vs CPU reference (fp32 out), fresh random inputs")
    for m, n, k in [(1, 256, 512), (3, 100, 4096), (127, 96, 16), (300, 512, 1024)]:
        a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k, seed=m + n + k)
        p_cpu = Problem(m, n, k, torch.float32, torch.device("cpu"))
        ref_cpu = reference_mm(p_cpu, Operands(a, b, sa, sb, alpha, None))
        p_gpu = Problem(m, n, k, torch.float32, dev)
        ref_gpu = reference_mm(p_gpu, Operands(*(t.to(dev) for t in (a, b, sa, sb, alpha)), None)).cpu()
        rel = float((ref_gpu.double() - ref_cpu.double()).norm() / ref_cpu.double().norm())
        print(f"   M={m:4d} N={n:4d} K={k:5d}: rel diff {rel:.2e}  {'OK' if rel <= 1e-5 else 'MISMATCH'}")
    print("2) reference time, N = K = 8192 (triton.testing.do_bench median)")
    n = k = 8192
    for m in (1, 4096):
        a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k, device=dev, seed=m)
        p = Problem(m, n, k, torch.bfloat16, dev)
        ops = Operands(a, b, sa, sb, alpha, torch.empty(m, n, dtype=torch.bfloat16, device=dev))
        t_ref = do_bench(lambda: ops.out.copy_(reference_mm(p, ops)), warmup=25, rep=100, return_mode="median")
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = do_bench(lambda: torch.mm(x, w.t()), warmup=25, rep=100, return_mode="median")
        print(f"   M={m:5d}: reference {t_ref * 1e3:9.1f} us   cuBLAS bf16 {t_bf16 * 1e3:8.1f} us   "
              f"ratio {t_ref / t_bf16:5.1f}x")


if __name__ == "__main__":
    main()
