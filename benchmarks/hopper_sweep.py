"""``bench_hopper.py --sweep``: GEMV variants at M <= 4 (gemv2 with fp32 or fp16x2 ``H2`` products, decoded by bit
placement or through e4m3 bytes and the hardware cvt (``CVT``), register cap ``maxnreg``, register double buffer
``prefetch``, tile shape, split) next to the bf16 tensor-core ``mma`` and the swapped-operand tensor-core ``wmma``
(tile, K step, warps, stages, split). Each variant is checked for exactness first (M in {1, 3, 16, 127}, N=1000,
K in {2064, 4096}); then graph times at M in {1, 4, 16, 128} (``--sweep-ms``) on the three large shapes, with cuBLAS
bf16 graph-timed in the same run, and a short table. ``--sweep-kernels`` limits the kernel families.
"""
from __future__ import annotations

import json
import math

import torch

from bench_hopper import graph_ms, log, rand_operands, ref64, rel_err


def _wmma_configs(m: int) -> list[dict]:
    """Swapped-operand tensor-core tiles: (BM, BN, BKB, warps, stages, split, APRE[, extra options]) by M."""
    # fifth session: CVT (nibbles through e4m3 bytes and cvt.rn.f16x2.e4m3x2, 494 vs 558 loop instructions at M=16)
    # won every same-tile pair and is now the default; {"CVT": False} keeps the bit-placement decode for A/B runs
    bits = {"CVT": False}  # the bit-placement decode
    sk = {"stream": True}  # stream-K (wmma_sk_kernel): one wave of CTAs, each the same share of all K steps
    if m <= 16:
        # (fourth session: split 8, 4-5 stages, BKB 8/32, split 1, A decoded in the loop and maxnreg 96 all lost on
        # the large shapes)
        # (fifth session: with CVT, BKB 8 needs 66 registers instead of 122: up to 7 CTAs per SM instead of 4)
        # (and lost: 27.9-54.1 vs 25.3 us on 8192², see RESULTS.md, fifth session, run 3; stream-K lost too:
        # 32.8-35.1 / 75.3-81.8 / 73.7-75.6 us vs 25.4 / 60.3 / 58.6, run 6)
        # (sixth session: one warpgroup over 128 weight rows at BKB 8, 427 instead of 494 loop instructions and
        # 124 registers, lost: 28.6-36.6 / 75.9-77.6 / 72.9-93.3 us vs 25.1 / 60.3 / 58.3, RESULTS.md sixth session)
        tiles = [(16, 64, 16, 4, 3, 2, 1), (16, 64, 16, 4, 3, 4, 1), (16, 128, 16, 8, 3, 4, 1)]
    elif m <= 64:
        bm = 32 if m <= 32 else 64
        tiles = [(bm, 64, 16, 4, 3, 4, 1), (bm, 64, 8, 4, 4, 4, 1), (bm, 128, 8, 8, 4, 2, 1), (bm, 64, 16, 4, 3, 2, 1)]
    elif m <= 256:
        # (fourth session: 64x256 tiles, half the L2 reads of A per weight row, lost: M=128 66 / 169 / 193 us vs
        # 48 / 160 / 131 for 128x128 on the three large shapes)
        # (fifth session: two stages, alone or with maxnreg 128 for 2 CTAs per SM, and a 256-wide K step all lost:
        # 59-71 / 165-252 / 164-221 us vs 47-48 / 158-160 / 128-131 on the three large shapes; split 3 too)
        # (sixth session: one-warpgroup CTAs, two per SM, 51-65 / 146-184 / 140-220 us; 128x256 tiles of 8 warps
        # 58-59 / 178-182 / 134-142; 16-warp CTAs 55-82 / 171-253 / 131-211; against 47.2-47.4 / 157-159 / 127-128)
        tiles = [(128, 128, 8, 8, 4, 2, 1), (128, 128, 8, 8, 4, 4, 1), (64, 128, 8, 8, 4, 2, 1),
                 (128, 128, 8, 8, 3, 2, 1), (128, 128, 8, 8, 3, 2, 1, bits), (128, 128, 8, 8, 3, 1, 1, sk),
                 (128, 128, 8, 8, 4, 1, 1, sk)]
    else:
        tiles = [(128, 128, 8, 8, 3, 1, 1), (256, 128, 4, 8, 3, 1, 1), (128, 128, 4, 8, 4, 1, 1),
                 (128, 256, 4, 8, 3, 1, 1), (256, 128, 8, 8, 3, 1, 1), (256, 128, 8, 8, 3, 1, 1, sk)]
    out = [{"kernel": "wmma", "BM": bm, "BN": bn, "BKB": bkb, "warps": w, "stages": st, "split": sp,
            **({"APRE": True} if pre else {}), **(extra[0] if extra else {})}
           for bm, bn, bkb, w, st, sp, pre, *extra in tiles]
    return out


