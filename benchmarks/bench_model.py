"""Tokens per second of a transformers model whose Linear layers are fp4dispatch ``Fp4Linear`` (issue 31), against
the same model in bf16, in one run on this GPU.

The model is a Llama with a real model's layer shapes (default Llama-3.1-8B: hidden 4096, MLP 14336, 32 heads, 8
KV heads; ``--layers`` decoder layers, vocabulary 32000) and random bf16 weights: the bf16 model itself, and copies
whose every decoder Linear is ``Fp4Linear.from_linear(..., mode=M)`` for M in auto (on a GPU without FP4 tensor
cores: W4A16), w4a4 (dynamic activation quantize). The LM head stays bf16 in all of them. A step is
``model(ids [B, S], use_cache=False)``: S = 1 is the per-token work of a decode step (every weight read once) without
the attention over earlier tokens (no KV cache), which the FP4 weights do not change; S > 1 is a prefill. Each step
is timed as a CUDA-graph replay (captured after one eager call, which decides the dispatcher's keys) and as an eager
synced call; tokens/s = B * S / time. ``rel diff`` is the logits' distance from the bf16 model's (quantization, not
a fault).

    export PYTHONPATH=$PWD; python benchmarks/bench_model.py --out $OUT [--layers 8 --steps 1x1,8x1,32x1,1x512]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eager import _eager_us  # noqa: E402  (the same timing method)
from bench_hopper import bench_ms, capture  # noqa: E402

SHAPES = {"llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                               num_key_value_heads=8),
          "llama-3.1-70b-tp8": dict(hidden_size=8192, intermediate_size=3584, num_attention_heads=8,
                                    num_key_value_heads=1)}
MODES = ("bf16", "auto", "w4a4")


def build(shape: str, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def quantized(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    from fp4dispatch.nn import Fp4Linear

    q = copy.deepcopy(model)
    for name, mod in list(q.model.layers.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(q.model.layers.get_submodule(parent), leaf, Fp4Linear.from_linear(mod, mode=mode))
    return q


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", default="1x1,8x1,32x1,1x512", help="B x S per step")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.environ.setdefault("FP4DISPATCH_CACHE_DIR", tempfile.mkdtemp(prefix="fp4c-model-"))
    base = build(args.shape, args.layers)
    models = {"bf16": base, **{m: quantized(base, m) for m in MODES[1:]}}
    resolved = {m: next(x for x in q.modules() if hasattr(x, "resolved_mode")).resolved_mode(torch.device("cuda"))
                for m, q in models.items() if m != "bf16"}
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {args.shape}, {args.layers} layers; "
          f"auto resolves to {resolved['auto']}", flush=True)
    rows = []
    with torch.no_grad():
        for step in args.steps.split(","):
            b, s = (int(v) for v in step.split("x"))
            ids = torch.randint(0, 32000, (b, s), device="cuda", generator=torch.Generator("cuda").manual_seed(b + s))
            ref = base(ids, use_cache=False).logits.float()
            row = {"b": b, "s": s, "graph_us": {}, "eager_us": {}, "rel_diff": {}}
            for mode, model in models.items():
                got = model(ids, use_cache=False).logits.float()  # decides every key of this step before capture
                row["rel_diff"][mode] = float((got - ref).norm() / ref.norm())
                g = capture(lambda model=model: model(ids, use_cache=False))
                row["graph_us"][mode] = bench_ms(g.replay) * 1e3
                row["eager_us"][mode] = _eager_us(lambda i, model=model: model(ids, use_cache=False), 1, n=20)
                del g
            rows.append(row)
            line = " | ".join(f"{m} {b * s / row['graph_us'][m] * 1e6:,.0f} tok/s graph, "
                              f"{b * s / row['eager_us'][m] * 1e6:,.0f} eager, diff {row['rel_diff'][m]:.3f}"
                              for m in models)
            print(f"B={b} S={s}: {line}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"bench_model-{args.shape}.json"), "w") as f:
                json.dump({"shape": args.shape, "layers": args.layers, "resolved": resolved, "rows": rows}, f,
                          indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
