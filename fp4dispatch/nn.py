"""``Fp4Linear``: an NVFP4 linear layer on ``fp4_mm`` (W4A4) or ``w4a16_mm`` (W4A16).

``mode``: ``"w4a4"`` quantizes the activations to NVFP4 per call and runs ``fp4_mm``; ``"w4a16"`` keeps them 16-bit
and runs ``w4a16_mm`` (fp32 activations are cast to bf16); ``"auto"`` (the default) picks W4A4 where a backend that
multiplies on FP4 tensor cores is healthy on the input's device (SM100/SM120 with FlashInfer, sgl-kernel, torch or
Humming's W4A4) and W4A16 everywhere else: without FP4 tensor cores W4A4 is not faster, and it rounds the activations
to NVFP4 (docs/integration.md, "Fp4Linear").

The weight is held once in the canonical form every backend takes (packed uint8 [N, K/2], 128x4-swizzled e4m3
block scales, fp32 global decode scale), so no backend needs a per-call weight transform. No backend needs its
own weight layout yet; when one does (e.g. a shuffled layout), it is prepared here, once, at construction.

Activations are quantized per call with :func:`fp4dispatch.quantize_nvfp4` (the Triton kernel on CUDA when
available): with a static ``input_scale`` (from a ModelOpt checkpoint or given to ``from_linear``) when there is
one, else with a dynamic per-call global scale ``448*6/amax(x)``.

Storage: block scales are kept as their uint8 bytes and fp32 scalars as int32 bit patterns, so that
``model.to(torch.bfloat16)`` / ``model.half()`` (which cast every floating buffer, float8 included) cannot
corrupt them; the bias is a normal floating buffer and follows such casts, as in ``nn.Linear``.
"""
from __future__ import annotations

import torch
from torch import nn

from .api import fp4_mm, w4a16_mm
from .errors import InvalidInputError
from .format import BLOCK, quantize_nvfp4, swizzle_scales, swizzled_scale_shape
from .experts import Fp4Experts
from .modes import MODES, ModeChoice, native_fp4_backend
from .moe import Fp4MoeExperts
from .stored import INPUT_SPREAD, layer_size, scalar_scale, stored_weight, load_layer_state
from .problem import OUT_DTYPES

__all__ = ["Fp4Linear", "Fp4Experts", "Fp4MoeExperts", "MODES", "native_fp4_backend"]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).reshape(1).contiguous().view(torch.int32)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32)


