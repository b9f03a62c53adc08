"""CUDA graphs: decide (and run) shapes before capture, so that a captured ``fp4_mm`` is one dict lookup plus
the chosen kernel.

During capture the dispatcher never probes, tunes or synchronizes: a key with no decision reuses the nearest M
bucket's decision, else the first healthy backend in priority order, and logs once. What a captured call may still
allocate, and how to avoid it:

* ``out``: pass a preallocated ``out=`` (else it is allocated from the graph's private pool, which is fine too);
* ``alpha``: pass a float32 device tensor. A Python float becomes a new device tensor on every call, and
  ``alpha=None`` uses a per-device ones-tensor created on first use (``warmup(run=True)`` creates it);
* scales: pass them swizzled (``scale_layout="linear"`` swizzles into a new tensor on every call);
* split-K counters of the Triton kernels: ``warmup`` creates them for ``torch.cuda.graph``'s default capture stream;
  a graph captured on another stream (``torch.cuda.graph(g, stream=s)``) should call
  ``fp4dispatch.kernels.workspace.prepare(device, s)`` first, else each captured split-K launch adds a small memset.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .errors import InvalidInputError
from .format import BLOCK

__all__ = ["warmup"]

log = logging.getLogger("fp4dispatch")


def _check_shapes(shapes) -> list[tuple[int, int, int]]:
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
        raise InvalidInputError(f"warmup: shapes must be a list of (M, N, K) triples; got {shapes!r}. Pass e.g. "
                                f"[(1, 4096, 4096), (128, 4096, 4096)]")
    out = []
    for s in shapes:
        ok = isinstance(s, (tuple, list)) and len(s) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in s)
        if not ok or s[2] % BLOCK:
            raise InvalidInputError(
                f"warmup: shapes must be (M, N, K) triples of positive ints with K % {BLOCK} == 0; got {s!r}. "
                f"Pass e.g. [(1, 4096, 4096), (128, 4096, 4096)]")
        out.append((int(s[0]), int(s[1]), int(s[2])))
    return out


def warmup(shapes: Iterable[tuple[int, int, int]], *, out_dtype: torch.dtype = torch.bfloat16, device=None,
           run: bool = True, dispatcher=None, activations: torch.dtype | None = None, experts: int = 0
           ) -> dict[tuple[int, int, int], str]:
    """Decide every ``(M, N, K)`` of ``shapes`` now (probe the device once, compile the kernels of all new keys at
    once, then tune each new key), before capture.

    Args:
        shapes: the (M, N, K) of every call the graph will contain (every M bucket a graph uses).
        out_dtype: output dtype of those calls.
        device: the CUDA device (default: the current one; CPU when there is no GPU).
        run: also run each shape once on random data, so that Triton JIT compilation, library handles and the
            guard-mode flags are created now rather than inside the capture.
        dispatcher: default: the process-wide dispatcher (the one ``fp4dispatch.fp4_mm`` uses).
        activations: None for ``fp4_mm`` calls (NVFP4 activations); torch.bfloat16 or torch.float16 for
            ``w4a16_mm`` calls with activations of that dtype (what ``Fp4Linear(mode="auto")`` runs on GPUs without
            FP4 tensor cores).
        experts: E > 0 for ``fp4_grouped_mm`` calls (a MoE projection of E experts; ``w4a16_grouped_mm`` with
            ``activations``): each shape is then ``(T, N, K)``, T the routed rows of all experts (every T bucket the
            graph uses); the run uses a check routing (an expert without rows). One decision serves every routing
            of its T bucket.

    Returns:
        ``{(M, N, K): backend name}`` of the decisions.

    Raises:
        InvalidInputError: shapes is not a list of (M, N, K) triples of positive ints with K % 16 == 0, out_dtype
            is not bf16/fp16/fp32 (checked before any key is made or cached), device is not a CPU or CUDA device
            here, dispatcher is not a Dispatcher, or this is called during CUDA graph capture.
    """
    from .api import get_dispatcher
    from .devices import resolve_device
    from .dispatch.dispatcher import check_dispatcher
    from .dispatch.verify import random_grouped_operands, random_operands

    from .problem import OUT_DTYPES

    todo = _check_shapes(shapes)
    if out_dtype not in OUT_DTYPES:  # checked before any key is made: a bad one must not reach the disk cache
        raise InvalidInputError(f"warmup: out_dtype must be one of torch.bfloat16, torch.float16, torch.float32 (the "
                                f"out_dtype of the calls to warm up); got {out_dtype!r}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InvalidInputError("warmup: called during CUDA graph capture; call it before torch.cuda.graph(...) "
                                "(deciding a shape may tune, which synchronizes)")
    if activations not in (None, torch.bfloat16, torch.float16):
        raise InvalidInputError(f"warmup: activations must be None (fp4_mm), torch.bfloat16 or torch.float16 "
                                f"(w4a16_mm); got {activations!r}")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise InvalidInputError(f"warmup: experts must be 0 (dense calls) or the E > 0 of fp4_grouped_mm / "
                                f"w4a16_grouped_mm calls; got experts={experts!r}")
    check_dispatcher("warmup", dispatcher, "the process-wide one, which fp4_mm uses",
                     "Pass the dispatcher your calls go through, or leave it out")
    d = dispatcher if dispatcher is not None else get_dispatcher()
    dev = resolve_device(device, "warmup")
    choices = d.warmup(todo, out_dtype=out_dtype, device=dev, activations=activations or torch.uint8, experts=experts)
    if run:
        for i, (m, n, k) in enumerate(todo):
            if experts:
                a, b, sa, sb, alpha, offs = random_grouped_operands(m, experts, n, k, dev, seed=i)
                if activations is None:
                    d.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out_dtype=out_dtype)
                else:
                    x = torch.randn(m, k, device=dev).to(activations)
                    d.w4a16_grouped_mm(x, b, sb, alpha, offs, out_dtype=out_dtype)
                continue
            a, b, sa, sb, alpha = random_operands(m, n, k, dev, seed=i)
            # the first run uses alpha=None so that validate's per-device ones-tensors exist before capture
            if activations is None:
                d.fp4_mm(a, b, sa, sb, None if i == 0 else alpha, out_dtype=out_dtype)
            else:
                x = torch.randn(m, k, device=dev).to(activations)
                d.w4a16_mm(x, b, sb, None if i == 0 else alpha, out_dtype=out_dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    if dev.type == "cuda":
        from .kernels import workspace

        workspace.prepare_capture(dev)
    result = {s: c.backend.name for s, c in choices.items()}
    log.info("fp4dispatch: warmed up %s", result)
    return result

