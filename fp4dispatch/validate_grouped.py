"""Input contract of ``fp4_grouped_mm``: every user-input error is raised here, with argument, expected, got and a
fix; the common case costs attribute reads and, unless ``check_offs=False``, one copy of ``offs`` to the host."""
from __future__ import annotations

import torch

from .devices import check_device
from .errors import InvalidInputError
from .format import BLOCK, SCALE_LAYOUTS, as_e4m3, as_packed_uint8, packed_dtype
from .format_grouped import grouped_scale_rows, scale_starts, swizzle_expert_scales, swizzle_grouped_scales
from .problem import OUT_DTYPES, GroupedOperands, Problem
from .validate import _HALF, ALPHA_IS, _check_alpha, _type_name, check_inference_out, check_out_apart, no_scale

__all__ = ["check_fp4_grouped_mm_args", "check_w4a16_grouped_mm_args", "check_offs_values"]


def _fail(msg: str) -> InvalidInputError:
    return InvalidInputError("fp4_grouped_mm: " + msg)


def _packed(t: object, name: str, dims: int, shape: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(f"{name} must be a torch.Tensor of packed NVFP4 data {shape}; got {_type_name(t)}")
    if t.dtype != torch.uint8:
        try:
            t = as_packed_uint8(t, name)
        except InvalidInputError as e:
            raise _fail(str(e)) from None
    if t.dim() != dims:
        hint = (" A 2-D weight is one expert: fp4_mm takes it, or pass b.unsqueeze(0) for E=1"
                if name == "b" and t.dim() == 2 else "")
        raise _fail(f"{name} must be {dims}-D {shape} packed NVFP4; got {name}.shape={tuple(t.shape)}.{hint}")
    if not t.is_contiguous():
        # b.contiguous() of a transposed view (torch's scaled_grouped_mm takes b.transpose(-2, -1)) is a transposed
        # weight, multiplied silently where N == K/2: not the fix
        fix = (f"It is a transposed view: pass the contiguous {shape.split(' (')[0]} weight itself, not "
               f"{name}.contiguous() (that is the transposed weight)"
               if name == "b" and t.transpose(-2, -1).is_contiguous() else f"Call {name}.contiguous()")
        raise _fail(f"{name} must be contiguous {shape}; got strides {t.stride()} for shape {tuple(t.shape)}. {fix}")
    return t


def _k_hint(b: torch.Tensor, k2: int) -> str:
    """What a K mismatch may be: the weights stored transposed, [E, K/2, N]."""
    return (" (if b holds each expert's weight transposed, [E, K/2, N], pass the [E, N, K/2] one)"
            if b.shape[1] == k2 else "")


def _offs(offs: object, e: int, device: torch.device) -> torch.Tensor:
    if not isinstance(offs, torch.Tensor):
        raise _fail(f"offs must be an int32 tensor [E] of each expert's cumulative end row (torch._grouped_mm's "
                    f"convention); got {_type_name(offs)}")
    if offs.dtype != torch.int32:
        raise _fail(f"offs must be int32; got dtype={offs.dtype}. Convert it with offs.to(torch.int32)")
    if offs.dim() != 1 or offs.numel() != e:
        raise _fail(f"offs must be 1-D [E] with E = b.shape[0] = {e} (one cumulative end row per expert); got "
                    f"offs.shape={tuple(offs.shape)}. If it has E+1 entries starting with 0 (a start-offset "
                    "table), pass offs[1:]")
    if offs.device != device:
        raise _fail(f"offs must be on {device} like a; got offs.device={offs.device}. Move it with "
                    f".to({str(device)!r})")
    if not offs.is_contiguous():
        raise _fail("offs must be contiguous; call offs.contiguous()")
    return offs


def _scale(s: object, name: str, lin: tuple, layout: str, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise _fail(f"{name} must be a float8_e4m3fn tensor of block scales; got {_type_name(s)}")
    if s.dtype != torch.float8_e4m3fn:
        try:
            s = as_e4m3(s, name)
        except InvalidInputError as e:
            raise _fail(str(e)) from None
    if s.device != device:
        raise _fail(f"{name} must be on {device} like a; got {name}.device={s.device}. Move it with "
                    f".to({str(device)!r})")
    if not s.is_contiguous():
        raise _fail(f"{name} must be contiguous; got strides {s.stride()} for shape {tuple(s.shape)}. Call "
                    f"{name}.contiguous()")
    if layout == "linear" and tuple(s.shape) != lin:
        raise _fail(f"{name} with scale_layout='linear' must have shape {lin} = {what}; got {name}.shape="
                    f"{tuple(s.shape)}")
    return s


def _check_flag(check_offs: object) -> None:
    if not isinstance(check_offs, bool):
        raise _fail(f"check_offs must be True (offs read on the host and checked: one sync) or False (not read: no "
                    f"sync; a swizzled a_scale then needs grouped_scale_rows(T, E) rows); got {check_offs!r}")


def check_offs_values(offs: torch.Tensor, t: int, scale_rows: int | None) -> None:
    """The routing table itself (one copy to the host): non-decreasing, from 0 to T, and (swizzled ``a_scale`` of
    ``scale_rows`` rows) rows enough for its padded expert blocks."""
    check_device(offs.device, "fp4_grouped_mm")  # a meta table has no values to read (a raw NotImplementedError)
    v = offs.tolist()
    first_bad = next((i for i in range(len(v)) if v[i] < (v[i - 1] if i else 0)), None)
    if first_bad is not None:
        prev = f"offs[{first_bad - 1}]={v[first_bad - 1]}" if first_bad else "0"
        raise _fail(f"offs must be non-decreasing cumulative end rows starting at >= 0; got offs[{first_bad}]="
                    f"{v[first_bad]} < {prev}. Build it as torch.cumsum(rows_per_expert, 0).to(torch.int32)")
    if v and v[-1] != t:
        raise _fail(f"offs[-1] must equal T = a.shape[0] = {t} (every row belongs to an expert); got offs[-1]="
                    f"{v[-1]}. Pass the routed rows of all experts and nothing else, or fix the counts")
    if scale_rows is not None:
        need = int(scale_starts(offs)[-1])
        if scale_rows < need:
            raise _fail(f"a_scale (swizzled) has {scale_rows} rows; this routing needs {need} (each expert's rows "
                        f"padded to a multiple of 128). Allocate grouped_scale_rows(T, E) = "
                        f"{grouped_scale_rows(t, len(v))} rows, which hold any routing")


def check_fp4_grouped_mm_args(a, b, a_scale, b_scale, alpha, offs, out_dtype, out, scale_layout,
                              check_offs: bool = True, traced: bool = False) -> tuple[Problem, GroupedOperands]:
    """Validate an ``fp4_grouped_mm`` call and return its canonical (Problem, GroupedOperands). ``traced``: ``offs``
    holds no values here (a custom op's fake), so only what needs none is checked; the op reads them when it runs."""
    _check_flag(check_offs)
    if scale_layout not in SCALE_LAYOUTS:
        raise _fail(f"scale_layout must be one of {SCALE_LAYOUTS}; got {scale_layout!r}")
    if out_dtype not in OUT_DTYPES:
        raise _fail(f"out_dtype must be one of torch.bfloat16, torch.float16, torch.float32; got {out_dtype!r}")
    a = _packed(a, "a", 2, "[T, K/2] (the routed rows of all experts, grouped by expert)")
    b = _packed(b, "b", 3, "[E, N, K/2] (each expert's weight in the nn.Linear layout)")
    dev = a.device
    if b.device != dev:
        raise _fail(f"a and b must be on the same device; got a.device={dev}, b.device={b.device}")
    (t, k2), (e, n, bk2) = a.shape, b.shape
    if bk2 != k2:
        raise _fail(f"b.shape[2] (K/2) must equal a.shape[1]={k2}; got a.shape={tuple(a.shape)}, "
                    f"b.shape={tuple(b.shape)}{_k_hint(b, k2)}")
    k = 2 * k2
    if k == 0 or k % BLOCK:
        raise _fail(f"K=2*a.shape[1]={k} must be a positive multiple of {BLOCK} (one e4m3 scale per 16 values)")
    if e == 0:
        raise _fail("b must hold at least one expert; got b.shape[0]=0")
    offs = _offs(offs, e, dev)
    cols, cp = k // BLOCK, (k // BLOCK + 3) // 4 * 4
    sa = _scale(a_scale, "a_scale", (t, cols), scale_layout, dev, "(T, K/16)")
    sb = _expert_scales(b_scale, e, n, k, scale_layout, dev)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if scale_layout == "swizzled":
        rows = sa.shape[0] if sa.dim() == 2 else -1
        if sa.dim() != 2 or sa.shape[1] != cp or rows % 128 or rows < (t + 127) // 128 * 128:
            hint = " It has the linear layout's shape: pass scale_layout='linear'." if tuple(sa.shape) == (
                t, cols) else ""
            raise _fail(f"a_scale with scale_layout='swizzled' must be [S, round_up(K/16,4)={cp}] with S a multiple "
                        f"of 128 and >= the rows of the routing's padded expert blocks (grouped_scale_rows(T, E) = "
                        f"{grouped_scale_rows(t, e)} hold any routing; format_grouped.swizzle_grouped_scales "
                        f"builds it); got a_scale.shape={tuple(sa.shape)}.{hint}")
        if (capturing or not check_offs) and rows < grouped_scale_rows(t, e):
            raise _fail(f"a_scale (swizzled) must have grouped_scale_rows(T, E) = {grouped_scale_rows(t, e)} rows "
                        f"when offs is not read on the host (CUDA graph capture or check_offs=False), so that any "
                        f"routing fits; got {rows}")
    else:
        sa = swizzle_grouped_scales(sa, offs)
    if check_offs and not capturing and not traced:  # T = 0 too: its table is all zeros
        check_offs_values(offs, t, sa.shape[0] if scale_layout == "swizzled" else None)
    al = _alpha(alpha, e, dev, "fp4_grouped_mm")
    out = _out(out, t, n, out_dtype, dev, a=a, b=b, a_scale=sa, b_scale=sb, alpha=al, offs=offs)
    return (Problem(t, n, k, out_dtype, dev, torch.uint8, e),
            GroupedOperands(a, b, sa.view(torch.float8_e4m3fn), sb.view(torch.float8_e4m3fn), al, out, offs))


def check_w4a16_grouped_mm_args(a, b, b_scale, alpha, offs, out_dtype, out, scale_layout,
                                check_offs: bool = True, traced: bool = False) -> tuple[Problem, GroupedOperands]:
    """Validate a ``w4a16_grouped_mm`` call (``a`` bf16/fp16 [T, K] as it is; the rest as ``fp4_grouped_mm``'s,
    ``alpha`` None = 1, ``out_dtype`` None = ``a.dtype``) and return its canonical (Problem, GroupedOperands)."""
    try:
        _check_flag(check_offs)
        return _check_w4a16_grouped(a, b, b_scale, alpha, offs, out_dtype, out, scale_layout, check_offs, traced)
    except InvalidInputError as err:  # the checks shared with fp4_grouped_mm name it
        raise InvalidInputError("w4a16_grouped_mm: " + str(err).removeprefix("fp4_grouped_mm: ")) from None


def _check_w4a16_grouped(a, b, b_scale, alpha, offs, out_dtype, out, scale_layout, check_offs, traced):
    if not isinstance(a, torch.Tensor):
        raise _fail(f"a must be a torch.Tensor of bf16 or fp16 activations [T, K] (the routed rows, grouped by "
                    f"expert); got {_type_name(a)}")
    if a.dtype not in _HALF:
        hint = (" It holds packed NVFP4 data: that is fp4_grouped_mm's a (with a_scale)" if packed_dtype(a.dtype)
                else " Cast it with a.to(torch.bfloat16)")
        raise _fail(f"a must be bfloat16 or float16 [T, K] (W4A16: activations as they are); got dtype={a.dtype}."
                    f"{hint}")
    if a.dim() != 2 or not a.is_contiguous():
        raise _fail(f"a must be 2-D contiguous [T, K]; got shape={tuple(a.shape)}, strides={a.stride()}")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if scale_layout not in SCALE_LAYOUTS:
        raise _fail(f"scale_layout must be one of {SCALE_LAYOUTS}; got {scale_layout!r}")
    if out_dtype not in OUT_DTYPES:
        raise _fail(f"out_dtype must be None (a's dtype), torch.bfloat16, torch.float16 or torch.float32; got "
                    f"{out_dtype!r}")
    b = _packed(b, "b", 3, "[E, N, K/2] (each expert's weight in the nn.Linear layout)")
    dev = a.device
    if b.device != dev:
        raise _fail(f"a and b must be on the same device; got a.device={dev}, b.device={b.device}")
    (t, k), (e, n, bk2) = a.shape, b.shape
    if 2 * bk2 != k:
        raise _fail(f"b.shape[2] (K/2) must be a.shape[1]/2 = {k / 2:g}; got a.shape={tuple(a.shape)}, "
                    f"b.shape={tuple(b.shape)}{_k_hint(b, k // 2)}")
    if k == 0 or k % BLOCK:
        raise _fail(f"K=a.shape[1]={k} must be a positive multiple of {BLOCK} (one e4m3 weight scale per 16 values)")
    if e == 0:
        raise _fail("b must hold at least one expert; got b.shape[0]=0")
    offs = _offs(offs, e, dev)
    sb = _expert_scales(b_scale, e, n, k, scale_layout, dev)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_offs and not capturing and not traced:  # T = 0 too: its table is all zeros
        check_offs_values(offs, t, None)
    al = _alpha(alpha, e, dev, "w4a16_grouped_mm")
    out = _out(out, t, n, out_dtype, dev, a=a, b=b, b_scale=sb, alpha=al, offs=offs)
    return (Problem(t, n, k, out_dtype, dev, a.dtype, e),
            GroupedOperands(a, b, no_scale(dev), sb.view(torch.float8_e4m3fn), al, out, offs))


def _expert_scales(b_scale: object, e: int, n: int, k: int, layout: str, dev: torch.device) -> torch.Tensor:
    """``b_scale`` in the swizzled per-expert layout [E, round_up(N,128), round_up(K/16,4)]."""
    cols, cp, rn = k // BLOCK, (k // BLOCK + 3) // 4 * 4, (n + 127) // 128 * 128
    sb = _scale(b_scale, "b_scale", (e, n, cols), layout, dev, "(E, N, K/16)")
    if layout == "linear":
        return swizzle_expert_scales(sb)
    if sb.dim() == 2 and tuple(sb.shape) == (e, rn * cp):  # torch scaled_grouped_mm's flattened experts
        sb = sb.view(e, rn, cp)
    if tuple(sb.shape) != (e, rn, cp):
        hint = " It has the linear layout's shape: pass scale_layout='linear'." if tuple(sb.shape) == (
            e, n, cols) else ""
        raise _fail(f"b_scale with scale_layout='swizzled' must have shape {(e, rn, cp)} = (E, round_up(N={n},"
                    f"128), round_up(K/16={cols},4)), each expert 128x4-swizzled (format_grouped."
                    f"swizzle_expert_scales); got b_scale.shape={tuple(sb.shape)}.{hint}")
    return sb


def _out(out: object, t: int, n: int, out_dtype: torch.dtype, dev: torch.device, **inputs) -> torch.Tensor:
    if out is None:
        return torch.empty((t, n), dtype=out_dtype, device=dev)
    elif not (isinstance(out, torch.Tensor) and tuple(out.shape) == (t, n) and out.dtype == out_dtype
              and out.device == dev and out.is_contiguous() and not out.requires_grad):
        got = (f"shape={tuple(out.shape)}, dtype={out.dtype}, device={out.device}, contiguous={out.is_contiguous()}"
               f", requires_grad={out.requires_grad}" if isinstance(out, torch.Tensor) else _type_name(out))
        raise _fail(f"out must be a contiguous [T, N]=({t}, {n}) tensor of dtype {out_dtype} on {dev} that does not "
                    f"require grad; got {got}. Allocate it with torch.empty(({t}, {n}), dtype={out_dtype}, "
                    f"device={str(dev)!r}) or pass out_dtype")
    try:
        check_inference_out(out)
        check_out_apart(out, **inputs)
    except InvalidInputError as err:
        raise _fail(str(err).removeprefix("fp4_mm: ")) from None
    return out


def _alpha(alpha: object, e: int, dev: torch.device, call: str) -> torch.Tensor:
    if isinstance(alpha, torch.Tensor) and alpha.numel() == e and e > 1:
        if alpha.dtype != torch.float32:
            raise _fail(f"alpha must be float32; got dtype={alpha.dtype}. Compute each expert's "
                        f"{''.join(ALPHA_IS[call])} in float32; {call} never converts it for you")
        if alpha.device != dev:
            raise _fail(f"alpha must be on {dev} like a; got alpha.device={alpha.device}")
        if alpha.dim() != 1 or not alpha.is_contiguous():
            raise _fail(f"alpha must be 1-D contiguous [E]=[{e}]; got shape={tuple(alpha.shape)}, "
                        f"strides={alpha.stride()}")
        return alpha
    if isinstance(alpha, torch.Tensor) and alpha.numel() not in (1, e):
        raise _fail(f"alpha must have E={e} elements (one {ALPHA_IS[call][0]} per expert) or one; got "
                    f"alpha.shape={tuple(alpha.shape)}")
    if hasattr(alpha, "__len__") and not isinstance(alpha, (torch.Tensor, str, bytes)):
        # a list or array of per-expert values: the dense call's message offered one value, for every expert
        raise _fail(f"alpha must be a float32 tensor [E]=[{e}] (one {ALPHA_IS[call][0]} per expert) or one value (a "
                    f"1-element tensor, a Python or NumPy float, or None); got {_type_name(alpha)}. Build it with "
                    f"torch.tensor(values, dtype=torch.float32, device=a.device)")
    try:
        return _check_alpha(alpha, dev, call)
    except InvalidInputError as err:
        raise InvalidInputError("fp4_grouped_mm: " + str(err).removeprefix("fp4_mm: ")) from None
