"""Native backends on a GPU without FP4 tensor cores (the H200, SM90): every FlashInfer backend, sgl-kernel and
torch:scaled_mm must be refused with the library's own reason, quickly, and fp4_mm must still return the right
result through a working backend.

Run (with FlashInfer importable, e.g. the .carry/ bundle on PYTHONPATH):
    FP4DISPATCH_CACHE_DIR=/tmp/fp4c python3 benchmarks/h200_native_report.py
"""
from __future__ import annotations

import time

import torch

NATIVE_PREFIXES = ("flashinfer:", "sgl_kernel:", "torch:")


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    p = torch.cuda.get_device_properties(dev)
    print(f"GPU: {p.name} (SM{p.major}{p.minor}), torch {torch.__version__} (CUDA {torch.version.cuda})")

    t = time.perf_counter()
    try:
        import flashinfer

        print(f"flashinfer {flashinfer.__version__} imported in {time.perf_counter() - t:.2f} s")
    except Exception as e:  # noqa: BLE001 - the report below shows the same failure as a reason
        print(f"flashinfer import failed after {time.perf_counter() - t:.2f} s: {type(e).__name__}: {e}")

    import fp4dispatch
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.problem import Operands, Problem
    from fp4dispatch.dispatch.verify import check_output

    d = Dispatcher()
    t = time.perf_counter()
    recs = d.report(dev)
    t_all = time.perf_counter() - t
    health = d.cache_for(dev).health
    print(f"\nDispatcher().report() on {dev} (probing every backend took {t_all:.2f} s):")
    for r in recs:
        secs = health.get(r.name, {}).get("seconds", float("nan"))
        print(f"  {r.name:32s} {r.status:12s} {secs:7.4f} s  {r.reason}")
    native = [r for r in recs if r.name.startswith(NATIVE_PREFIXES)]
    t_native = sum(health[r.name]["seconds"] for r in native)
    refused = [r for r in native if r.status == "unavailable" and r.reason]
    print(f"native backends: {len(native)}, refused with a reason: {len(refused)}, "
          f"their probing took {t_native * 1e3:.1f} ms in all (goal < 1000 ms)")

    # what FlashInfer itself raises when asked for each backend here
    try:
        import flashinfer

        a = torch.zeros(16, 256, dtype=torch.uint8, device=dev)
        b = torch.zeros(256, 256, dtype=torch.uint8, device=dev)
        sa = torch.zeros(128, 32, dtype=torch.uint8, device=dev)
        sb = torch.zeros(256, 32, dtype=torch.uint8, device=dev)
        alpha = torch.ones(1, dtype=torch.float32, device=dev)
        print("\nflashinfer.mm_fp4(..., backend=X) itself on this GPU:")
        for r in recs:
            if r.name.startswith("flashinfer:"):
                name = r.name.split(":", 1)[1]
                try:
                    flashinfer.mm_fp4(a, b.T, sa, sb.T, alpha, torch.bfloat16, backend=name)
                    print(f"  {name:22s} ran (unexpected on SM90)")
                except Exception as e:  # noqa: BLE001
                    print(f"  {name:22s} {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    except Exception as e:  # noqa: BLE001
        print(f"(flashinfer not importable: {type(e).__name__}: {e})")

    print("\nfp4_mm through the default dispatcher (quantize_nvfp4 inputs, vs the exact reference):")
    fp4dispatch.set_dispatcher(d)
    g = torch.Generator(device=dev).manual_seed(0)
    for m, n, k in ((1, 2048, 4096), (300, 4096, 4096)):
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16)
        a, sa, gsa = fp4dispatch.quantize_nvfp4(x)
        b, sb, gsb = fp4dispatch.quantize_nvfp4(w)
        alpha = (1.0 / (gsa * gsb)).float()
        t = time.perf_counter()
        out = fp4dispatch.fp4_mm(a, b, sa, sb, alpha)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        problem = Problem(m, n, k, torch.bfloat16, dev)
        ref = reference_mm(problem, Operands(a, b, sa, sb, alpha, out))
        bad = check_output(out, ref, problem)
        err = float((out.float() - ref).norm() / ref.norm())
        chosen = d.choose(problem).backend.name
        print(f"  M={m} N={n} K={k}: backend {chosen}, rel err {err:.2e}, "
              f"{'correct' if bad is None else 'WRONG: ' + bad} (first call incl. tuning {first:.2f} s)")

    # torch._scaled_mm's own answer on SM90 (last: it is a cuBLASLt status error, not a kernel fault)
    try:
        fp4 = torch.float4_e2m1fn_x2
        a = torch.zeros(128, 32, dtype=torch.uint8, device=dev).view(fp4)
        b = torch.zeros(128, 32, dtype=torch.uint8, device=dev).view(fp4)
        s = torch.ones(128 * 4, device=dev).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, b.t(), s, s, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        print("\ntorch._scaled_mm fp4 ran on this GPU")
    except Exception as e:  # noqa: BLE001
        print(f"\ntorch._scaled_mm fp4 itself on this GPU: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
