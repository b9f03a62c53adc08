"""One MoE layer's expert GEMM (``fp4_grouped_mm``), every way it runs on this GPU: µs per whole-layer call in CUDA
graphs, and the share of the copy bandwidth that the touched FP4 bytes use.

Per (layer, batch B), one run, bf16 out: B tokens each routed to top-k of E experts by random router logits (a
per-expert bias makes the load uneven, as trained routers are); R routings per cell captured in one graph (R calls,
each with its own routing, activations and touched experts), time per call:
  pick          fp4dispatch.fp4_grouped_mm, decided (tuned, proven) before capture
  grouped best  triton:grouped's fastest config (its config in the JSON, every config's time there too)
  humming:grouped  fp4dispatch's Humming adapter called directly (the token decode + Humming, Stream-K off)
  humming       Humming's grouped MoE GEMM (``grouped_contiguous``) on the dequantized bf16 tokens, default tuning
                (Stream-K on); humming-nosk: Stream-K off (fp4dispatch's determinism rule)
  bf16          torch._grouped_mm on the dequantized bf16 tokens and experts (cuBLAS)
%bw: (FP4 bytes of the experts touched + the tokens' FP4 bytes + the bf16 output) per second over the copy
bandwidth measured in the same run. The per-expert loop (``loop:fp4_mm``) reads the routing on the host and cannot be
captured; it is left out of the dispatcher here (FP4DISPATCH_DISABLE) unless ``--loop``, which adds its eager time.
Goals (issue 32): the pick >= Humming's default and >= 1.15x Humming with Stream-K off, >= 75 % of the copy bandwidth
at B in {8, 32, 128} and >= 60 % at B = 1, >= 3x bf16 at B <= 32.

``--biases 0,1,3`` times each (layer, B) on routings of several per-expert bias spreads (``topk_counts``' bias: 0
every expert equally likely, 1 as trained routers, 3 a few hot experts) and prints, per (layer, B), the fastest
backend at each and the pick's time over it (the pick is decided once per key, on the tuner's own routing).

    export PYTHONPATH=$PWD; python benchmarks/bench_grouped.py --out $OUT [--layers deepseek-gate_up,... --bs 1,8]
    python benchmarks/bench_grouped.py --plot OUT/bench_grouped-*.json --out OUT   # the table and PNG of a run

A run also writes ``bench_grouped.png`` into ``--out``: per layer, µs per call against B (log-log) and the share of
the copy bandwidth against B, with the goals drawn.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eager import _eager_us, _graph_us  # noqa: E402  (the same timing method)
from bench_hopper import copy_bandwidth  # noqa: E402

# name: (experts, N, K, top-k) of one expert GEMM of the layer (gate_up: the gate and up projections stacked)
LAYERS = {
    "deepseek-gate_up": (256, 4096, 7168, 8),
    "deepseek-down": (256, 7168, 2048, 8),
    "qwen3.5-gate_up": (512, 2048, 4096, 10),
    "qwen3.5-down": (512, 4096, 1024, 10),
}
BS = [1, 8, 32, 128, 512]
ROUTINGS = 4
COLUMNS = ("pick", "grouped best", "humming:grouped", "humming", "humming-nosk", "bf16", "loop (eager)")


def _weights(e: int, n: int, k: int):
    from fp4dispatch.format_grouped import swizzle_expert_scales

    g = torch.Generator(device="cuda").manual_seed(1)
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    lin = torch.randint(0x30, 0x48, (e, n, k // 16), dtype=torch.uint8, device="cuda", generator=g)
    lin = lin.view(torch.float8_e4m3fn)
    ws2 = (0.5 + torch.rand(e, device="cuda", generator=g)) / 256
    return b, lin, swizzle_expert_scales(lin), ws2


def _tokens(b_tokens: int, e: int, k: int, top_k: int, seed: int, bias: float = 1.0):
    """(a, a_scale swizzled for any routing, offs, bf16 tokens decoded, touched experts) of one routing (``bias``:
    ``topk_counts``' spread of the per-expert bias, how uneven the load is)."""
    from fp4dispatch.format import dequantize_nvfp4
    from fp4dispatch.format_grouped import grouped_scale_rows, swizzle_grouped_scales
    from fp4dispatch.routing import offs_from_counts, topk_counts

    counts = topk_counts(b_tokens, e, top_k, seed=seed, device="cuda", bias=bias)
    offs = offs_from_counts(counts)
    t = int(offs[-1])
    g = torch.Generator(device="cuda").manual_seed(100 + seed)
    a = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    lin = torch.randint(0x30, 0x48, (t, k // 16), dtype=torch.uint8, device="cuda", generator=g)
    sa = swizzle_grouped_scales(lin.view(torch.float8_e4m3fn), offs, grouped_scale_rows(t, e))
    x = dequantize_nvfp4(a, lin.view(torch.float8_e4m3fn), scale_layout="linear", dtype=torch.bfloat16)
    return a, sa, offs, x, int((counts > 0).sum())


def _humming(b, lin, ws2, e, n, k, stream_k: bool):
    from humming.layer import HummingLayer

    layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                         num_experts=e, torch_dtype=torch.bfloat16).cuda()
    layer.load_from_tensors({"weight": b, "weight_scale": lin, "weight_scale_2": ws2.float()})
    layer.transform()
    tuning = None
    if not stream_k:  # Humming's own heuristic configs with Stream-K off, as humming:w4a16 runs them
        from humming.tune import get_heuristics_config

        tuning = get_heuristics_config(layer.humming_config, gemm_type="grouped_contiguous")
        for _lo, _hi, cfg in tuning:
            cfg["use_stream_k"] = False
        tuning = json.dumps(tuning)

    def call(x, offs, out):
        layer(x, outputs=out, expert_layout=torch.nn.functional.pad(offs, (1, 0)),
              compute_config={"gemm_type": "grouped_contiguous"}, tuning_config=tuning)
    return call


def cell(name: str, b_tokens: int, bw: float, loop: bool, bias: float = 1.0) -> dict:
    import fp4dispatch
    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend
    from fp4dispatch.backends.triton_grouped import TritonGroupedBackend
    from fp4dispatch.problem import GroupedOperands, Problem, m_bucket

    e, n, k, top_k = LAYERS[name]
    b, lin, sb, ws2 = _weights(e, n, k)
    alpha = ws2.float()
    rs = [_tokens(b_tokens, e, k, top_k, seed, bias) for seed in range(ROUTINGS)]
    t = rs[0][0].shape[0]
    outs = [torch.empty(t, n, dtype=torch.bfloat16, device="cuda") for _ in rs]
    touched = sum(r[4] for r in rs) / len(rs)
    nbytes = touched * n * k * 9 // 16 + t * k * 9 // 16 + 2 * t * n
    row: dict = {"layer": name, "e": e, "n": n, "k": k, "top_k": top_k, "b": b_tokens, "bias": bias, "t": t,
                 "touched": touched, "us": {}, "pct_bw": {}}

    def grouped(i):
        a, sa, offs = rs[i][:3]
        fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out=outs[i])
    grouped(0)  # decides and proves the key at this T
    decision = fp4dispatch.get_dispatcher().cache_for().decisions.get(f"grouped-e{e}-m{m_bucket(t)}-n{n}-k{k}-bfloat16")
    row["pick_name"] = decision["backend"] if decision else "-"
    row["tuner_ranking"] = decision.get("ranking") if decision else None
    row["us"]["pick"] = _graph_us(grouped, len(rs))
    tg = TritonGroupedBackend()
    p = Problem(t, n, k, torch.bfloat16, torch.device("cuda"), torch.uint8, e)
    best, row["grouped_configs"] = None, []
    for cfg in tg.configs(p):
        ops = [GroupedOperands(r[0], b, r[1], sb, alpha, o, r[2]) for r, o in zip(rs, outs)]
        us = _graph_us(lambda i, c=cfg: tg.run(p, ops[i], c), len(rs))
        row["grouped_configs"].append([cfg.to_json(), us])
        if best is None or us < best[0]:
            best = (us, cfg.to_json())
    row["us"]["grouped best"], row["grouped_config"] = best
    hg = HummingGroupedBackend()
    if hg.unavailable(p.device) is None and hg.unsupported(p) is None:
        ops = [GroupedOperands(r[0], b, r[1], sb, alpha, o, r[2]) for r, o in zip(rs, outs)]
        row["us"]["humming:grouped"] = _graph_us(lambda i: hg.run(p, ops[i], {}), len(rs))
    for col, sk in (("humming", True), ("humming-nosk", False)):
        try:
            call = _humming(b, lin, ws2, e, n, k, sk)
            row["us"][col] = _graph_us(lambda i, call=call: call(rs[i][3], rs[i][2], outs[i]), len(rs))
        except Exception as err:  # noqa: BLE001 - a peer that cannot run here is a table cell, not the end of the run
            row.setdefault("errors", {})[col] = f"{type(err).__name__}: {err}"[:300]
    try:
        wb = torch.stack([fp4dispatch.dequantize_nvfp4(b[i], lin[i], scale_layout="linear", dtype=torch.bfloat16)
                          for i in range(e)])
        row["us"]["bf16"] = _graph_us(lambda i: torch._grouped_mm(rs[i][3], wb.transpose(-2, -1), offs=rs[i][2],
                                                                  out_dtype=torch.bfloat16), len(rs))
    except Exception as err:  # noqa: BLE001
        row.setdefault("errors", {})["bf16"] = f"{type(err).__name__}: {err}"[:300]
    if loop:
        lb = __import__("fp4dispatch.backends.expert_loop", fromlist=["x"]).ExpertLoopBackend()
        ops = [GroupedOperands(r[0], b, r[1], sb, alpha, o, r[2]) for r, o in zip(rs, outs)]
        row["us"]["loop (eager)"] = _eager_us(lambda i: lb.run(p, ops[i], {}), len(rs))
    for col, us in row["us"].items():
        row["pct_bw"][col] = 100 * nbytes / (us * 1e-6) / bw
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| layer (E, N x K, top-k) | B | bias | touched | " + " | ".join(COLUMNS) + " | pick is |",
             "|---|---|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for r in rows:
        cells = [f"{r['us'][c]:.1f} ({r['pct_bw'][c]:.0f} %)" if c in r["us"] else "-" for c in COLUMNS]
        lines.append(f"| {r['layer']} ({r['e']}, {r['n']}x{r['k']}, {r['top_k']}) | {r['b']} | {r['bias']:g} | "
                     f"{r['touched']:.0f} | " + " | ".join(cells) + f" | {r['pick_name']} |")
    return lines


def distribution_lines(rows: list[dict]) -> list[str]:
    """Per (layer, B) timed at several biases: the fastest fp4dispatch backend at each (``grouped best`` or
    ``humming:grouped``) and the pick's time over it: how much the token distribution moves the winner."""
    ours = ("grouped best", "humming:grouped")
    out = []
    for layer, b in dict.fromkeys((r["layer"], r["b"]) for r in rows):
        cells = [r for r in rows if (r["layer"], r["b"]) == (layer, b)]
        if len(cells) < 2:
            continue
        parts = []
        for r in cells:
            best = min((c for c in ours if c in r["us"]), key=lambda c: r["us"][c])
            parts.append(f"bias {r['bias']:g}: {best} {r['us'][best]:.1f} us, pick {r['pick_name']} "
                         f"{r['us']['pick'] / r['us'][best]:.2f}x")
        out.append(f"{layer} B={b}: " + "; ".join(parts))
    return out


PLOTTED = ("pick", "grouped best", "humming:grouped", "humming", "humming-nosk", "bf16")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Per layer (bias 1 rows): µs per call against B (log-log) above, % of the copy bandwidth against B below (the
    goals dashed: 60 % at B = 1, 75 % at B = 8..128)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(2, len(layers), figsize=(3.6 * len(layers), 6.5), dpi=70, squeeze=False)
    for col, layer in enumerate(layers):
        rs = sorted((r for r in rows if r["layer"] == layer and r["bias"] == 1.0), key=lambda r: r["b"])
        for i, name in enumerate(PLOTTED):
            pts = [(r["b"], r["us"][name], r["pct_bw"][name]) for r in rs if name in r["us"]]
            if not pts:
                continue
            style = dict(color=f"C{i}", marker="o", lw=2.2 if name == "pick" else 1.0, label=name)
            axes[0][col].loglog([p[0] for p in pts], [p[1] for p in pts], **style)
            axes[1][col].semilogx([p[0] for p in pts], [p[2] for p in pts], **style)
        axes[1][col].plot([1], [60], "k_", ms=14)
        axes[1][col].hlines(75, 8, 128, colors="k", linestyles="dashed", lw=0.8)
        axes[0][col].set_title(f"{layer} (E={rs[0]['e']}, {rs[0]['n']}x{rs[0]['k']})" if rs else layer, fontsize=9)
        axes[0][col].set_ylabel("us per call (CUDA graph)")
        axes[1][col].set_ylabel("% of copy bandwidth")
        axes[1][col].set_ylim(0, 100)
        for ax in axes[:, col]:
            ax.set_xlabel("B (tokens)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bs", default=",".join(map(str, BS)))
    ap.add_argument("--biases", default="1", help="per-expert router bias spreads (topk_counts' bias): 0 uniform, "
                    "1 as trained routers, 3 a few hot experts; each (layer, B) is timed at every one")
    ap.add_argument("--loop", action="store_true", help="also time loop:fp4_mm eagerly (tunes many dense keys)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="no run: the table and PNG of these runs' JSON files")
    args = ap.parse_args()
    if args.plot:
        rows = [r for path in args.plot for r in json.load(open(path))["rows"]]
        os.makedirs(args.out, exist_ok=True)
        plot(rows, os.path.join(args.out, "bench_grouped.png"), "fp4_grouped_mm and its peers (bench_grouped.py)")
        print("\n".join(table(rows) + distribution_lines(rows)))
        return 0
    try:
        biases = [float(v) for v in args.biases.split(",")]
    except ValueError:
        biases = [-1.0]
    if not all(0 <= v < float("inf") for v in biases):
        ap.error(f"--biases must be comma-separated finite numbers >= 0 (e.g. 0,1,3); got {args.biases!r}")
    os.environ.setdefault("FP4DISPATCH_CACHE_DIR", tempfile.mkdtemp(prefix="fp4c-grouped-"))
    if not args.loop:
        os.environ["FP4DISPATCH_DISABLE"] = "loop:fp4_mm"
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · copy {bw / 1e12:.2f} TB/s; µs per call "
          f"(% of copy bandwidth)", flush=True)
    rows = []
    for name in args.layers.split(","):
        for b_tokens in (int(v) for v in args.bs.split(",")):
            for bias in biases:
                rows.append(cell(name, b_tokens, bw, args.loop, bias))
                print(table(rows[-1:])[-1], rows[-1].get("errors", ""), flush=True)
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"bench_grouped-{args.layers.replace(',', '_')}.json"), "w") as f:
                    json.dump({"copy_bw": bw, "rows": rows}, f, indent=1)
    print("\n".join(table(rows) + distribution_lines(rows)))
    plot(rows, os.path.join(args.out, "bench_grouped.png"),
         f"fp4_grouped_mm and its peers on {torch.cuda.get_device_name()} (bench_grouped.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
