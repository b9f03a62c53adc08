"""Input contract of ``fp4_mm`` and ``w4a16_mm``: every user-input error is raised here, with argument, expected, got
and a fix.

The common case (everything right) costs a handful of attribute reads; messages are only built on failure.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch._subclasses.fake_tensor import is_fake

from .errors import InvalidInputError
from .format import (BLOCK, SCALE_LAYOUTS, as_e4m3, as_packed_uint8, packed_dtype, swizzle_scales,
                     swizzled_scale_shape)
from .problem import OUT_DTYPES, Operands, Problem

__all__ = ["check_fp4_mm_args", "check_w4a16_mm_args", "check_alpha"]

_ONES: dict[torch.device, torch.Tensor] = {}


def _fail(msg: str) -> InvalidInputError:
    return InvalidInputError("fp4_mm: " + msg)


def _check_packed(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(f"{name} must be a torch.Tensor of packed NVFP4 data; got {type(t).__name__}")
    if t.dtype != torch.uint8:
        try:
            t = as_packed_uint8(t, name)
        except InvalidInputError as e:
            raise _fail(str(e)) from None
    if t.dim() != 2:
        rows = "M" if name == "a" else "N"
        raise _fail(f"{name} must be 2-D [{rows}, K/2] packed NVFP4; got {name}.shape={tuple(t.shape)}")
    return t


def _check_b_layout(a: torch.Tensor, b: torch.Tensor) -> None:
    k2 = a.shape[1]
    if b.shape[1] == k2:
        return
    # only a transposed *view* ([K/2, N] with strides (1, K/2)) is surely FlashInfer's b.T: a contiguous b whose
    # first dim happens to equal K/2 (N == K/2) is as likely a weight of another K
    if b.shape[0] == k2 and b.stride() == (1, k2) and b.shape[1] > 1:
        raise _fail(
            f"b must be [N, K/2] (the nn.Linear weight layout); got b.shape={tuple(b.shape)} with strides "
            f"{b.stride()}: the transposed view [K/2, N] = FlashInfer's b.T. fp4_mm takes the weight "
            f"untransposed: pass `b.T` (or the original [N, K/2] weight), and its scale likewise"
        )
    hint = " (if b is a transposed [K/2, N] weight, pass the [N, K/2] one)" if b.shape[0] == k2 else ""
    raise _fail(f"b.shape[1] (K/2) must equal a.shape[1]={k2}: a and b disagree on K; got a.shape="
                f"{tuple(a.shape)}, b.shape={tuple(b.shape)}{hint}")


def _check_b_contiguous(b: torch.Tensor) -> None:
    # b.contiguous() of a transposed view is a transposed weight, which would be multiplied silently: not the fix
    if not b.is_contiguous():
        hint = " It is a transposed view: pass the contiguous [N, K/2] weight itself" if b.T.is_contiguous() else (
            " Call b.contiguous()")
        raise _fail(f"b must be contiguous [N, K/2]; got strides {b.stride()} for shape {tuple(b.shape)}.{hint}")


def _check_scale(s: object, name: str, rows: int, k: int, rows_name: str, layout: str, device) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise _fail(f"{name} must be a float8_e4m3fn tensor of block scales; got {type(s).__name__}")
    if s.dtype != torch.float8_e4m3fn:
        try:
            s = as_e4m3(s, name)
        except InvalidInputError as e:
            raise _fail(str(e)) from None
    sw = swizzled_scale_shape(rows, k)
    lin = (rows, k // BLOCK)
    shape = tuple(s.shape)
    if layout == "swizzled":
        if shape == sw:
            pass
        elif s.dim() == 1 and s.numel() == sw[0] * sw[1]:
            s = s.view(sw)
        else:
            hint = " It has the linear layout's shape: pass scale_layout='linear'." if shape == lin else ""
            raise _fail(
                f"{name} with scale_layout='swizzled' must have shape {sw} = (round_up({rows_name}={rows},128), "
                f"round_up(K/16={k // BLOCK},4)) or that many elements flattened; got {name}.shape={shape}.{hint}"
            )
    elif shape != lin:
        hint = (
            " It has the swizzled layout's shape: pass scale_layout='swizzled'."
            if shape == sw or (s.dim() == 1 and s.numel() == sw[0] * sw[1])
            else ""
        )
        raise _fail(f"{name} with scale_layout='linear' must have shape {lin} = ({rows_name}, K/16); "
                    f"got {name}.shape={shape}.{hint}")
    if s.device != device:
        raise _fail(f"{name} must be on {device} like a; got {name}.device={s.device}. "
                    f"Move it with .to({str(device)!r})")
    if not s.is_contiguous():
        raise _fail(f"{name} must be contiguous; got strides {s.stride()} for shape {shape}. Call .contiguous()")
    if layout == "linear":
        s = swizzle_scales(s)
    return s


# what each call's alpha is (formula, what it is), as its messages say: W4A16's is the weight's decode global scale
ALPHA_IS = {"fp4_mm": ("1/(gs_a*gs_b)", ""), "fp4_grouped_mm": ("1/(gs_a*gs_b[e])", ""),
            "w4a16_mm": ("1/gs_b", " (the weight's decode global scale, e.g. ModelOpt's weight_scale_2)"),
            "w4a16_grouped_mm": ("1/gs_b[e]", " (each expert's weight decode global scale, e.g. its weight_scale_2)")}


def _check_alpha(alpha: object, device: torch.device, call: str = "fp4_mm") -> torch.Tensor:
    """``call``'s alpha as a float32 tensor on ``device``. The messages name ``call`` and its alpha but begin
    ``fp4_mm:``, as every check here does (the other calls' checks put their own name first)."""
    if alpha is None:
        one = _ONES.get(device)
        if one is None:
            one = torch.ones(1, dtype=torch.float32, device=device)
            # a tensor made during CUDA-graph capture lives in the graph's pool and is only filled on replay
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                _ONES[device] = one
        return one
    if isinstance(alpha, numbers.Real) and not isinstance(alpha, bool):  # Python and NumPy scalars
        try:
            value = float(alpha)
            too_big = math.isfinite(value) and abs(value) > _F32_MAX
        except OverflowError:  # an int past the float range
            value, too_big = math.nan, True
        if too_big:
            text = repr(alpha) if len(repr(alpha)) <= 24 else repr(alpha)[:20] + "..."
            raise _fail(f"alpha={text} does not fit in float32 (largest {_F32_MAX:.4g}); alpha is "
                        f"{''.join(ALPHA_IS[call])} and is normally far smaller: check the global scales")
        return torch.full((1,), value, dtype=torch.float32, device=device)
    if not isinstance(alpha, torch.Tensor):
        raise _fail(f"alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got "
                    f"{_type_name(alpha)}")
    if alpha.dtype != torch.float32:
        raise _fail(
            f"alpha must be float32; got dtype={alpha.dtype}. Compute {''.join(ALPHA_IS[call])} in float32 (a bf16 "
            f"global scale gave silently wrong outputs in FlashInfer #3398); {call} never converts it for you"
        )
    if alpha.numel() != 1:
        raise _fail(f"alpha must have exactly one element (a per-tensor scale); got alpha.shape={tuple(alpha.shape)}")
    if alpha.device != device:
        raise _fail(f"alpha must be on {device} like a; got alpha.device={alpha.device}")
    return alpha


def check_alpha(alpha: object, device: torch.device, call: str) -> torch.Tensor:
    """``alpha`` checked as ``call`` checks it (its messages begin ``call:``) and made a float32 tensor on ``device``:
    what a traced call runs before its custom op, whose schema cannot carry a Python alpha."""
    try:
        return _check_alpha(alpha, device, call)
    except InvalidInputError as e:
        raise InvalidInputError(f"{call}: " + str(e).removeprefix("fp4_mm: ")) from None


_U8, _E4M3, _F32 = torch.uint8, torch.float8_e4m3fn, torch.float32
_new = tuple.__new__
_F32_MAX = torch.finfo(torch.float32).max


def _type_name(x: object) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_fp4_mm_args(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout) -> tuple[Problem, Operands]:
    """Validate an ``fp4_mm`` call and return its canonical (Problem, Operands); raise InvalidInputError."""
    # Fast path for the common, fully canonical call (swizzled 2-D scales, tensor alpha, out given): every
    # attribute is read once and nothing is built (the scale shapes are swizzled_scale_shape written out: two calls
    # cost a tenth of the budget); anything unusual takes the explaining path below.
    try:
        m, k2 = a.shape
        n, bk2 = b.shape
        dev = a.device
        if (scale_layout == "swizzled" and a.dtype is _U8 and b.dtype is _U8 and bk2 == k2 and k2 > 0
                and not k2 % 8 and a_scale.dtype is _E4M3 and b_scale.dtype is _E4M3 and alpha.dtype is _F32
                and out_dtype in OUT_DTYPES
                and a_scale.shape == ((m + 127) // 128 * 128, (k2 // 8 + 3) // 4 * 4)
                and b_scale.shape == ((n + 127) // 128 * 128, (k2 // 8 + 3) // 4 * 4)
                and alpha.numel() == 1
                and b.device == dev and a_scale.device == dev and b_scale.device == dev and alpha.device == dev
                and a.is_contiguous() and b.is_contiguous() and a_scale.is_contiguous() and b_scale.is_contiguous()):
            if out is None:
                out = torch.empty((m, n), dtype=out_dtype, device=dev)
            elif not (out.dtype is out_dtype and out.shape == (m, n) and out.device == dev and out.is_contiguous()
                      and not out.requires_grad and (not out.is_inference() or torch.is_inference_mode_enabled())
                      and not same_start(out, a)):  # a written into out's own bytes
                raise ValueError  # explained by the slow path
            # tuple.__new__: the NamedTuples without their Python-level __new__ (a third of a microsecond each)
            return (_new(Problem, (m, n, 2 * k2, out_dtype, dev, _U8, 0)),
                    _new(Operands, (a, b, a_scale, b_scale, alpha, out)))
    except (AttributeError, ValueError, TypeError):
        pass
    return _check_slow(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout)


def _check_slow(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout) -> tuple[Problem, Operands]:
    if scale_layout not in SCALE_LAYOUTS:
        raise _fail(f"scale_layout must be one of {SCALE_LAYOUTS}; got {scale_layout!r}")
    if out_dtype not in OUT_DTYPES:
        raise _fail(f"out_dtype must be one of torch.bfloat16, torch.float16, torch.float32; got {out_dtype!r}")
    a = _check_packed(a, "a")
    b = _check_packed(b, "b")
    device = a.device
    if b.device != device:
        raise _fail(f"a and b must be on the same device; got a.device={device}, b.device={b.device}")
    _check_b_layout(a, b)
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    if k % BLOCK or k == 0:
        raise _fail(
            f"K=2*a.shape[1]={k} must be a positive multiple of {BLOCK} (one e4m3 scale per 16 values); "
            f"pad K with zeros to a multiple of 16 before quantizing"
        )
    if not a.is_contiguous():
        raise _fail(f"a must be contiguous [M, K/2]; got strides {a.stride()} for shape {tuple(a.shape)}. "
                    f"Call a.contiguous()")
    _check_b_contiguous(b)
    sa = _check_scale(a_scale, "a_scale", m, k, "M", scale_layout, device)
    sb = _check_scale(b_scale, "b_scale", n, k, "N", scale_layout, device)
    al = _check_alpha(alpha, device)
    out = _check_out(out, m, n, out_dtype, device, a=a, b=b, a_scale=sa, b_scale=sb, alpha=al)
    return Problem(m, n, k, out_dtype, device), Operands(a, b, sa, sb, al, out)


def _check_out(out, m: int, n: int, out_dtype: torch.dtype, device: torch.device, **inputs) -> torch.Tensor:
    """A given ``out`` checked (``inputs``: the call's tensors, which it must not overlap), else a new one."""
    if out is None:
        return torch.empty((m, n), dtype=out_dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise _fail(f"out must be a torch.Tensor or None; got {type(out).__name__}")
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype or out.device != device or not out.is_contiguous():
        raise _fail(
            f"out must be a contiguous [M, N]=({m}, {n}) tensor of dtype {out_dtype} on {device}; got "
            f"shape={tuple(out.shape)}, dtype={out.dtype}, device={out.device}, contiguous={out.is_contiguous()}. "
            f"Allocate it with torch.empty(({m}, {n}), dtype={out_dtype}, device={str(device)!r}) or pass out_dtype"
        )
    if out.requires_grad:
        raise _fail("out must not require grad (the op is not differentiable and writes out in place); got "
                    "out.requires_grad=True. Pass out.detach() or a tensor made under torch.no_grad()")
    check_inference_out(out)
    check_out_apart(out, **inputs)
    return out


def _has_data(t: torch.Tensor) -> bool:
    """False for a tensor without data (a fake one, while tracing: its data pointer warns, then raises in later
    torch). A plain tensor is known by its type: ``is_fake`` costs microseconds, and ``same_start`` runs per call."""
    return type(t) is torch.Tensor or not is_fake(t)


def same_start(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors begin at one address (out=a); False for tensors without data (fake ones, while tracing)."""
    if not _has_data(x):
        return False
    try:
        return x.data_ptr() == y.data_ptr()
    except RuntimeError:
        return False


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of the memory ``t`` may touch; None for a tensor without data (a fake
    one, while tracing)."""
    if not _has_data(t):
        return None
    try:
        where = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    first = t.storage_offset() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return where, first, first + (last + 1) * t.element_size()


def check_out_apart(out: torch.Tensor, **inputs: torch.Tensor) -> None:
    """A given ``out`` shares no memory with an input: the kernels write output tiles while other tiles still read
    the inputs, so an in-place call (``out=x``) gave garbage on them, silently (the reference alone read first)."""
    mine = _span(out) if out.numel() else None
    if mine is None:
        return
    where, lo, hi = mine
    for name, t in inputs.items():
        span = _span(t) if t.numel() else None
        if span is not None:
            w, tlo, thi = span
            if w == where and w != 0 and tlo < hi and lo < thi:
                raise _fail(f"out must not share memory with {name}: the backends write out while they still read "
                            f"{name}, so the result would be wrong; got out overlapping {name}'s storage. Pass a "
                            "separate out (or none: one is allocated)")


def check_inference_out(out: torch.Tensor) -> None:
    """An inference tensor (made under ``torch.inference_mode()``) cannot be written in place outside that mode: every
    backend would fail on it. Raises InvalidInputError (``fp4_mm:``; the other calls put their own name first)."""
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise _fail("out was made under torch.inference_mode() and this call runs outside it, where torch lets "
                    "nothing write an inference tensor in place; got out.is_inference()=True. Allocate out outside "
                    "inference_mode, or make the call inside it (with torch.inference_mode(): ...)")


_HALF = (torch.bfloat16, torch.float16)
_BF16, _F16 = torch.bfloat16, torch.float16
_NO_SCALE: dict[torch.device, torch.Tensor] = {}  # w4a16's a_scale: an empty e4m3 tensor per device


def check_w4a16_mm_args(a, b, b_scale, alpha, out_dtype, out, scale_layout) -> tuple[Problem, Operands]:
    """Validate a ``w4a16_mm`` call (``a`` bf16/fp16 [M, K], ``b``/``b_scale``/``alpha``/``out`` as in ``fp4_mm``,
    ``out_dtype`` None = ``a.dtype``) and return its canonical (Problem, Operands); raise InvalidInputError."""
    # Fast path for the canonical call (as check_fp4_mm_args'): every attribute read once, nothing built; anything
    # unusual takes the explaining path below
    try:
        m, k = a.shape
        n, k2 = b.shape
        dev = a.device
        adt = a.dtype
        none = _NO_SCALE.get(dev)
        if (scale_layout == "swizzled" and (adt is _BF16 or adt is _F16) and b.dtype is _U8 and 2 * k2 == k
                and k > 0 and not k % 16 and b_scale.dtype is _E4M3 and alpha.dtype is _F32
                and (out_dtype is None or out_dtype in OUT_DTYPES) and none is not None
                and b_scale.shape == ((n + 127) // 128 * 128, (k // 16 + 3) // 4 * 4) and alpha.numel() == 1
                and b.device == dev and b_scale.device == dev and alpha.device == dev
                and a.is_contiguous() and b.is_contiguous() and b_scale.is_contiguous()):
            odt = adt if out_dtype is None else out_dtype
            if out is None:
                out = torch.empty((m, n), dtype=odt, device=dev)
            elif not (out.dtype is odt and out.shape == (m, n) and out.device == dev and out.is_contiguous()
                      and not out.requires_grad and (not out.is_inference() or torch.is_inference_mode_enabled())
                      and not same_start(out, a)):  # out=a: an in-place layer
                raise ValueError  # explained by the slow path
            return _new(Problem, (m, n, k, odt, dev, adt, 0)), _new(Operands, (a, b, none, b_scale, alpha, out))
    except (AttributeError, ValueError, TypeError):
        pass
    try:
        return _check_w4a16(a, b, b_scale, alpha, out_dtype, out, scale_layout)
    except InvalidInputError as e:  # the checks shared with fp4_mm name fp4_mm
        msg = str(e)
        raise InvalidInputError("w4a16_mm: " + msg.removeprefix("fp4_mm: ")) from None


def _check_w4a16(a, b, b_scale, alpha, out_dtype, out, scale_layout) -> tuple[Problem, Operands]:
    if not isinstance(a, torch.Tensor):
        raise _fail(f"a must be a torch.Tensor of bf16 or fp16 activations [M, K]; got {_type_name(a)}")
    if a.dtype not in _HALF:
        hint = (" It holds packed NVFP4 data: that is fp4_mm's a (with a_scale)" if packed_dtype(a.dtype)
                else " Cast it with a.to(torch.bfloat16)")
        raise _fail(f"a must be bfloat16 or float16 [M, K] (W4A16: activations as they are); got dtype={a.dtype}."
                    f"{hint}")
    if a.dim() != 2:
        raise _fail(f"a must be 2-D [M, K]; got a.shape={tuple(a.shape)}. Flatten the leading dims: "
                    "a.reshape(-1, a.shape[-1])")
    if out_dtype is None:
        out_dtype = a.dtype
    if scale_layout not in SCALE_LAYOUTS:
        raise _fail(f"scale_layout must be one of {SCALE_LAYOUTS}; got {scale_layout!r}")
    if out_dtype not in OUT_DTYPES:
        raise _fail(f"out_dtype must be None (a's dtype), torch.bfloat16, torch.float16 or torch.float32; got "
                    f"{out_dtype!r}")
    b = _check_packed(b, "b")
    device = a.device
    if b.device != device:
        raise _fail(f"a and b must be on the same device; got a.device={device}, b.device={b.device}")
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    if b.shape[1] * 2 != k:
        hint = (" b looks transposed ([K/2, N]): pass the [N, K/2] weight" if b.shape[0] * 2 == k else "")
        raise _fail(f"b must be [N, K/2] with K = a.shape[1] = {k}; got b.shape={tuple(b.shape)} (K/2 = "
                    f"{b.shape[1]}).{hint}")
    if k % BLOCK or k == 0:
        raise _fail(f"K=a.shape[1]={k} must be a positive multiple of {BLOCK} (one e4m3 weight scale per 16 values)")
    if not a.is_contiguous():
        raise _fail(f"a must be contiguous [M, K]; got strides {a.stride()} for shape {tuple(a.shape)}. "
                    "Call a.contiguous()")
    _check_b_contiguous(b)
    sb = _check_scale(b_scale, "b_scale", n, k, "N", scale_layout, device)
    al = _check_alpha(alpha, device, "w4a16_mm")
    out = _check_out(out, m, n, out_dtype, device, a=a, b=b, b_scale=sb, alpha=al)
    return Problem(m, n, k, out_dtype, device, a.dtype), Operands(a, b, no_scale(device), sb, al, out)


def no_scale(device: torch.device) -> torch.Tensor:
    """The empty e4m3 ``a_scale`` of a W4A16 call's canonical operands (one per device, kept outside capture)."""
    none = _NO_SCALE.get(device)
    if none is None:
        none = torch.empty(0, dtype=torch.float8_e4m3fn, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _NO_SCALE[device] = none
    return none
