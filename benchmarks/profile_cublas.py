"""One cuBLAS bf16 matmul ``[M, K] @ [N, K].T`` under cudaProfilerStart/Stop, for ncu --profile-from-start off: the
baseline whose unit loads (tensor pipe, shared memory) a fused kernel's profile is read against.

    ncu --profile-from-start off --section SpeedOfLight python3 benchmarks/profile_cublas.py M N K
"""
from __future__ import annotations

import sys

import torch

from gluon_probe import profile_once

if __name__ == "__main__":
    m, n, k = map(int, sys.argv[1:4])
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    profile_once(lambda: a @ b.T)