class Fp4Linear(ModeChoice, nn.Module):
    """``y = x @ W.T + bias`` with W and x in NVFP4, computed by :func:`fp4dispatch.fp4_mm`.

    Build it with :meth:`from_linear` (quantize a float ``nn.Linear``) or :meth:`from_modelopt` (checkpoint
    tensors). ``x`` is ``[..., in_features]`` float32/bf16/fp16; the output has x's dtype and leading dims.

    Buffers: ``weight`` uint8 [N, K/2]; ``weight_scale`` uint8 bytes of the swizzled e4m3 block scales;
    ``weight_scale_2`` / ``input_scale`` fp32 decode scales stored as int32 bits ([1]; ``input_scale`` None
    means dynamic activation scaling); ``bias`` [N] or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 dtype: torch.dtype = torch.bfloat16, mode: str = "auto"):
        super().__init__()
        self._set_mode(mode)
        self._views: tuple | None = None  # _weight_views' cache
        layer_size("Fp4Linear", "in_features", in_features, BLOCK)
        layer_size("Fp4Linear", "out_features", out_features)
        self.in_features, self.out_features = in_features, out_features
        n, k = out_features, in_features
        self.register_buffer("weight", torch.zeros((n, k // 2), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(swizzled_scale_shape(n, k), dtype=torch.uint8,
                                                         device=device))
        self.register_buffer("weight_scale_2", _bits(torch.ones(1)).to(device))
        # before the None buffers: torch.export's buffer bookkeeping miscounts a tensor buffer after them (IndexError)
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        self.register_buffer("input_scale", None)
        # a static activation *encode* scale as a checkpoint stores it (compressed-tensors' input_global_scale): used
        # as it is, never inverted twice
        self.register_buffer("input_global_scale", None)
        # derived from the scales above whenever they are set or loaded (_refresh; not saved): the static alpha and
        # the activation encode scale. Kept rather than derived per call: that would be one more device op per call
        # (a graph node of its own), for a layer whose static scales change only through set_input_scale/load
        self.register_buffer("_alpha", None, persistent=False)
        self.register_buffer("_input_global_scale", None, persistent=False)

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, *, input_scale: torch.Tensor | float | None = None,
                    mode: str = "auto") -> "Fp4Linear":
        """Quantize a float ``nn.Linear`` to NVFP4 (weight global scale ``448*6/amax(W)``).

        Args:
            linear: the float layer (its weight's device is kept).
            input_scale: optional static activation decode scale ``amax(x)/(448*6)`` from calibration; None:
                dynamic per-call scaling (both W4A4 only).
            mode: "auto", "w4a4" or "w4a16" (the module docstring).
        """
        if not isinstance(linear, nn.Linear):
            raise InvalidInputError(f"Fp4Linear.from_linear: linear must be a torch.nn.Linear; got "
                                    f"{type(linear).__name__}")
        w = linear.weight.detach()
        n, k = w.shape
        bias = linear.bias is not None
        mod = cls(k, n, bias, device=w.device, dtype=linear.bias.dtype if bias else torch.bfloat16, mode=mode)
        packed, scale, gs = quantize_nvfp4(w if w.dtype in OUT_DTYPES else w.float())
        mod._set_weight(packed, scale, 1.0 / gs)
        if bias:
            mod.bias.copy_(linear.bias.detach())
        mod.set_input_scale(input_scale)
        return mod

    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                      input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                      mode: str = "auto") -> "Fp4Linear":
        """From ModelOpt NVFP4 checkpoint tensors, as vLLM/SGLang load them.

        Args:
            weight: packed e2m1, uint8 (or float4_e2m1fn_x2) [N, K/2], low nibble = even k.
            weight_scale: float8_e4m3fn (or uint8 bytes) block scales, linear [N, K/16]; swizzled here, once.
            weight_scale_2: fp32 weight decode scale ``1/gs_w`` (0-d, [1], or equal per fused shard).
            input_scale: fp32 static activation decode scale ``1/gs_a`` (the max over shards is used, as vLLM
                and SGLang do); None: dynamic activation scaling.
            bias: optional [N].
            mode: "auto", "w4a4" or "w4a16" (the module docstring).

        W4A16: ``alpha = weight_scale_2``. W4A4: ``alpha = input_scale * weight_scale_2`` and activations are
        quantized with ``1/input_scale``.
        """
        who = "Fp4Linear.from_modelopt"
        w, sc = stored_weight(who, weight, weight_scale, "weight", "weight_scale")
        mod = cls._from_stored(w, sc, scalar_scale(weight_scale_2, "weight_scale_2", who, allow_spread=False), bias,
                               mode, who)
        if input_scale is not None:
            input_scale = scalar_scale(input_scale, "input_scale", who, allow_spread=True)
        mod.set_input_scale(input_scale)
        return mod

    @classmethod
    def _from_stored(cls, w: torch.Tensor, s: torch.Tensor, decode_scale: torch.Tensor, bias, mode: str,
                     who: str) -> "Fp4Linear":
        """A layer of a checked packed weight, its linear e4m3 scales, its fp32 [1] decode global scale and bias."""
        n, k = w.shape[0], w.shape[1] * 2
        mod = cls(k, n, bias is not None, device=w.device,
                  dtype=bias.dtype if isinstance(bias, torch.Tensor) else torch.bfloat16, mode=mode)
        mod._set_weight(w, swizzle_scales(s.to(w.device).contiguous()), decode_scale.to(w.device))
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
                raise InvalidInputError(f"{who}: bias must be a tensor of shape ({n},); got "
                                        f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias)}")
            mod.bias.copy_(bias.detach())
        return mod

    @classmethod
    def from_compressed_tensors(cls, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                weight_global_scale: torch.Tensor, input_global_scale: torch.Tensor | None = None,
                                bias: torch.Tensor | None = None, mode: str = "auto") -> "Fp4Linear":
        """From compressed-tensors' ``nvfp4-pack-quantized`` tensors (what llm-compressor saves), as stored.

        Args:
            weight_packed: uint8 [N, K/2], low nibble = even k.
            weight_scale: float8_e4m3fn [N, K/16] (linear); swizzled here, once.
            weight_global_scale: fp32 [1] *encode* scale ``448*6/amax(W)`` (computed by compressed-tensors in the
                model's dtype for bf16 models: the stored value is the one to use, never one recomputed).
            input_global_scale: fp32 [1] static activation encode scale, or None (dynamic per-call scaling).
            bias: optional [N]. mode: "auto", "w4a4" or "w4a16".

        The weight decodes as ``e2m1 * weight_scale / weight_global_scale``: ``weight_scale_2`` is
        ``1/weight_global_scale`` (one fp32 rounding). W4A4 quantizes x with ``input_global_scale`` itself and
        ``alpha = weight_scale_2 / input_global_scale``.
        """
        who = "Fp4Linear.from_compressed_tensors"
        w, sc = stored_weight(who, weight_packed, weight_scale, "weight_packed", "weight_scale")
        wgs = scalar_scale(weight_global_scale, "weight_global_scale", who, allow_spread=False, encode=True)
        mod = cls._from_stored(w, sc, 1.0 / wgs, bias, mode, who)
        if input_global_scale is not None:
            igs = scalar_scale(input_global_scale, "input_global_scale", who, allow_spread=False, encode=True,
                               spread=INPUT_SPREAD)
            mod.input_global_scale = _bits(igs).to(mod.weight.device)
            mod._refresh()
        return mod

    def _set_weight(self, packed: torch.Tensor, scale_swizzled: torch.Tensor, decode_scale: torch.Tensor) -> None:
        self.weight.copy_(packed)
        self.weight_scale.copy_(scale_swizzled.reshape(self.weight_scale.shape).view(torch.uint8))
        self.weight_scale_2 = _bits(decode_scale).to(self.weight.device)
        self._refresh()

    def set_input_scale(self, input_scale: torch.Tensor | float | None) -> None:
        """Set the static activation decode scale ``amax(x)/(448*6)`` (None: dynamic per-call scaling)."""
        self.input_global_scale = None
        if input_scale is None:
            self.input_scale = None
        else:
            t = torch.as_tensor(input_scale, dtype=torch.float32)
            if t.numel() != 1 or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise InvalidInputError(f"Fp4Linear: input_scale must be one positive finite value (amax(x)/(448*6));"
                                        f" got {t.reshape(-1).tolist()[:8]}")
            self.input_scale = _bits(t).to(self.weight.device)
        self._refresh()

    def _refresh(self) -> None:
        if self.input_global_scale is not None:  # stored as an encode scale: used as it is
            self._input_global_scale = self.input_global_scale
            self._alpha = _bits(_f32(self.weight_scale_2) / _f32(self.input_global_scale))
            return
        if self.input_scale is None:
            self._alpha = self._input_global_scale = None
            return
        s_in = _f32(self.input_scale)
        self._alpha = _bits(s_in * _f32(self.weight_scale_2))
        self._input_global_scale = _bits(1.0 / s_in)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a static activation scale loads into a dynamic layer too (stored.load_layer_state)
        parent = super()._load_from_state_dict
        load_layer_state(self, lambda sd, p: parent(sd, p, *args, **kwargs), state_dict, prefix,
                         "Fp4Linear.load_state_dict")
        self._refresh()

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidInputError(f"Fp4Linear: x must be [..., in_features={self.in_features}]; got {got}")
        if x.dtype not in OUT_DTYPES:
            raise InvalidInputError(f"Fp4Linear: x must be float32, bfloat16 or float16; got dtype={x.dtype}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty((*lead, self.out_features))
        if self.resolved_mode(x.device) == "w4a16":
            a = x2 if x2.dtype in (torch.bfloat16, torch.float16) else x2.to(torch.bfloat16)
            w, scale, decode = self._weight_views()
            y = w4a16_mm(a.contiguous(), w, scale, decode, out_dtype=x.dtype)
        else:
            y = self._w4a4(x2)
        bias = self._buffers["bias"]
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _weight_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight, its e4m3 view of the scales, the fp32 view of the decode scale), made once per buffer: an eager
        call's host time is mostly Python, and these views and ``nn.Module`` attribute lookups were a part of it. The
        buffers' identities and storages key it, so a moved (``.to``), reloaded, reassigned or ``.data``-swapped buffer
        is never served stale. Not under torch.compile: views cost nothing in a graph, and Dynamo would guard on the
        cache and compile the layer again once it is filled."""
        b = self._buffers
        w, s, d = b["weight"], b["weight_scale"], b["weight_scale_2"]
        if torch.compiler.is_compiling():
            return w, s.view(torch.float8_e4m3fn), _f32(d)
        c = self._views
        if c is None or c[0] is not w or c[1] is not s or c[2] is not d or c[5] != (s.data_ptr(), d.data_ptr()):
            c = self._views = (w, s, d, s.view(torch.float8_e4m3fn), _f32(d), (s.data_ptr(), d.data_ptr()))
        return c[0], c[3], c[4]

    def _w4a4(self, x2: torch.Tensor) -> torch.Tensor:
        w, scale, decode = self._weight_views()
        if self._input_global_scale is None:
            if x2.device != decode.device:  # else a raw error from decode / gs below
                raise InvalidInputError(f"Fp4Linear: x must be on the layer's device {decode.device}; got "
                                        f"x.device={x2.device}. Move the input or the layer (.to)")
            xq, xs, gs = quantize_nvfp4(x2)
            alpha = decode / gs  # 1/(gs_a*gs_w), on the device: no host sync
        else:
            xq, xs, _ = quantize_nvfp4(x2, _f32(self._input_global_scale))
            alpha = _f32(self._alpha)
        return fp4_mm(xq, w, xs, scale, alpha, out_dtype=x2.dtype)

    def __getstate__(self) -> dict:
        # _views holds dtype views of the buffers (a uint8 and a float8 tensor of one storage), which torch.save
        # refuses and pickle would restore as copies apart from the buffers; the next call makes them again
        state = super().__getstate__()
        state["_views"] = None
        return state

    def extra_repr(self) -> str:
        static = self.input_global_scale is not None or self.input_scale is not None
        scale = "static" if static else "dynamic"
        mode = self.mode_repr()
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={mode}, activation_scale={scale}")

