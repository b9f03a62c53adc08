"""``Fp4Experts``: the routed experts of one MoE projection (gate_up or down) in NVFP4, on ``fp4_grouped_mm`` (W4A4)
or ``w4a16_grouped_mm`` (W4A16: the activations as they are; ``mode``, as ``Fp4Linear``'s: "auto" picks W4A4 only
where a grouped backend multiplies on FP4 tensor cores, ``modes.native_fp4_backend``).

The E experts' weights are held once in the canonical grouped form (packed uint8 [E, N, K/2], each expert's e4m3
block scales 128x4-swizzled [E, round_up(N,128), round_up(K/16,4)], fp32 decode scales [E]), so no call transforms
a weight. A call quantizes the routed rows to NVFP4 with one global scale for all of them (static: ``1/input_scale``,
the largest of the experts' calibrated scales, so that no expert's rows clip, as vLLM and SGLang take it; dynamic:
``448*6/amax(x)`` per call, on the device), lays their block scales out for the grouped kernels
(``format_grouped.swizzle_grouped_scales``, on the device: no host sync) and runs ``fp4_grouped_mm`` with
``alpha[e] = weight_scale_2[e] / gs_a``. Storage follows ``Fp4Linear``: scales as uint8 bytes and fp32 values as
int32 bits, so ``model.to(torch.bfloat16)`` cannot corrupt them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .api import fp4_grouped_mm, w4a16_grouped_mm
from .errors import InvalidInputError
from .format import BLOCK, quantize_nvfp4
from .format_grouped import grouped_scale_rows, swizzle_expert_scales, swizzle_grouped_scales
from .modes import ModeChoice
from .problem import OUT_DTYPES
from .stored import layer_size, stored_weight, load_layer_state

__all__ = ["Fp4Experts"]


def _per_expert(t: object, name: str, e: int, who: str) -> torch.Tensor:
    """fp32 [E] of positive finite scales from a tensor of E values, a sequence of E scalars, or (an activation
    scale) one value."""
    kind = "encode scales 448*6/amax" if name.endswith("global_scale") else "decode scales amax/(448*6)"
    if isinstance(t, float) or (isinstance(t, int) and not isinstance(t, bool)):
        t = torch.tensor([float(t)])
    if isinstance(t, Sequence) and not isinstance(t, (torch.Tensor, str, bytes)):
        for i, v in enumerate(t):
            one = isinstance(v, torch.Tensor) and v.numel() == 1 or isinstance(v, (float, int))
            if not one or isinstance(v, bool):
                got = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise InvalidInputError(f"{who}: {name} as a sequence must hold one number or one-element tensor per "
                                        f"expert ({kind}); item {i} is {got}. Pass one value per expert")
        t = torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in t]) if len(t) else torch.empty(0)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise InvalidInputError(f"{who}: {name} must be float32 {kind}, one per expert; got "
                                f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    t = t.detach().float().reshape(-1)
    if t.numel() not in (1, e) or (name.startswith("weight") and t.numel() != e):
        raise InvalidInputError(f"{who}: {name} must hold one value per expert (E={e}); got {t.numel()} values")
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise InvalidInputError(f"{who}: {name} must be positive and finite ({kind}); got {t.tolist()[:8]}")
    return t


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).reshape(-1).contiguous().view(torch.int32)


class Fp4Experts(ModeChoice, nn.Module):
    """``y[rows of e] = x[rows of e] @ W[e].T`` for the E experts of one MoE projection, W and x in NVFP4.

    Build it with :meth:`from_modelopt` (checkpoint tensors). ``forward(x, offs)``: ``x`` float32/bf16/fp16
    [T, in_features], the routed rows grouped by expert; ``offs`` int32 [E], each expert's cumulative end row
    (``fp4_grouped_mm``'s convention). Returns [T, out_features] of x's dtype.

    Buffers: ``weight`` uint8 [E, N, K/2]; ``weight_scale`` uint8 bytes of the swizzled e4m3 block scales
    [E, round_up(N,128), round_up(K/16,4)]; ``weight_scale_2`` fp32 [E] and ``input_scale`` fp32 [1] (None: dynamic
    activation scaling) stored as int32 bits.
    """

    mode_op = "grouped"  # mode="auto" picks W4A4 where a backend of fp4_grouped_mm runs on FP4 tensor cores
    mode_hint = "a grouped backend multiplies on FP4 tensor cores"

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, device=None, mode: str = "auto"):
        super().__init__()
        self._set_mode(mode)
        layer_size("Fp4Experts", "num_experts", num_experts)
        layer_size("Fp4Experts", "in_features", in_features, BLOCK)
        layer_size("Fp4Experts", "out_features", out_features)
        e, n, k = num_experts, out_features, in_features
        self.num_experts, self.in_features, self.out_features = e, k, n
        rn, cp = -(-n // 128) * 128, -(-(k // BLOCK) // 4) * 4
        self.register_buffer("weight", torch.zeros((e, n, k // 2), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros((e, rn, cp), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale_2", _bits(torch.ones(e)).to(device))
        self.register_buffer("input_scale", None)
        self.register_buffer("input_global_scale", None)  # a stored encode scale (compressed-tensors), used as is

    @classmethod
    def from_modelopt(cls, weight, weight_scale, weight_scale_2, input_scale=None, mode: str = "auto") -> "Fp4Experts":
        """From ModelOpt NVFP4 checkpoint tensors of E experts (``experts.{e}.<proj>.*``), as stored.

        Args:
            weight: uint8 (or float4_e2m1fn_x2) [E, N, K/2], or a sequence of E [N, K/2] tensors.
            weight_scale: float8_e4m3fn (or uint8) linear block scales [E, N, K/16], or a sequence of E [N, K/16].
            weight_scale_2: each expert's fp32 weight decode scale: [E] or a sequence of E scalars (numbers or
                one-element tensors; anything else is refused naming the item).
            input_scale: the experts' static activation decode scales ([E], a sequence, or one value); their max is
                used for all rows (W4A4). None: dynamic activation scaling.
            mode: "auto", "w4a4" or "w4a16" (the module docstring).
        """
        who = "Fp4Experts.from_modelopt"
        mod = cls._from_stored(who, weight, weight_scale, "weight", mode)
        e, dev = mod.num_experts, mod.weight.device
        mod.weight_scale_2 = _bits(_per_expert(weight_scale_2, "weight_scale_2", e, who)).to(dev)
        if input_scale is not None:
            mod.input_scale = _bits(_per_expert(input_scale, "input_scale", e, who).max()).to(dev)
        return mod

    @classmethod
    def _from_stored(cls, who: str, weight, weight_scale, wname: str, mode: str) -> "Fp4Experts":
        """A module holding E experts' checked packed weights (``wname``: the checkpoint's name for them) and their
        linear e4m3 scales, swizzled here, once; decode scales are the caller's."""
        for name, t, dims in ((wname, weight, "[E, N, K/2]"), ("weight_scale", weight_scale, "[E, N, K/16]")):
            if isinstance(t, torch.Tensor) and t.dim() != 3:  # a 2-D one's rows were taken as experts
                fix = f" One expert's: pass {name}.unsqueeze(0), its scales likewise" if t.dim() == 2 else ""
                raise InvalidInputError(f"{who}: {name} must be {dims} (or a sequence of E experts' tensors); got a "
                                        f"{t.dim()}-D tensor of shape {tuple(t.shape)}.{fix}")
        ws = list(weight) if isinstance(weight, (Sequence, torch.Tensor)) else weight
        ss = list(weight_scale) if isinstance(weight_scale, (Sequence, torch.Tensor)) else weight_scale
        if not isinstance(ws, list) or not isinstance(ss, list) or not ws or len(ws) != len(ss):
            raise InvalidInputError(f"{who}: {wname} and weight_scale must hold the same number (E >= 1) of experts "
                                    f"([E, N, K/2] and [E, N, K/16], or sequences); got {_count(weight)} and "
                                    f"{_count(weight_scale)}")
        pairs = [stored_weight(f"{who} (expert {i})", w, s, wname, "weight_scale") for i, (w, s) in
                 enumerate(zip(ws, ss))]
        if len({tuple(w.shape) for w, _ in pairs}) != 1:
            raise InvalidInputError(f"{who}: every expert's {wname} must have one shape; got "
                                    f"{sorted({tuple(w.shape) for w, _ in pairs})}")
        e, (n, k2) = len(pairs), pairs[0][0].shape
        dev = pairs[0][0].device
        mod = cls(e, 2 * k2, n, device=dev, mode=mode)
        mod.weight.copy_(torch.stack([w for w, _ in pairs]))
        lin = torch.stack([s.to(dev).contiguous() for _, s in pairs])
        mod.weight_scale.copy_(swizzle_expert_scales(lin).view(torch.uint8))
        return mod

    @classmethod
    def from_compressed_tensors(cls, weight_packed, weight_scale, weight_global_scale, input_global_scale=None,
                                mode: str = "auto") -> "Fp4Experts":
        """From compressed-tensors' ``nvfp4-pack-quantized`` tensors of E experts, as stored.

        Args:
            weight_packed, weight_scale: as ``from_modelopt``'s weight and weight_scale.
            weight_global_scale: each expert's fp32 *encode* scale ``448*6/amax(W)`` ([E] or E scalars); the decode
                scale is its reciprocal (one fp32 rounding), as ``Fp4Linear.from_compressed_tensors`` takes it.
            input_global_scale: the experts' static activation *encode* scales; the smallest is used as it is for
                all rows (no row clips; W4A4). None: dynamic activation scaling. mode: as ``from_modelopt``'s.
        """
        who = "Fp4Experts.from_compressed_tensors"
        mod = cls._from_stored(who, weight_packed, weight_scale, "weight_packed", mode)
        e = mod.num_experts
        wgs = _per_expert(weight_global_scale, "weight_global_scale", e, who)
        mod.weight_scale_2 = _bits(1.0 / wgs).to(mod.weight.device)
        if input_global_scale is not None:
            igs = _per_expert(input_global_scale, "input_global_scale", e, who)
            mod.input_global_scale = _bits(igs.min()).to(mod.weight.device)
        return mod

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a static activation scale loads into a dynamic layer too (stored.load_layer_state)
        parent = super()._load_from_state_dict
        load_layer_state(self, lambda sd, p: parent(sd, p, *args, **kwargs), state_dict, prefix,
                         "Fp4Experts.load_state_dict")

    def forward(self, x: torch.Tensor, offs: torch.Tensor, *, check_offs: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidInputError(f"Fp4Experts: x must be [T, in_features={self.in_features}] (the routed rows, "
                                    f"grouped by expert); got {got}")
        if x.dtype not in OUT_DTYPES:
            raise InvalidInputError(f"Fp4Experts: x must be float32, bfloat16 or float16; got dtype={x.dtype}")
        if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32:  # one message in every mode
            got = f"dtype={offs.dtype}" if isinstance(offs, torch.Tensor) else type(offs).__name__
            raise InvalidInputError(f"Fp4Experts: offs must be an int32 tensor [E] of each expert's cumulative end "
                                    f"row; got {got}. Build it as torch.cumsum(rows_per_expert, 0).to(torch.int32)")
        if self.resolved_mode(x.device) == "w4a16":
            a = x if x.dtype in (torch.bfloat16, torch.float16) else x.to(torch.bfloat16)
            return w4a16_grouped_mm(a.contiguous(), self.weight, self.weight_scale.view(torch.float8_e4m3fn),
                                    self.weight_scale_2.view(torch.float32), offs, out_dtype=x.dtype,
                                    check_offs=check_offs)
        if self.input_global_scale is not None:
            gs = self.input_global_scale.view(torch.float32)
            xq, xs, _ = quantize_nvfp4(x, gs, scale_layout="linear")
        elif self.input_scale is None:
            if x.device != self.weight.device:  # else a raw error from the alpha's division below
                raise InvalidInputError(f"Fp4Experts: x must be on the layer's device {self.weight.device}; got "
                                        f"x.device={x.device}. Move the input or the layer (.to)")
            xq, xs, gs = quantize_nvfp4(x, scale_layout="linear")
        else:
            gs = 1.0 / self.input_scale.view(torch.float32)
            xq, xs, _ = quantize_nvfp4(x, gs, scale_layout="linear")
        # an offs that is not a 1-D tensor on x's device goes on as it is, for fp4_grouped_mm's message about it
        ok = isinstance(offs, torch.Tensor) and offs.dim() == 1 and offs.device == x.device
        sa = swizzle_grouped_scales(xs, offs, grouped_scale_rows(x.shape[0], self.num_experts)) if ok else xs
        alpha = self.weight_scale_2.view(torch.float32) / gs
        return fp4_grouped_mm(xq, self.weight, sa, self.weight_scale.view(torch.float8_e4m3fn), alpha, offs,
                              out_dtype=x.dtype, check_offs=check_offs)

    @property
    def static_scale(self) -> bool:
        """Whether an activation scale is stored (``input_scale`` or ``input_global_scale``): in W4A4 each row is
        then quantized on its own; else with one scale per call over all rows."""
        return self.input_scale is not None or self.input_global_scale is not None

    def extra_repr(self) -> str:
        scale = "static" if self.static_scale else "dynamic"
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, mode={self.mode_repr()}, activation_scale={scale}")


def _count(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)}"
    return f"{len(t)} items" if isinstance(t, Sequence) else type(t).__name__
