"""``fp4_mm``, ``w4a16_mm`` and the grouped (MoE) ``fp4_grouped_mm`` and ``w4a16_grouped_mm``: the calls. The
whole path of one — validate, decide, run — is ``run_fp4_mm`` below (the other calls take the same steps with
their own checks: the ``Dispatcher`` methods of their names)."""
from __future__ import annotations

import os
import threading

import torch

from .validate import check_alpha, check_fp4_mm_args, check_w4a16_mm_args
from .validate_grouped import check_fp4_grouped_mm_args, check_w4a16_grouped_mm_args

_F32_MAX = torch.finfo(torch.float32).max

__all__ = ["fp4_mm", "w4a16_mm", "fp4_grouped_mm", "w4a16_grouped_mm", "get_dispatcher", "set_dispatcher",
           "run_fp4_mm"]

_default = None
_default_lock = threading.Lock()


def _renew_lock() -> None:  # a fork child: a thread of the parent making the default dispatcher held it
    global _default_lock
    _default_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


def run_fp4_mm(dispatcher, a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend) -> torch.Tensor:
    # 0. a repeat of a call already validated and decided (same weight, M, dtypes, devices, layouts): one C++ check of
    #    its tensors' metadata stands for steps 1 and 2 (fp4dispatch/dispatch/call_memo.py says why it is sound)
    hit = dispatcher.memo.fp4_mm(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend)
    if hit is not None:
        return dispatcher.execute(*hit)
    # 1. validate: every contract error is raised here, naming argument, expected, got and the fix
    problem, ops = check_fp4_mm_args(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout)
    if not (problem.m and problem.n):  # an empty [M, N]: nothing to decide (a backend's name is still checked)
        return dispatcher.empty(problem, ops, backend)
    # 2. decide: one dict lookup once this (device, M bucket, N, K, out_dtype) is decided; the first call of a key
    #    probes the device (once) and tunes the key, both remembered on disk
    choice = dispatcher.choose(problem, backend)
    dispatcher.memo.remember((a, b, a_scale, b_scale, alpha, out), out_dtype, scale_layout, backend, choice, problem,
                             ops)
    # 3. run: a backend that raises is blacklisted for this key and the call is redone on the next best
    return dispatcher.execute(choice, problem, ops)


def fp4_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor | float | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    scale_layout: str = "swizzled",
    backend: str | None = None,
) -> torch.Tensor:
    """``alpha * dequant(a) @ dequant(b).T`` for NVFP4 operands, on the fastest backend proven correct here.

    Args:
        a: packed activations, uint8 (or float4_e2m1fn_x2) [M, K/2], low nibble = even k, contiguous.
        b: packed weight, uint8 [N, K/2] (nn.Linear layout; FlashInfer users: pass ``b`` where they passed ``b.T``).
        a_scale, b_scale: float8_e4m3fn (or uint8) block scales, one per 16 K-elements; swizzled 128x4 and
            zero-padded to (round_up(rows,128), round_up(K/16,4)) (2-D or flattened), or linear [rows, K/16] with
            ``scale_layout="linear"``.
        alpha: float32 1-element tensor (``1/(gs_a*gs_b)``), a Python float, or None (1.0).
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        out: optional preallocated contiguous [M, N] tensor of ``out_dtype``.
        scale_layout: "swizzled" (default) or "linear".
        backend: force one backend by name (see ``get_dispatcher().report()``): not proven per call, so one that is
            unhealthy here or banned from this shape is refused (BackendError).

    Returns:
        [M, N] tensor of ``out_dtype`` (``out`` itself when given).

    Raises:
        InvalidInputError: the call breaks the contract (the message says which argument and how to fix it).
        NoUsableBackendError: no backend can compute this problem (every backend's reason is listed).
        DeviceMemoryError: the device ran out of memory while the backends were checked, timed or run (also a
            ``torch.OutOfMemoryError``; nothing is recorded against them).
    """
    if torch.compiler.is_compiling():
        # traced as one opaque custom op (no graph break); eager stays on the direct path, which is cheaper
        return _traced(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend)
    d = _default  # read once: a set_dispatcher(None) in another thread must not make it None between reads
    if d is None:
        d = get_dispatcher()
    return run_fp4_mm(d, a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend)


