"""What one fp4_mm call costs without and with CUDA graphs, beside torch.mm on the dequantized bf16 weight (H200).

Per (N x K, M), one run, bf16 out, both operands' weights rotated through R copies (R x the weight's bytes > 3x the
L2, as layer after layer in a model):
  host   median of perf_counter around each of 300 back-to-back calls, no sync (the host cost of one call);
  eager  median of synchronize -> call -> synchronize;
  graph  one CUDA graph of R calls, one per weight copy, replayed; time per call.
fp4_mm runs through a fresh dispatcher whose keys are decided (tuned, proven) before anything is timed; "pick" names
what it ran (one pick per key, chosen by CUDA-graph time: eager calls and captured calls run the same kernels and
return the same bits); "launches" its kernel launches per call and, where a pre-decode launch precedes the GEMM, the
tuner's time of the pick beside that of the best one-launch candidate of the key (whether the pre-decode pays).
With ``--op w4a16`` the call is ``w4a16_mm`` on the bf16 activations instead (W4A16: ``Fp4Linear``'s mode where there
are no FP4 tensor cores), against the same torch.mm.

    export PYTHONPATH=$PWD; python benchmarks/bench_eager.py --out $OUT [--shapes 8192x8192,... --ms 1,16,...]
                                                                [--op w4a16]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hopper import SHAPES, bench_ms, capture  # noqa: E402  (the graph capture the Hopper table uses)

MS = [1, 16, 128, 1024, 4096]
L2_BYTES = 60 << 20


def _copies(nbytes: int) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / nbytes) + 1))


def _host_us(call, r: int, n: int = 300) -> float:
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i % r)
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def _eager_us(call, r: int, n: int = 60) -> float:
    ts = []
    for i in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(i % r)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _graph_us(call, r: int) -> float:
    g = capture(*[lambda i=i: call(i) for i in range(r)])
    return bench_ms(g.replay) * 1e3 / r


def _pick(entry: dict | None) -> str:
    if not entry:
        return "-"
    cfg = entry.get("config") or {}
    return entry.get("backend", "-") + (f" {cfg['family']}" if "family" in cfg else "")


def _launches(entry: dict | None) -> tuple[int, float | None, float | None]:
    """(launches per call of the pick, its tuned time, the tuned time of the best one-launch candidate): whether a
    pre-decode launch pays, by the tuner's own measurement of the key."""
    from fp4dispatch.kernels.config_json import from_json

    def count(t: dict) -> int:
        cfg = t.get("config") or {}
        return from_json(cfg).launches if t.get("backend") in ("triton:fused", "triton:w4a16") and "family" in cfg \
            else 1
    if not entry:
        return 1, None, None
    single = [t["time_us"] for t in entry.get("ranking", []) if t.get("time_us") is not None and count(t) == 1]
    return count(entry), entry.get("time_us"), min(single, default=None)


def rotated_operands(m: int, n: int, k: int) -> SimpleNamespace:
    """Random NVFP4 activations (xq, xs) and alpha; the weight as r4 NVFP4 copies (wq, ws) and rb dequantized bf16
    copies (wd), each set past 3x the L2; xd the dequantized activations."""
    from fp4dispatch import dequantize_nvfp4, quantize_nvfp4

    xq, xs, xg = quantize_nvfp4(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
    wq0, ws0, wg = quantize_nvfp4(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
    r4, rb = _copies(wq0.numel() + ws0.numel()), _copies(2 * n * k)
    wd0 = dequantize_nvfp4(wq0, ws0, dtype=torch.bfloat16)
    return SimpleNamespace(xq=xq, xs=xs, alpha=(1.0 / (xg * wg)).float().reshape(1), r4=r4, rb=rb,
                           wq=[wq0] + [wq0.clone() for _ in range(r4 - 1)],
                           ws=[ws0] + [ws0.clone() for _ in range(r4 - 1)],
                           wd=[wd0] + [wd0.clone() for _ in range(rb - 1)],
                           xd=dequantize_nvfp4(xq, xs, dtype=torch.bfloat16))


def cell(m: int, n: int, k: int, op: str = "fp4_mm") -> dict:
    import fp4dispatch
    from fp4dispatch.problem import Problem

    o = rotated_operands(m, n, k)
    xq, xs, alpha, wq, ws, wd, xd, r4, rb = o.xq, o.xs, o.alpha, o.wq, o.ws, o.wd, o.xd, o.r4, o.rb
    out4 = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    outb = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    adt = torch.bfloat16 if op == "w4a16" else torch.uint8
    fp4dispatch.warmup([(m, n, k)], activations=None if adt is torch.uint8 else adt)  # tune, prove before timing

    def fp4(i):
        if adt is torch.uint8:
            fp4dispatch.fp4_mm(xq, wq[i], xs, ws[i], alpha, out=out4)
        else:  # alpha also holds the activations' global scale: the same scaling for both ops' timing
            fp4dispatch.w4a16_mm(xd, wq[i], ws[i], alpha, out=out4)

    def bf16(i):
        torch.mm(xd, wd[i].t(), out=outb)

    row = {"n": n, "k": k, "m": m, "copies": [r4, rb]}
    for name, call, r in (("fp4", fp4, r4), ("bf16", bf16, rb)):
        row[f"host_{name}"] = _host_us(call, r)
        row[f"eager_{name}"] = _eager_us(call, r)
        row[f"graph_{name}"] = _graph_us(call, r)
    entry = fp4dispatch.get_dispatcher().entry_for(Problem(m, n, k, torch.bfloat16, torch.device("cuda"), adt))
    row["pick"] = _pick(entry)
    row["launches"], row["tuned_us"], row["one_launch_us"] = _launches(entry)
    torch.cuda.empty_cache()
    return row


def _launch_text(r: dict) -> str:
    if r["launches"] == 1:
        return "1"
    one = f"{r['one_launch_us']:.1f}" if r["one_launch_us"] is not None else "none offered"
    return f"{r['launches']} ({r['tuned_us']:.1f} / {one})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--op", choices=("fp4_mm", "w4a16"), default="fp4_mm", help="the call timed (default fp4_mm)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {args.op}", flush=True)
    op = args.op  # the rows' "fp4" fields hold this op's times
    print(f"| N x K | M | host us {op} / torch.mm | eager us {op} / bf16 | graph us {op} / bf16 | pick | launches "
          "(tuned us / best one-launch us) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for n, k in shapes:
        for m in ms:
            r = cell(m, n, k, args.op)
            rows.append(r)
            print(f"| {n}x{k} | {m} | {r['host_fp4']:.0f} / {r['host_bf16']:.0f} | {r['eager_fp4']:.1f} / "
                  f"{r['eager_bf16']:.1f} | {r['graph_fp4']:.1f} / {r['graph_bf16']:.1f} | {r['pick']} | "
                  f"{_launch_text(r)} |", flush=True)
    host_ok = sum(r["host_fp4"] <= 1.3 * r["host_bf16"] for r in rows)
    graph_wins = [r for r in rows if r["graph_fp4"] <= r["graph_bf16"]]
    eager_ok = sum(r["eager_fp4"] <= r["eager_bf16"] for r in graph_wins)
    print(f"host <= 1.3x torch.mm: {host_ok} of {len(rows)} cells; eager {op} <= eager bf16 in {eager_ok} of the "
          f"{len(graph_wins)} cells where graph {op} <= graph bf16", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_eager{'' if args.op == 'fp4_mm' else '_' + args.op}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
