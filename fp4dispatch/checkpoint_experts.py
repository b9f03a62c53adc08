"""``load_nvfp4``'s MoE part: a transformers experts module (stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I], ``act_fn``; ``fp4dispatch.moe``) whose experts the checkpoint stores quantized, one module per expert
and projection, as the exporters write them (``<experts>.<e>.gate_proj.*``, ``up_proj``, ``down_proj``; Mixtral's
``w1``, ``w3``, ``w2``), becomes an ``Fp4MoeExperts`` of three ``Fp4Experts`` of ``load_nvfp4``'s ``mode`` (auto:
W4A16 where there are no FP4 tensor cores). Each expert's stored scales are used as they are (ModelOpt's decode
scales; compressed-tensors' encode scales, whose reciprocal is the decode scale, as for ``Fp4Linear``). The experts'
static activation scales become one per projection (the largest decode scale, so that no expert's rows clip); where
only some experts store one, the projection scales dynamically.
"""
from __future__ import annotations

from torch import nn

from .errors import InvalidInputError
from .experts import Fp4Experts
from .moe import Fp4MoeExperts

__all__ = ["is_experts_module", "load_experts"]

_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # (gate, up, down) per naming


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module of the stacked form this loader replaces (3-D gate_up_proj and down_proj)."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3


def load_experts(model, name, module, fmt, shards, names, used, report, dev, mode, static, strict) -> None:
    """Replace the experts module ``name`` with an ``Fp4MoeExperts`` when the checkpoint stores its experts
    quantized; otherwise note in ``report`` why it stays (its stacked tensors are then loaded as plain ones)."""
    prefix = f"{name}." if name else ""
    why = fmt.exclusion(name)
    if why is not None:
        report.skipped[name] = f"excluded by the checkpoint ({why!r})"
        return
    naming = next((n for n in _NAMES if f"{prefix}0.{n[0]}.{fmt.weight_name}" in names), None)
    if naming is None:
        report.skipped[name] = (f"experts not quantized in the checkpoint (no {prefix}0.gate_proj.{fmt.weight_name} "
                                f"or {prefix}0.w1.{fmt.weight_name})")
        return
    gu, dn = module.gate_up_proj, module.down_proj
    e, h, i = dn.shape[0], dn.shape[1], dn.shape[2]
    biased = [b for b in ("gate_up_proj_bias", "down_proj_bias") if getattr(module, b, None) is not None]
    if tuple(gu.shape) != (e, 2 * i, h) or biased or not isinstance(getattr(module, "act_fn", None), nn.Module):
        why = (f"experts module {name!r} ({type(module).__name__}) is not of the form fp4dispatch replaces: "
               f"gate_up_proj [E, 2I, H] (got {tuple(gu.shape)}), down_proj [E, H, I] (got {tuple(dn.shape)}), an "
               f"act_fn module and no biases (got {biased or 'none'})")
        if strict:
            raise InvalidInputError(f"load_nvfp4: {why}; strict=False leaves it as it is (its quantized tensors "
                                    "unloaded, listed as unused, and its weights at their initial values)")
        report.skipped[name] = why
        return
    projs = []
    for proj, (n_out, k_in) in zip(naming, ((i, h), (i, h), (h, i))):
        projs.append(_projection(f"{prefix}{{}}.{proj}.", e, n_out, k_in, fmt, shards, names, used, mode, static,
                                 name))
    layer = Fp4MoeExperts(*projs, module.act_fn)
    layer = layer.to(dev if dev is not None else gu.device)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)
    p0 = projs[0]
    scale = "static" if p0.input_scale is not None or p0.input_global_scale is not None else "dynamic"
    report.replaced[name] = f"Fp4MoeExperts({e} experts, {h} -> {i} -> {h}, mode={mode}, activation scale {scale})"


def _projection(pattern, e, n_out, k_in, fmt, shards, names, used, mode, static, module) -> Fp4Experts:
    """One projection's E experts (``pattern`` formats the expert index into the tensor-name prefix)."""
    t: dict[str, list] = {k: [] for k in fmt.required}
    inputs = []
    for x in range(e):
        p = pattern.format(x)
        missing = [p + k for k in fmt.required if p + k not in names]
        if missing:
            raise InvalidInputError(f"load_nvfp4: experts module {module!r} is quantized in the checkpoint but "
                                    f"{', '.join(repr(m) for m in missing)} {'is' if len(missing) == 1 else 'are'} "
                                    f"missing (the model has {e} experts)")
        for k in fmt.required:
            t[k].append(shards.get(p + k))
        w = t[fmt.weight_name][-1]
        if tuple(w.shape) != (n_out, k_in // 2):
            hint = " (stored transposed)" if tuple(w.shape) == (k_in // 2, n_out) else ""
            raise InvalidInputError(f"load_nvfp4: {p + fmt.weight_name!r} has shape {tuple(w.shape)}; the model's "
                                    f"experts need [N, K/2] = ({n_out}, {k_in // 2}){hint}")
        if static and p + fmt.input_name in names:
            inputs.append(shards.get(p + fmt.input_name))
        used.update(p + k for k in (*fmt.required, fmt.input_name) if p + k in names)
    inp = inputs if static and len(inputs) == e else None
    w, s, g = (t[k] for k in fmt.required)
    if fmt.kind == "modelopt":
        return Fp4Experts.from_modelopt(w, s, [v.float().reshape(()) for v in g], inp, mode=mode)
    return Fp4Experts.from_compressed_tensors(w, s, [v.float().reshape(()) for v in g], inp, mode=mode)