def w4a16_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor | float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    scale_layout: str = "swizzled",
    backend: str | None = None,
) -> torch.Tensor:
    """``alpha * a @ dequant(b).T``: bf16/fp16 activations as they are against an NVFP4 weight (W4A16), on the
    fastest backend proven correct here. Where there are no FP4 tensor cores this is both faster and far more
    accurate than quantizing the activations for ``fp4_mm`` (docs/integration.md).

    Args:
        a: activations, bfloat16 or float16 [M, K], contiguous.
        b, b_scale: the NVFP4 weight exactly as in :func:`fp4_mm`.
        alpha: float32 1-element tensor (the weight's decode global scale, ``1/gs_b``), a Python float, or None.
        out_dtype: None (default: ``a.dtype``), torch.bfloat16, torch.float16 or torch.float32.
        out, scale_layout, backend: as in :func:`fp4_mm`.

    Returns:
        [M, N] tensor of ``out_dtype`` (``out`` itself when given).
    """
    if torch.compiler.is_compiling():
        return _traced_w4a16(a, b, b_scale, alpha, out_dtype, out, scale_layout, backend)
    d = _default
    if d is None:
        d = get_dispatcher()
    return d.w4a16_mm(a, b, b_scale, alpha, out_dtype=out_dtype, out=out, scale_layout=scale_layout, backend=backend)


def fp4_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor | float | None,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    scale_layout: str = "swizzled",
    backend: str | None = None,
    check_offs: bool = True,
) -> torch.Tensor:
    """The MoE expert GEMM: ``out[rows of e] = alpha[e] * dequant(a[rows of e]) @ dequant(b[e]).T`` for every expert
    e, on the fastest backend proven correct here.

    Args:
        a: packed NVFP4 rows [T, K/2] (uint8 or float4_e2m1fn_x2), grouped by expert, contiguous.
        b: packed expert weights [E, N, K/2] (each expert in the nn.Linear layout), contiguous.
        a_scale, b_scale: float8_e4m3fn block scales, one per 16 K-elements. ``scale_layout="swizzled"`` (default,
            what native grouped kernels read; docs/contract.md draws it): ``b_scale`` [E, round_up(N,128),
            round_up(K/16,4)] (or [E, that product]), each expert 128x4-swizzled; ``a_scale`` [S, round_up(K/16,4)],
            expert e's rows swizzled as their own matrix from row ``sum_{j<e} round_up(rows_j,128)``
            (``format_grouped.swizzle_grouped_scales``; S = ``grouped_scale_rows(T, E)`` fits any routing).
            ``"linear"``: [T, K/16] and [E, N, K/16].
        alpha: float32 [E] (each expert's ``1/(gs_a*gs_b[e])``), a 1-element tensor, a Python float, or None.
        offs: int32 [E], each expert's cumulative end row (torch ``_grouped_mm``'s convention; an expert may own
            none); ``offs[-1]`` must be T.
        out_dtype, out, backend: as in :func:`fp4_mm` (out is [T, N]).
        check_offs: read ``offs`` on the host (one sync) to check it; off, and always during CUDA-graph capture, a
            bad table cannot make the kernels touch memory outside their tensors, but its result is undefined.

    Returns:
        [T, N] tensor of ``out_dtype`` (``out`` itself when given).
    """
    if torch.compiler.is_compiling():  # as w4a16_mm's (_traced_w4a16); the op's alpha is a tensor, None is 1
        if not isinstance(a, torch.Tensor) or _out_not_of(out, out_dtype) or not isinstance(check_offs, bool):
            check_fp4_grouped_mm_args(a, b, a_scale, b_scale, alpha, offs, out_dtype, out, scale_layout, check_offs,
                                      traced=True)
        al = _traced_alpha(1.0 if alpha is None else alpha, a, "fp4_grouped_mm")
        if out is None:
            return torch.ops.fp4dispatch.fp4_grouped_mm(a, b, a_scale, b_scale, al, offs, out_dtype, scale_layout,
                                                        backend, check_offs)
        torch.ops.fp4dispatch.fp4_grouped_mm_out(a, b, a_scale, b_scale, al, offs, out, scale_layout, backend,
                                                 check_offs)
        return out
    d = _default
    if d is None:
        d = get_dispatcher()
    return d.fp4_grouped_mm(a, b, a_scale, b_scale, alpha, offs, out_dtype=out_dtype, out=out,
                            scale_layout=scale_layout, backend=backend, check_offs=check_offs)


