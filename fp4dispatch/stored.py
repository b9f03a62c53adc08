"""NVFP4 tensors as checkpoints store them (ModelOpt, compressed-tensors): the checks that turn them into what
``Fp4Linear`` holds, with messages that name the constructor, the tensor, what was expected and what came."""
from __future__ import annotations

import torch

from .errors import InvalidInputError
from .format import BLOCK, as_e4m3, as_packed_uint8

__all__ = ["scalar_scale", "stored_weight", "layer_size", "load_layer_state", "INPUT_SPREAD"]

# what the layers hold (their state dicts): bytes and fp32 bit patterns, never values nn.Module may cast
_STORAGE = {"weight": torch.uint8, "weight_scale": torch.uint8, "weight_scale_2": torch.int32,
            "input_scale": torch.int32, "input_global_scale": torch.int32}
_STATIC = ("input_scale", "input_global_scale")


def layer_size(who: str, name: str, v: object, block: int = 1) -> int:
    """A layer's size argument (``in_features``, ``out_features``, ``num_experts``): a positive int, and a multiple
    of ``block`` for K (one e4m3 scale per 16 values). bool is refused although Python counts it an int:
    ``Fp4Linear(64, True)`` is a mistaken argument, never a size of 1."""
    if not isinstance(v, int) or isinstance(v, bool):
        fix = f"int({v!r})" if isinstance(v, float) and v.is_integer() else "the layer's size as an int"
        raise InvalidInputError(f"{who}: {name} must be a positive int; got {type(v).__name__} {v!r}. Pass {fix}")
    if v <= 0:
        raise InvalidInputError(f"{who}: {name} must be a positive int; got {v!r}")
    if v % block:
        raise InvalidInputError(f"{who}: {name} must be a positive multiple of {block} (one e4m3 scale per {block} "
                                f"values); got {v!r}. Pad K with zeros to {-(-v // block) * block}")
    return v


_SPREAD = ("fp4_mm applies one per-tensor alpha, and taking their max would silently rescale the other shards",
           "Build one Fp4Linear per shard, or requantize the fused weight with one global scale")
# an activation encode scale per fused shard (compressed-tensors): one scale quantizes the whole input
INPUT_SPREAD = ("one encode scale quantizes the input of the whole fused layer",
                "Store the smallest of them as its input_global_scale (no shard's activations then saturate), or "
                "pass None for per-call scaling")


def scalar_scale(t: object, name: str, who: str, *, allow_spread: bool, encode: bool = False,
                 spread: tuple[str, str] = _SPREAD) -> torch.Tensor:
    """A per-tensor scale (0-d, [1] or one per fused shard) -> fp32 [1] (the max over shards where
    ``allow_spread``). ``encode``: an encode scale ``448*6/amax`` (compressed-tensors), else a decode scale
    ``amax/(448*6)`` (ModelOpt); only the messages differ. ``spread``: why different values are refused, and the
    fix."""
    kind = "an encode scale 448*6/amax" if encode else "a decode scale amax/(448*6)"
    if not isinstance(t, torch.Tensor):
        if isinstance(t, (float, int)) and not isinstance(t, bool):
            t = torch.tensor([float(t)], dtype=torch.float32)
        else:
            raise InvalidInputError(f"{who}: {name} must be a float32 tensor (one per tensor or per fused shard); got "
                                    f"{type(t).__name__}")
    if not t.is_floating_point() or t.numel() == 0:
        raise InvalidInputError(f"{who}: {name} must be a non-empty float tensor; got dtype={t.dtype}, "
                                f"shape={tuple(t.shape)}")
    t = t.detach().float().reshape(-1)
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise InvalidInputError(f"{who}: {name} must be positive and finite ({kind}); got {t.tolist()[:8]}")
    if t.numel() > 1 and not allow_spread and not bool((t == t[0]).all()):
        raise InvalidInputError(f"{who}: {name} has {t.numel()} different per-shard values {t.tolist()[:8]}; "
                                f"{spread[0]}. {spread[1]}")
    return t.max().reshape(1)


