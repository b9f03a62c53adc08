"""Profile target for ncu: the dispatcher's picks for N = K = 8192 at M = 1 and M = 16, one launch each inside a
cudaProfilerStart/Stop range (warm-up and tuning stay outside it).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy python3 benchmarks/profile_small_m.py [M:CONFIG_JSON ...]

With arguments, each ``M:{...}`` runs that ``triton:fused`` config at that M instead of the dispatcher's picks.
"""
from __future__ import annotations

import json
import sys
import tempfile

import torch

from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.dispatch.dispatcher import Choice, Dispatcher
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import make_nvfp4_inputs


def main() -> None:
    dev = torch.device("cuda", 0)
    d = Dispatcher(cache_dir=tempfile.mkdtemp(prefix="fp4prof-"))
    runs = []
    asked = [(int(a.split(":", 1)[0]), json.loads(a.split(":", 1)[1])) for a in sys.argv[1:]]
    for m, cfg in asked or [(1, None), (16, None)]:
        a, b, sa, sb, alpha = make_nvfp4_inputs(m, 8192, 8192, device=dev, seed=m)
        p = Problem(m, 8192, 8192, torch.bfloat16, dev)
        # probe + tune (or the config asked for), outside the profiled range
        c = d.choose(p) if cfg is None else Choice(TritonFusedBackend(), cfg)
        ops = Operands(a, b, sa, sb, alpha, torch.empty(m, 8192, dtype=torch.bfloat16, device=dev))
        c.backend.run(p, ops, c.config)
        runs.append((m, c, p, ops))
        print(f"M={m}: {c.backend.name} {c.config}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for m, c, p, ops in runs:
        c.backend.run(p, ops, c.config)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