def w4a16_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    alpha: torch.Tensor | float | None,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    scale_layout: str = "swizzled",
    backend: str | None = None,
    check_offs: bool = True,
) -> torch.Tensor:
    """The MoE expert GEMM with bf16/fp16 activations as they are (W4A16): ``out[rows of e] = alpha[e] *
    a[rows of e] @ dequant(b[e]).T``. Where there are no FP4 tensor cores this is as accurate as bf16 experts on the
    decoded weights, unlike :func:`fp4_grouped_mm`, whose activations are NVFP4.

    Args:
        a: activations, bfloat16 or float16 [T, K], the routed rows grouped by expert, contiguous.
        b, b_scale, offs, scale_layout, backend, check_offs: as in :func:`fp4_grouped_mm`.
        alpha: float32 [E] (each expert's weight decode scale ``1/gs_b[e]``), one element, a float, or None (1).
        out_dtype: None (default: ``a.dtype``), torch.bfloat16, torch.float16 or torch.float32. out: [T, N].
    """
    if torch.compiler.is_compiling():  # as w4a16_mm's (_traced_w4a16); the op's alpha is a tensor, None is 1
        if (not isinstance(a, torch.Tensor) or _out_not_of(out, a.dtype if out_dtype is None else out_dtype)
                or not isinstance(check_offs, bool)):
            check_w4a16_grouped_mm_args(a, b, b_scale, alpha, offs, out_dtype, out, scale_layout, check_offs,
                                        traced=True)
        al, a = _traced_alpha(1.0 if alpha is None else alpha, a, "w4a16_grouped_mm"), a.detach()
        if out is None:
            return torch.ops.fp4dispatch.w4a16_grouped_mm(a, b, b_scale, al, offs, out_dtype, scale_layout, backend,
                                                          check_offs)
        torch.ops.fp4dispatch.w4a16_grouped_mm_out(a, b, b_scale, al, offs, out, scale_layout, backend, check_offs)
        return out
    d = _default
    if d is None:
        d = get_dispatcher()
    return d.w4a16_grouped_mm(a, b, b_scale, alpha, offs, out_dtype=out_dtype, out=out, scale_layout=scale_layout,
                              backend=backend, check_offs=check_offs)


def _traced(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend) -> torch.Tensor:
    """``fp4_mm``'s arguments -> the matching custom op of fp4dispatch/torch_ops.py (registered when the package is
    imported): the functional op, or the one that writes ``out``."""
    if isinstance(alpha, torch.Tensor) or alpha is None:
        at, av = alpha if alpha is None else alpha.detach(), 1.0
    elif isinstance(alpha, (float, int)) and not isinstance(alpha, bool):
        at, av = None, float(alpha)
    elif _is_numpy_number(alpha):
        at, av = _traced_alpha(alpha, a, "fp4_mm"), 1.0
    else:  # raises eager's message (a NumPy array's only through check_alpha: Dynamo cannot read its dtype)
        if type(alpha).__module__ == "numpy":
            check_alpha(alpha, a.device, "fp4_mm")
        check_fp4_mm_args(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout)
        at, av = alpha, 1.0
    if out is None:
        return torch.ops.fp4dispatch.fp4_mm(a, b, a_scale, b_scale, at, av, out_dtype, scale_layout, backend)
    if _out_not_of(out, out_dtype):
        # the out op takes its dtype from out: a mismatch must fail with eager's message, not silently
        check_fp4_mm_args(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout)
    torch.ops.fp4dispatch.fp4_mm_out(a, b, a_scale, b_scale, at, av, out, scale_layout, backend)
    return out