def stored_weight(who: str, weight: object, weight_scale: object, wname: str, sname: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [N, K/2], float8_e4m3fn [N, K/16]) of a stored packed weight and its linear block scales."""
    if not isinstance(weight, torch.Tensor):
        raise InvalidInputError(f"{who}: {wname} must be a packed NVFP4 tensor [N, K/2]; got {type(weight).__name__}")
    if weight.dtype in (torch.int32, torch.int64):
        raise InvalidInputError(f"{who}: {wname} must be uint8 [N, K/2] (two e2m1 per byte); got {weight.dtype}: a "
                                "weight repacked into wider words (compressed-tensors' pack-quantized INT4, or a "
                                "kernel's own layout) is not NVFP4 as a checkpoint stores it")
    w = as_packed_uint8(weight, f"{who}: {wname}")
    if w.dim() != 2:
        raise InvalidInputError(f"{who}: {wname} must be 2-D [N, K/2] packed NVFP4; got shape={tuple(w.shape)}")
    n, k = w.shape[0], w.shape[1] * 2
    if k % BLOCK:  # before the scales' shape, which would name a K/16 that is not a whole number
        raise InvalidInputError(f"{who}: K=2*{wname}.shape[1]={k} must be a multiple of {BLOCK} (one e4m3 scale per "
                                f"{BLOCK} values); got {wname}.shape={tuple(w.shape)}")
    if not isinstance(weight_scale, torch.Tensor):
        raise InvalidInputError(f"{who}: {sname} must be a float8_e4m3fn tensor [N, K/16]; got "
                                f"{type(weight_scale).__name__}")
    s = as_e4m3(weight_scale, f"{who}: {sname}")
    if tuple(s.shape) != (n, k // BLOCK):
        hint = (f" It is [K/16, N]: {wname} and {sname} look transposed; pass them as stored ([N, K/2], [N, K/16])"
                if tuple(s.shape) == (k // BLOCK, n) else
                f" Pass the checkpoint's {sname} as stored, before any swizzle or padding")
        raise InvalidInputError(f"{who}: {sname} must be linear [N, K/16]=({n}, {k // BLOCK}) for {wname} "
                                f"{tuple(w.shape)}; got shape={tuple(s.shape)}.{hint}")
    return w, s


def load_layer_state(module, load, state_dict: dict, prefix: str, who: str) -> None:
    """``_load_from_state_dict`` of an ``Fp4Linear`` or ``Fp4Experts`` (``load``: nn.Module's): check that each
    tensor is the layer's own storage (torch copies another dtype in by value: fp32 scales into int32 bit buffers
    would be garbage), and set the static activation scale (``input_scale`` or ``input_global_scale``) here.
    nn.Module loads no key into a buffer that is None, so a dynamic layer would refuse a static layer's state dict
    ("Unexpected key") or, with strict=False, drop its scale; given one, the layer becomes static with it (and the
    other kind of static scale goes). A state dict with neither leaves a static layer's scale to nn.Module, which
    reports it missing."""
    for name, dtype in _STORAGE.items():
        t = state_dict.get(prefix + name)
        if isinstance(t, torch.Tensor) and t.dtype != dtype:
            what = "bytes" if dtype == torch.uint8 else "fp32 bit patterns"
            # an fp32 scale: reshaped too (ModelOpt stores them 0-d; the layer's bits are [1] or [E])
            fix = ("t.float().reshape(-1).view(torch.int32)" if dtype == torch.int32 else
                   f"t.view({dtype})" if t.element_size() == dtype.itemsize else "the layer's own tensor")
            same = "if it holds the same values"
            if name == "weight_scale":
                # a checkpoint's scales are linear [N, K/16]; the layer's 128x4-swizzled bytes often have that shape
                # too (N % 128 == 0, K/16 % 4 == 0), so t.view alone would load them silently in the wrong order
                swizzle = ("format_grouped.swizzle_expert_scales" if len(module.weight.shape) == 3 else
                           "swizzle_scales")
                same = (f"if it holds this layer's swizzled scales (a state dict of the layer itself); a checkpoint's "
                        f"linear [rows, K/16] scales need fp4dispatch.{swizzle}(t).view(torch.uint8) first")
            raise InvalidInputError(
                f"{who}: state_dict[{prefix + name!r}] must be the layer's storage, {dtype} ({what}); got "
                f"dtype={t.dtype}, which would be copied in by value. Pass {fix} {same}, or build the layer from "
                "checkpoint tensors with from_modelopt / from_compressed_tensors (load_nvfp4)")
    b, own = state_dict.get(prefix + "bias"), module._buffers.get("bias")
    if isinstance(b, torch.Tensor) and own is not None and b.is_floating_point() and b.dtype != own.dtype:
        # the bias is kept in the stored dtype: a layer built with another (Fp4Linear's bf16 default) rounded an fp32
        # bias silently, and its state_dict no longer round-tripped
        module._buffers["bias"] = own.to(b.dtype)
    t = state_dict.get(prefix + "weight_scale_2")
    if isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type != "meta":
        v = t.detach().reshape(-1).view(torch.float32)
        if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):  # from_modelopt refuses these too
            raise InvalidInputError(f"{who}: state_dict[{prefix + 'weight_scale_2'!r}] must hold positive finite fp32 "
                                    f"weight decode scales 1/gs_w (as int32 bits); it holds {v.tolist()[:8]}")
    given = {n: state_dict.pop(prefix + n) for n in _STATIC if prefix + n in state_dict}
    if not given:
        load(state_dict, prefix)
        return
    if len(given) == 2:
        raise InvalidInputError(f"{who}: state_dict holds both {prefix}input_scale (a decode scale) and "
                                f"{prefix}input_global_scale (an encode scale); a layer has one static activation "
                                "scale: drop one")
    (name, t), = given.items()
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidInputError(f"{who}: state_dict[{prefix + name!r}] must hold one fp32 value as int32 bits [1]; "
                                f"got {got}")
    if t.device.type != "meta":
        v = t.detach().reshape(1).view(torch.float32)
        if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            raise InvalidInputError(f"{who}: state_dict[{prefix + name!r}] must be a positive finite fp32 scale (as "
                                    f"int32 bits); it holds {v.tolist()}")
    for n in _STATIC:  # None while nn.Module loads the rest: it would count a static buffer as a missing key
        setattr(module, n, None)
    load(state_dict, prefix)
    setattr(module, name, t.detach().reshape(1).clone().to(module.weight.device))
