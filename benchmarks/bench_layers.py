"""One NVFP4 linear layer, every way it can run on this GPU: µs per call in CUDA graphs and the error.

Per (N x K, M), one run, bf16 in / bf16 out, layers rotated through R copies (R x the weight's bytes > 3x the L2, as
layer after layer in a model; bench_eager.py's method), one CUDA graph of R calls replayed, time per call:
  auto           Fp4Linear(mode="auto") (printed: the mode it resolved to, the backend and config family it ran)
  w4a16          Fp4Linear(mode="w4a16"): w4a16_mm, activations as they are
  w4a4 static    Fp4Linear(mode="w4a4") with a calibrated input_scale: one quantize launch, then fp4_mm
  w4a4 dynamic   Fp4Linear(mode="w4a4") without one: amax, quantize, fp4_mm
  quant static / quant dynamic   quantize_nvfp4 alone (the activation quantize of the two W4A4 rows)
  humming        Humming's HummingLayer(x) as vLLM runs it (its default tuning, Stream-K on)
  humming-nosk   humming:w4a16 through w4a16_mm's adapter (Stream-K off: fp4dispatch's determinism rule)
  bf16           nn.Linear on the decoded weight (cuBLAS)
Error: relative Frobenius error against the float64 product of the bf16 input with the decoded NVFP4 weight (what
the checkpoint means). Goals (issue 33): auto is W4A16 on an H200, its error within 1.5x of bf16's, and at M <= 128 it
is at least as fast as Humming's default and 1.15x faster than Humming with Stream-K off; the static quantize <= 3 µs
at M <= 16, the dynamic one <= 6 µs.

    export PYTHONPATH=$PWD; python benchmarks/bench_layers.py --out $OUT [--shapes 8192x8192,... --ms 1,16,...]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eager import MS, _copies, _graph_us  # noqa: E402  (the same timing method)
from bench_hopper import SHAPES  # noqa: E402

QUANT_CALLS = 32
COLUMNS = ("auto", "w4a16", "w4a4 static", "w4a4 dynamic", "quant static", "quant dynamic", "humming", "humming-nosk",
           "bf16")


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _humming_layer(wq, ws_lin, ws2, n, k):
    """Humming's layer on the ModelOpt tensors, as vLLM builds it (its default tuning: Stream-K on)."""
    from humming.layer import HummingLayer

    layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                         torch_dtype=torch.bfloat16).cuda()
    layer.load_from_tensors({"weight": wq, "weight_scale": ws_lin, "weight_scale_2": ws2.reshape(1).float()})
    layer.transform()
    return layer