def _traced_w4a16(a, b, b_scale, alpha, out_dtype, out, scale_layout, backend) -> torch.Tensor:
    """``w4a16_mm``'s arguments -> its custom op. The op's alpha is a tensor or None, and its out variant takes the
    out dtype from ``out``: what it cannot carry or would not see (another alpha, a float past float32, an ``out`` of
    another dtype than the call's) fails here, at trace time, with eager's message."""
    if not isinstance(a, torch.Tensor):
        check_w4a16_mm_args(a, b, b_scale, alpha, out_dtype, out, scale_layout)  # raises eager's message
    al, a = _traced_alpha(alpha, a, "w4a16_mm"), a.detach()  # no autograd history, as eager (_traced_alpha)
    if out is None:
        return torch.ops.fp4dispatch.w4a16_mm(a, b, b_scale, al, out_dtype, scale_layout, backend)
    if _out_not_of(out, a.dtype if out_dtype is None else out_dtype):
        check_w4a16_mm_args(a, b, b_scale, alpha, out_dtype, out, scale_layout)  # raises eager's message
    torch.ops.fp4dispatch.w4a16_mm_out(a, b, b_scale, al, out, scale_layout, backend)
    return out


def _out_not_of(out, dtype: torch.dtype) -> bool:
    """A traced call's ``out`` that its out op would take without a word (the op's dtype is out's): one that is not
    a tensor of the call's dtype goes to eager's check, which raises its message."""
    return out is not None and (not isinstance(out, torch.Tensor) or out.dtype != dtype)


def _traced_alpha(alpha, a: torch.Tensor, call: str) -> torch.Tensor | None:
    """A traced call's alpha as its custom op takes it, a tensor (None stays None): a Python number that fits float32
    becomes a float32 tensor on ``a``'s device; anything else goes through eager's check, which raises its message
    (a bool, a str, a number past float32) or makes the tensor of what eager takes (NaN, inf); a NumPy number, as
    Dynamo holds it, is ``_is_numpy_number``'s.
    Detached: the ops have no autograd formula, and a traced result carries no autograd history, as eager's (an input
    that requires grad must not make AOTAutograd trace a backward through them)."""
    if alpha is None or isinstance(alpha, torch.Tensor):
        return alpha if alpha is None else alpha.detach()
    if isinstance(alpha, (float, int)) and not isinstance(alpha, bool) and abs(alpha) <= _F32_MAX:
        return torch.full((1,), float(alpha), dtype=torch.float32, device=a.device)
    if _is_numpy_number(alpha):
        return torch.as_tensor(alpha, dtype=torch.float32, device=a.device).reshape(1)
    return check_alpha(alpha, a.device, call)


def _is_numpy_number(alpha) -> bool:
    """A NumPy number, which eager takes as a float, as Dynamo holds it: a 0-d ndarray whose value the trace cannot
    read (``float()`` of it is unsupported), so it goes to the op as a float32 tensor, unchecked. A value past float32
    becomes inf there, as a float32 tensor alpha of inf would (eager refuses the number itself)."""
    return type(alpha).__module__ == "numpy" and getattr(alpha, "ndim", None) == 0


def get_dispatcher():
    """The process-wide default :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher` (created on first use)."""
    global _default
    d = _default  # read once, as in the calls: set_dispatcher(None) in another thread may run at any time
    if d is None:
        with _default_lock:
            d = _default
            if d is None:
                from .dispatch.dispatcher import Dispatcher

                d = _default = Dispatcher()
    return d


def set_dispatcher(dispatcher) -> None:
    """Replace the process-wide default dispatcher (None: a fresh one is made on next use). InvalidInputError for
    anything else than a Dispatcher: the next call anywhere in the process would fail on it, far from here."""
    global _default
    from .dispatch.dispatcher import check_dispatcher

    check_dispatcher("set_dispatcher", dispatcher, "a fresh one on next use", "Pass e.g. Dispatcher(cache_dir=...)")
    with _default_lock:
        _default = dispatcher
