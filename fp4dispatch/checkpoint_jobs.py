"""What ``load_nvfp4`` plans before it changes the model: one ``Job`` per module it replaces, here a quantized
``nn.Linear`` (or an ``Fp4Linear`` of an earlier load) that becomes an ``Fp4Linear``.

A job is planned by building its module from ``Shards.probe`` (meta tensors of the stored dtypes and shapes, the
scales' values), so every check the constructors make runs, and raises, before any module of the model is replaced;
the model is changed only once every job and plain tensor has been planned and ``strict`` found nothing to refuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .errors import InvalidInputError
from .nn import Fp4Linear
from .stored import stored_weight

__all__ = ["Job", "linear_job", "target_device", "refuse_converted"]

_WHO = "load_nvfp4"
Getter = Callable[[str], torch.Tensor]


@dataclass
class Job:
    """Replace the module ``name`` with ``build(get)`` (``get``: the checkpoint's tensors by name), moved to
    ``device``."""

    name: str
    build: Callable[[Getter], nn.Module]
    device: torch.device


def target_device(name: str, current: torch.device, dev: torch.device | None) -> torch.device:
    """Where the module ``name``'s replacement (or a plain tensor) goes: ``device=``, else where it is now, unless
    that is the meta device, which holds no data (copying into it does nothing)."""
    if dev is not None:
        return dev
    if current.type == "meta":
        raise InvalidInputError(f"{_WHO}: the model's {name!r} is on the meta device (a model built without memory), "
                                "so it cannot hold the checkpoint's tensors; pass device= (e.g. device='cuda'), and "
                                "load_nvfp4 makes the layers and tensors it loads there")
    return current


def refuse_converted(name: str, kind: str, why: str) -> InvalidInputError:
    """The error for a module an earlier load made (``kind``) that this checkpoint does not quantize."""
    return InvalidInputError(f"{_WHO}: the model's {name!r} is an {kind} already (made by an earlier load), but this "
                             f"checkpoint has it {why}, so it cannot load into it. Load into a model built afresh from "
                             "the checkpoint's config")


# nn.Linear subclasses whose forward is nn.Linear's maths (x @ W.T + b), so an Fp4Linear computes what they do
_LINEAR_FORWARD = frozenset({"FalconLinear"})
# modules whose forward reads a child Linear's weight itself (``self.dt_proj.weight @ x``), whatever the config says
# (Jamba's and FalconMamba's mixers call the Linear once config._is_quantized is set, which load_nvfp4 sets)
_READS_CHILD_WEIGHT = {"MambaMixer": frozenset({"dt_proj"})}


def linear_job(name, module, fmt, shards, names, used, report, dev, mode, static, parent="") -> Job | None:
    """The job for an ``nn.Linear`` (or ``Fp4Linear``) the checkpoint quantizes; None (noted in ``report``) for one
    it leaves as it is. An ``nn.Linear`` subclass with a forward of its own (a router returning its top-k, a grouped
    projection), or one whose weight its ``parent`` (class name) reads itself, is never replaced: refused where the
    checkpoint quantizes it."""
    prefix = f"{name}." if name else ""
    wname = prefix + fmt.weight_name
    w = shards.probe(wname) if wname in names else None
    # the exclusion list names modules as the checkpoint does, which transformers may rename (PhiMoE's router is
    # the model's mlp.router and the checkpoint's block_sparse_moe.gate)
    why = fmt.exclusion(name) or fmt.exclusion(shards.stored_name(wname)[:-len(fmt.weight_name) - 1])
    # packed NVFP4 by its shapes, whatever its dtype ([N, K/2] bytes beside [N, K/16] block scales): a byte dtype
    # mislabelled as float, or a module the config excludes, is named as such, not as a checkpoint of another model
    scale = shards.probe(prefix + "weight_scale") if prefix + "weight_scale" in names else None
    packed = (w is not None and scale is not None and w.element_size() == 1 and scale.dim() == 2
              and tuple(w.shape) == (module.out_features, module.in_features // 2)
              and scale.shape[-1] * 8 == w.shape[1])
    skip = (f"excluded by the checkpoint ({why!r})" if why is not None else
            f"not quantized in the checkpoint (no {fmt.weight_name})" if w is None else
            f"not quantized in the checkpoint ({fmt.weight_name} is {w.dtype})" if w.is_floating_point() and not packed
            else None)
    if skip is not None:
        if isinstance(module, Fp4Linear):
            raise refuse_converted(name, "Fp4Linear", skip)
        if why is not None and packed:
            raise InvalidInputError(f"{_WHO}: module {name!r} is excluded by the checkpoint's quantization config "
                                    f"({why!r}), but the checkpoint stores it quantized ({wname!r} {tuple(w.shape)} "
                                    f"with block scales): the config and the tensors disagree. Fix the exclusion "
                                    "list, or pass quantization_config= with it fixed")
        report.skipped[name] = skip
        return None
    cls = type(module)
    own_forward = cls.forward is not nn.Linear.forward and cls.__name__ not in _LINEAR_FORWARD
    if own_forward and not isinstance(module, Fp4Linear):
        raise InvalidInputError(f"{_WHO}: module {name!r}: {cls.__name__} is an nn.Linear with a forward of its own, "
                                "which an Fp4Linear (x @ W.T + b) would not compute, and the checkpoint stores it "
                                "quantized, so it cannot load into this model (its packed weight is no plain weight "
                                "either). The model is unchanged")
    child = name.rpartition(".")[2]
    if child in _READS_CHILD_WEIGHT.get(parent, ()) and not isinstance(module, Fp4Linear):
        raise InvalidInputError(f"{_WHO}: module {name!r}: its parent, a {parent}, reads {child}.weight itself in "
                                "its forward (weight @ x), which a packed weight would not compute, and the "
                                "checkpoint stores it quantized, so it cannot load into this model. The model is "
                                "unchanged. Export the model with that module unquantized (ModelOpt's "
                                "exclude_modules, compressed-tensors' ignore)")
    if w.dtype not in (torch.uint8, torch.int32, torch.int64) and "float4" not in str(w.dtype):
        fix = (" It holds bytes: store them as uint8 (t.view(torch.uint8), the same bytes)" if w.element_size() == 1
               else "")
        raise InvalidInputError(f"{_WHO}: {wname!r} has dtype {w.dtype}; a packed NVFP4 weight is uint8 [N, K/2] (two "
                                f"e2m1 per byte, low nibble = even k).{fix}")
    missing = [prefix + k for k in fmt.required if prefix + k not in names]
    if missing:
        raise InvalidInputError(f"{_WHO}: module {name!r} is quantized in the checkpoint ({wname!r} is there) but "
                                f"{', '.join(repr(m) for m in missing)} {'is' if len(missing) == 1 else 'are'} "
                                f"missing; found {sorted(n for n in names if n.startswith(prefix))}")
    who = f"{_WHO}: module {name!r}"
    if w.dtype in (torch.int32, torch.int64):  # repacked into wider words: named before any shape is compared
        stored_weight(who, w, scale, fmt.weight_name, "weight_scale")
    n_out, k_in = module.out_features, module.in_features
    if tuple(w.shape) != (n_out, k_in // 2):
        hint = (" It is [K/2, N]: the weight is stored transposed; fp4dispatch takes the nn.Linear layout [N, K/2]"
                if tuple(w.shape) == (k_in // 2, n_out) else " The checkpoint is not of this model")
        raise InvalidInputError(f"{_WHO}: {wname!r} has shape {tuple(w.shape)}; the model's {name!r} is "
                                f"Linear({k_in}, {n_out}), so [N, K/2] = ({n_out}, {k_in // 2}) was expected.{hint}")
    inp = prefix + fmt.input_name if static and prefix + fmt.input_name in names else None
    # a bias the model's Linear does not have is not taken (reported unused, as for a plain module's)
    bias = prefix + "bias" if prefix + "bias" in names and module.bias is not None else None
    own_bias = module.bias if bias is None else None  # the model's: the layer keeps it (reported missing)
    if own_bias is not None:
        report.missing.append(prefix + "bias")

    def build(get: Getter) -> Fp4Linear:
        w = get(wname)
        t = {k: get(prefix + k) for k in fmt.required[1:]}
        b = get(bias) if bias is not None else None
        if own_bias is not None:  # one on the meta device has no value to keep: zeros (strict refused it)
            b = (torch.zeros(own_bias.shape, dtype=own_bias.dtype, device=w.device)
                 if own_bias.is_meta and not w.is_meta else own_bias.detach().to(w.device))
        s_in = get(inp) if inp is not None else None
        stored_weight(who, w, t["weight_scale"], fmt.weight_name, "weight_scale")  # the scales' shape, named
        if fmt.kind == "modelopt":
            return Fp4Linear.from_modelopt(w, t["weight_scale"], t["weight_scale_2"], s_in, bias=b, mode=mode)
        return Fp4Linear.from_compressed_tensors(w, t["weight_scale"], t["weight_global_scale"], s_in, bias=b,
                                                 mode=mode)

    try:
        build(shards.probe)  # every check, on the probes: it raises before the model changes
    except InvalidInputError as e:  # the constructor's message, with the module it was building
        why = str(e).removeprefix(f"{_WHO}: ").removeprefix(f"module {name!r}: ")  # named once, here
        raise InvalidInputError(f"{_WHO}: module {name!r}: {why}. The model is unchanged") from None
    used.update(prefix + k for k in (*fmt.required, fmt.input_name) if prefix + k in names)
    used.update([bias] if bias is not None else [])
    report.replaced[name] = (f"Fp4Linear({k_in} -> {n_out}, mode={mode}, activation scale "
                             f"{'static' if inp is not None else 'dynamic'})")
    return Job(name, build, target_device(name, module.weight.device, dev))