def cell(m: int, n: int, k: int) -> dict:
    from fp4dispatch import dequantize_nvfp4, unswizzle_scales, warmup
    from fp4dispatch.backends.humming import HummingBackend
    from fp4dispatch.nn import Fp4Linear
    from fp4dispatch.problem import Operands, Problem

    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    r = _copies(n * k * 9 // 16)
    rb = _copies(2 * n * k)
    base = Fp4Linear.from_linear(_linear(w), mode="w4a16")
    wdec = (dequantize_nvfp4(base.weight, base.weight_scale.view(torch.float8_e4m3fn)).double()
            * base.weight_scale_2.view(torch.float32).double())
    ref = x.double() @ wdec.T
    amax = float(x.float().abs().amax())
    layers = {
        "auto": [_clone(base, "auto") for _ in range(r)],
        "w4a16": [_clone(base, "w4a16") for _ in range(r)],
        "w4a4 static": [_clone(base, "w4a4", amax / 2688) for _ in range(r)],
        "w4a4 dynamic": [_clone(base, "w4a4") for _ in range(r)],
    }
    dense = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
             for _ in range(rb)]
    for d in dense:
        d.weight.copy_(wdec.to(torch.bfloat16))
    row: dict = {"n": n, "k": k, "m": m, "copies": [r, rb], "us": {}, "err": {}}
    # decide and prove every key before anything is captured: both ops at this M
    warmup([(m, n, k)])
    for name, ls in layers.items():
        y = ls[0](x)
        row["err"][name] = _rel(y, ref)
        row["us"][name] = _graph_us(lambda i, ls=ls: ls[i](x), r)
    row["auto_mode"] = layers["auto"][0].resolved_mode(x.device)
    row["auto_pick"] = auto_pick(Problem(m, n, k, torch.bfloat16, x.device,
                                         torch.bfloat16 if row["auto_mode"] == "w4a16" else torch.uint8))
    row["us"]["quant static"], row["us"]["quant dynamic"] = quant_us(x)
    row["us"]["bf16"] = _graph_us(lambda i: dense[i](x), rb)
    row["err"]["bf16"] = _rel(dense[0](x), ref)
    if importlib.util.find_spec("humming") is not None:
        ws_lin = unswizzle_scales(base.weight_scale, n, k // 16).view(torch.float8_e4m3fn).contiguous()
        ws2 = base.weight_scale_2.view(torch.float32)
        hl = [_humming_layer(base.weight.clone(), ws_lin.clone(), ws2, n, k) for _ in range(r)]
        row["err"]["humming"] = _rel(hl[0](x), ref)
        row["us"]["humming"] = _graph_us(lambda i: hl[i](x), r)
        hb = HummingBackend()
        p = Problem(m, n, k, torch.bfloat16, x.device, torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ops = [Operands(x, ls.weight, x.new_empty(0, dtype=torch.float8_e4m3fn),
                        ls.weight_scale.view(torch.float8_e4m3fn), ws2, out) for ls in layers["w4a16"]]
        hb.run(p, ops[0], {})
        row["err"]["humming-nosk"] = _rel(out, ref)
        row["us"]["humming-nosk"] = _graph_us(lambda i: hb.run(p, ops[i], {}), r)
    torch.cuda.empty_cache()
    return row


def auto_pick(problem) -> dict:
    """What the default dispatcher decided for ``problem``'s key (the layer's op): the backend, its config, the
    tuner's time and its ranking's first four (backend, config family, µs), so that a cell says which kernel ran."""
    from fp4dispatch import get_dispatcher

    e = get_dispatcher().entry_for(problem) or {}
    top = [(t["backend"], (t.get("config") or {}).get("family"), t.get("time_us")) for t in e.get("ranking", [])[:4]]
    return {"backend": e.get("backend"), "config": e.get("config"), "time_us": e.get("time_us"), "top": top}


def _ran(pick: dict) -> str:
    family = (pick.get("config") or {}).get("family")
    return f"{pick.get('backend')}" + (f" {family}" if family else "")


def quant_us(x: torch.Tensor) -> tuple[float, float]:
    """µs per activation quantize (static, dynamic) of ``x``: QUANT_CALLS calls in one graph, so that the replay's
    own launch cost (several µs) is spread as it is over a model's layers (a one-call graph would time mostly that)."""
    from fp4dispatch import quantize_nvfp4

    gs = torch.tensor([2688 / float(x.float().abs().amax())], dtype=torch.float32, device=x.device)
    return (_graph_us(lambda i: quantize_nvfp4(x, gs), QUANT_CALLS),
            _graph_us(lambda i: quantize_nvfp4(x), QUANT_CALLS))


def _linear(w: torch.Tensor):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype).requires_grad_(False)
    lin.weight.copy_(w)
    return lin


def _clone(base, mode: str, input_scale: float | None = None):
    """A layer of its own storage (rotated past the L2) with ``base``'s weight, in ``mode``."""
    from fp4dispatch.nn import Fp4Linear

    layer = Fp4Linear(base.in_features, base.out_features, bias=False, device="cuda", mode=mode)
    layer.load_state_dict(base.state_dict())
    layer.set_input_scale(input_scale)
    return layer


def table(rows: list[dict]) -> list[str]:
    lines = ["| N x K | M | " + " | ".join(COLUMNS) + " | auto is | auto ran |",
             "|---|---|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        cells = [f"{r['us'][c]:.1f}" + (f" ({r['err'][c]:.4f})" if c in r["err"] else "") if c in r["us"] else "-"
                 for c in COLUMNS]
        lines.append(f"| {r['n']}x{r['k']} | {r['m']} | " + " | ".join(cells) + f" | {r['auto_mode']} | "
                     f"{_ran(r.get('auto_pick', {}))} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quant-only", action="store_true", help="only the two activation-quantize columns")
    args = ap.parse_args()
    if args.quant_only:
        print("| K | M | quant static µs | quant dynamic µs |\n|---|---|---|---|")
        for k in sorted({int(s.split("x")[1]) for s in args.shapes.split(",")}):
            for m in (int(v) for v in args.ms.split(",")):
                st, dy = quant_us(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
                print(f"| {k} | {m} | {st:.2f} | {dy:.2f} |", flush=True)
        return 0
    os.environ.setdefault("FP4DISPATCH_CACHE_DIR", tempfile.mkdtemp(prefix="fp4c-layers-"))
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}; µs per call (relative error)", flush=True)
    rows = []
    for s in args.shapes.split(","):
        n, k = (int(v) for v in s.split("x"))
        for m in (int(v) for v in args.ms.split(",")):
            rows.append(cell(m, n, k))
            print(table(rows[-1:])[-1], flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"bench_layers-{args.shapes.replace(',', '_')}.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
