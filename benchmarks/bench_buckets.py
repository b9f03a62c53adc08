"""How much does bucketing M cost? For each power-of-two bucket (lo, hi] = (b/2, b], tune at both edges (every
healthy backend x config, verified and timed) and report how much slower one edge's winner is at the other edge
than that edge's own best. This is the measurement behind the power-of-two M buckets (docs/tuning.md).

    python benchmarks/bench_buckets.py [--shapes 8192x8192,2048x6144] [--max-m 8192]
"""
from __future__ import annotations

import argparse

import torch

from fp4dispatch.backends import default_backends
from fp4dispatch.backends.base import config_id
from fp4dispatch.dispatch.timer import for_device
from fp4dispatch.dispatch.probe import probe_backend
from fp4dispatch.problem import M_BUCKETS, Problem
from fp4dispatch.dispatch.tuner import tune


def _times(problem, candidates, do_bench):
    return {(t.backend, config_id(t.config)): t.time_ms for t in tune(problem, candidates, do_bench).trials if t.ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="8192x8192,2048x6144", help="NxK pairs, comma separated")
    ap.add_argument("--max-m", type=int, default=8192)
    args = ap.parse_args()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    do_bench = for_device(dev)
    healthy = [b for b in default_backends() if b.name != "reference" and probe_backend(b, dev).status == "ok"]
    print(f"device {dev}; candidates: {[b.name for b in healthy]}")
    print(f"{'N x K':>12} {'bucket':>7} {'lo':>5} {'hi':>5} {'lo-winner @hi':>14} {'hi-winner @lo':>14}  winners (lo | hi)")
    worst = []
    for shape in args.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        for b in M_BUCKETS[1:]:
            if b > args.max_m:
                break
            lo, hi = b // 2 + 1, b
            cands = [c for c in healthy if c.unsupported(Problem(hi, n, k, torch.bfloat16, dev)) is None]
            t_lo = _times(Problem(lo, n, k, torch.bfloat16, dev), cands, do_bench)
            t_hi = _times(Problem(hi, n, k, torch.bfloat16, dev), cands, do_bench)
            common = set(t_lo) & set(t_hi)
            if not common:
                continue
            w_lo = min(common, key=t_lo.get)
            w_hi = min(common, key=t_hi.get)
            p_lo_at_hi = t_hi[w_lo] / min(t_hi[c] for c in common)
            p_hi_at_lo = t_lo[w_hi] / min(t_lo[c] for c in common)
            worst.append(max(p_lo_at_hi, p_hi_at_lo))
            print(f"{n:>6}x{k:<5} {b:>7} {lo:>5} {hi:>5} {p_lo_at_hi:13.2f}x {p_hi_at_lo:13.2f}x  "
                  f"{w_lo[0]}[{w_lo[1]}] | {w_hi[0]}[{w_hi[1]}]")
    if worst:
        worst.sort()
        print(f"penalty of a bucket's winner at its other edge: median {worst[len(worst) // 2]:.2f}x, "
              f"max {worst[-1]:.2f}x over {len(worst)} buckets")


if __name__ == "__main__":
    main()