def sweep_configs(m: int, kernels: tuple[str, ...] = ("gemv2", "mma", "wmma")) -> list[dict]:
    """GEMV variants (gemv2: fp32 vs fp16x2 ``H2`` products, ``CVT`` decode, register cap ``maxnreg``, register double
    buffer ``prefetch``) at M <= 4, next to the bf16 tensor-core ``mma`` and the swapped-operand ``wmma``."""
    g2 = {"kernel": "gemv2", "stages": 3, "PAIR": True}
    out = []
    if m <= 4 and "gemv2" in kernels:
        mb = 1 if m == 1 else 4
        tiles = ([(64, 32, 4, 8, False, 0, False), (4, 256, 4, 1, True, 64, False), (4, 128, 2, 1, True, 0, True),
                  (16, 64, 4, 1, True, 0, True)] if m == 1 else
                 [(16, 32, 4, 1, True, 0, True), (8, 32, 2, 1, True, 0, True)])
        for bn, bkb, w, sp, h2, regs, pf in tiles:
            cfg = dict(g2, MB=mb, BN=bn, BKB=bkb, warps=w, split=sp, H2=h2, **({"maxnreg": regs} if regs else {}))
            out.append(dict(cfg, prefetch=True) if pf else cfg)
            if h2:  # the same tile decoding through e4m3 bytes and the hardware cvt
                out.append(dict(out[-1], CVT=True))
        out.append(dict(out[-1], pdl=False))
    if m > 1 and "mma" in kernels:  # the older tensor-core kernel (mma16 of commit fe2e942 was slower, gone)
        out.append({"kernel": "mma", "BM": 16 if m <= 16 else 128, "BN": 64, "BKB": 8, "split": 4 if m <= 16 else 1,
                    "warps": 4, "stages": 3})
    if "wmma" in kernels:
        out += _wmma_configs(m)
    return out


def run_sweep(res: dict, bw: float, kernels: tuple[str, ...] = ("gemv2", "mma", "wmma"),
              ms: tuple[int, ...] = (1, 4, 16, 128),
              shapes: tuple[tuple[int, int], ...] = ((8192, 8192), (28672, 8192), (8192, 28672))) -> bool:
    """Exactness of every sweep config (M in {1, 3, 16, 127}, N=1000, K in {2064, 4096}), then graph times at M in
    ``ms``."""
    from fp4dispatch.kernels.fused import fused_mm

    ok_all, rows, bad = True, [], set()
    # tiles for M > 256 are checked at that M + 3 (a partial M tile)
    for m in sorted({1, 3, 16, 127} | {x + 3 for x in ms if x > 256}):
        for cfg in sweep_configs(m, kernels):
            # K = 2064: a partial last K step (masked); K = 4096: whole steps (EVEN_K, unmasked loads)
            for odt, tol, k in ((torch.float32, 1e-5, 2064), (torch.float32, 1e-5, 4096)):
                ops = rand_operands(m, 1000, k, seed=len(rows) + 11, out_dtype=odt, scale_lo=0x01, scale_hi=0x50)
                try:
                    fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
                    err = rel_err(ops.out, ref64(ops, m, 1000, k))
                except Exception as e:  # noqa: BLE001
                    err = math.inf
                    log(f"  {cfg}: {type(e).__name__}: {str(e)[:300]}")
                rows.append({"m": m, "cfg": cfg, "out": str(odt), "rel_err": err})
                if not err <= tol:
                    ok_all = False
                    bad.add(json.dumps(cfg, sort_keys=True))
                    log(f"FAIL sweep m={m} {odt} {cfg}: {err:.3g}")
    log(f"sweep check: {len(rows)} runs, {len(bad)} failing configs, worst fp32 "
        f"{max(r['rel_err'] for r in rows if r['out'] == 'torch.float32'):.3g}")
    table = []
    for (n, k) in shapes:
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            ops = rand_operands(m, n, k, seed=m)
            wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = graph_ms(lambda: torch.mm(wa, wb.t())) * 1e3
            times = []
            for cfg in sweep_configs(m, kernels):
                if json.dumps(cfg, sort_keys=True) in bad:
                    continue
                try:
                    t = graph_ms(lambda c=cfg: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out,
                                                        c))
                except Exception as e:  # noqa: BLE001
                    log(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                times.append((t * 1e3, cfg))
                log(f"  N={n} K={k} M={m} {json.dumps(cfg)} {t * 1e3:.1f} us")
            times.sort(key=lambda x: x[0])
            if not times:
                continue
            old = min((t for t, c in times if c["kernel"] == "mma" or c.get("H2") is False), default=math.nan)
            table.append((n, k, m, t_bf16, old, times[0][0], times[0][1]))
        del wb
    log("| N | K | M | cuBLAS bf16 us | best old kernel us | best us | x bf16 | config |")
    log("|---|---|---|---|---|---|---|---|")
    for n, k, m, tb, to, tn, c in table:
        log(f"| {n} | {k} | {m} | {tb:.1f} | {to:.1f} | {tn:.1f} | {tb / tn:.2f} | {json.dumps(c)} |")
    res["sweep"] = {"check": rows, "table": [list(r) for r in table]}
    return ok_all
