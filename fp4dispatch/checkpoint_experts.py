"""``load_nvfp4``'s MoE part: a transformers experts module (stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I], ``act_fn``; ``fp4dispatch.moe``) whose experts the checkpoint stores quantized, one module per expert
and projection, as the exporters write them (``<experts>.<e>.gate_proj.*``, ``up_proj``, ``down_proj``; Mixtral's
``w1``, ``w3``, ``w2``), becomes an ``Fp4MoeExperts`` of three ``Fp4Experts`` of ``load_nvfp4``'s ``mode`` (auto:
W4A16 where there are no FP4 tensor cores); so does an ``Fp4MoeExperts`` of an earlier load (loaded again). Each
expert's stored scales are used as they are (ModelOpt's decode scales; compressed-tensors' encode scales, whose
reciprocal is the decode scale, as for ``Fp4Linear``); a per-expert scale with one value per fused shard is taken
as ``Fp4Linear`` takes it (equal weight scales, the largest input scale). The experts' static activation scales
become one per projection (the largest decode scale, so that no expert's rows clip); where only some experts store
one, the projection scales dynamically. Planned as ``checkpoint_jobs`` plans a Linear: checked before the model
changes.
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from .checkpoint_jobs import Getter, Job, refuse_converted, target_device
from .errors import InvalidInputError, describe_exception
from .experts import Fp4Experts
from .moe import Fp4MoeExperts
from .stored import INPUT_SPREAD, scalar_scale

__all__ = ["is_experts_module", "experts_job"]

_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # (gate, up, down) per naming
_SPREAD = ("fp4_grouped_mm applies one alpha per expert, and taking their max would silently rescale the rest of "
           "the expert's weight", "Requantize the expert's weight with one global scale")


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module of the stacked form this loader replaces (3-D gate_up_proj and down_proj), or an
    ``Fp4MoeExperts`` an earlier load made."""
    if isinstance(module, Fp4MoeExperts):
        return True
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3


def experts_job(name, module, fmt, shards, names, used, report, dev, mode, static, strict) -> Job | None:
    """The job for the experts module ``name`` when the checkpoint stores its experts quantized; otherwise None,
    noted in ``report`` (its stacked tensors are then loaded as plain ones)."""
    prefix = f"{name}." if name else ""
    converted = isinstance(module, Fp4MoeExperts)
    why = fmt.exclusion(name)
    naming = next((n for n in _NAMES if f"{prefix}0.{n[0]}.{fmt.weight_name}" in names), None)
    skip = (f"excluded by the checkpoint ({why!r})" if why is not None else
            f"experts not quantized in the checkpoint (no {prefix}0.gate_proj.{fmt.weight_name} or "
            f"{prefix}0.w1.{fmt.weight_name})" if naming is None else None)
    if skip is not None:
        if converted:
            raise refuse_converted(name, "Fp4MoeExperts", skip)
        report.skipped[name] = skip
        return None
    if converted:
        e, h, i, device = module.num_experts, module.hidden_dim, module.intermediate_dim, module.down.weight.device
    else:
        gu, dn = module.gate_up_proj, module.down_proj
        e, h, i, device = dn.shape[0], dn.shape[1], dn.shape[2], gu.device
        biased = [b for b in ("gate_up_proj_bias", "down_proj_bias") if getattr(module, b, None) is not None]
        act = getattr(module, "act_fn", None)
        form = (tuple(gu.shape) == (e, 2 * i, h) and not biased and isinstance(act, nn.Module))
        if not form or (maths := _forward_difference(module)):
            why = (f"experts module {name!r} ({type(module).__name__}) is not of the form fp4dispatch replaces: "
                   f"gate_up_proj [E, 2I, H] (got {tuple(gu.shape)}), down_proj [E, H, I] (got {tuple(dn.shape)}), "
                   f"an act_fn module (got {type(act).__name__}) and no biases (got {biased or 'none'})"
                   if not form else f"experts module {name!r} ({type(module).__name__}): {maths}")
            if strict:
                raise InvalidInputError(f"load_nvfp4: {why}; strict=False leaves it as it is (its quantized tensors "
                                        "unloaded, listed as unused, and its weights at their initial values)")
            report.skipped[name] = why
            return None
    shapes = ((i, h), (i, h), (h, i))
    for proj, (n_out, k_in) in zip(naming, shapes):
        _check_projection(f"{prefix}{{}}.{proj}.", e, n_out, k_in, fmt, shards, names, name)
    act_fn = module.act_fn

    def build(get: Getter) -> Fp4MoeExperts:
        projs = []
        for proj in naming:
            try:
                projs.append(_projection(get, f"{prefix}{{}}.{proj}.", e, fmt, names, mode, static))
            except InvalidInputError as err:  # the constructor's message, with the projection it was building
                raise InvalidInputError(f"{proj} ({prefix}<e>.{proj}.*): {str(err).removeprefix('load_nvfp4: ')}"
                                        ) from None
        return Fp4MoeExperts(*projs, act_fn)

    try:
        probe = build(shards.probe)  # every check, on the probes: it raises before the model changes
    except InvalidInputError as err:
        raise InvalidInputError(f"load_nvfp4: experts module {name!r}, {err}. The model is unchanged") from None
    for proj in naming:
        used.update(f"{prefix}{x}.{proj}.{k}" for x in range(e) for k in (*fmt.required, fmt.input_name)
                    if f"{prefix}{x}.{proj}.{k}" in names)
    static_of = {p: m.static_scale for p, m in zip(("gate", "up", "down"), (probe.gate, probe.up, probe.down))}
    scale = ("static" if all(static_of.values()) else "dynamic" if not any(static_of.values()) else
             f"static for {', '.join(p for p, s in static_of.items() if s)}; dynamic for "
             f"{', '.join(p for p, s in static_of.items() if not s)} (not every expert stores one)")
    report.replaced[name] = f"Fp4MoeExperts({e} experts, {h} -> {i} -> {h}, mode={mode}, activation scale {scale})"
    return Job(name, build, target_device(name, device, dev))


def _forward_difference(module: nn.Module) -> str | None:
    """Why ``module``'s own forward is not what ``Fp4MoeExperts`` computes (per routed slot ``act_fn(gate) * up``,
    then ``down_proj``, weighted and summed), or None. Its forward runs on a copy with small random weights of its E
    experts, on tokens large enough to pass a clamp that bites only on large activations, beside that computation: a
    clamp, a norm of its own, a two-argument activation or another gate shows as a difference (they loaded silently
    and computed something else, or failed on the first forward)."""
    if type(module).forward is nn.Module.forward:  # none of its own: nothing the replacement could contradict
        return None
    extra = sorted({n.split(".")[0] for n, _ in (*module.named_parameters(), *module.named_buffers())}
                   - {"gate_up_proj", "down_proj", "act_fn"} | {n for n, _ in module.named_children()} - {"act_fn"})
    if extra:
        return f"it holds {extra} beside gate_up_proj, down_proj and act_fn, which an Fp4MoeExperts would drop"
    e, h, i, t = module.gate_up_proj.shape[0], 16, 8, 6
    g = torch.Generator().manual_seed(0)
    probe = copy.copy(module)  # its attributes (act_fn, a limit) as they are, small weights of its own
    probe._parameters = {"gate_up_proj": nn.Parameter(torch.randn(e, 2 * i, h, generator=g), requires_grad=False),
                         "down_proj": nn.Parameter(torch.randn(e, h, i, generator=g), requires_grad=False)}
    x, k = torch.randn(t, h, generator=g) * 8, min(2, e)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    try:
        with torch.no_grad():
            gate, up = torch.einsum("tkoh,th->tko", probe.gate_up_proj[idx], x).chunk(2, dim=-1)
            want = (torch.einsum("tkhi,tki->tkh", probe.down_proj[idx], module.act_fn(gate) * up) * w[..., None]).sum(1)
            # the class's own maths: transformers' decorator would run the experts implementation the config picks
            # (a CUDA-only kernel, say), which computes the same on the device it serves
            got = inspect.unwrap(type(module).forward)(probe, x, idx, w)
    except Exception as err:  # noqa: BLE001 - what it needs is not what an Fp4MoeExperts has: refused
        return f"its forward could not be checked against act_fn(gate) * up, then down_proj ({describe_exception(err)})"
    diff = float((got - want).abs().max() / want.abs().max())
    return None if diff <= 1e-4 else (f"its forward does not compute act_fn(gate) * up, then down_proj, as an "
                                      f"Fp4MoeExperts does (on small random weights they differ by {diff:.2g} "
                                      "relative: a clamp, a norm or another gate)")


def _check_projection(pattern, e, n_out, k_in, fmt, shards, names, module) -> None:
    """Every expert of one projection stores the tensors it needs, its weight of the model's shape."""
    for x in range(e):
        p = pattern.format(x)
        missing = [p + k for k in fmt.required if p + k not in names]
        if missing:
            raise InvalidInputError(f"load_nvfp4: experts module {module!r} is quantized in the checkpoint but "
                                    f"{', '.join(repr(m) for m in missing)} {'is' if len(missing) == 1 else 'are'} "
                                    f"missing (the model has {e} experts)")
        w = shards.probe(p + fmt.weight_name)
        if tuple(w.shape) != (n_out, k_in // 2):
            hint = " (stored transposed)" if tuple(w.shape) == (k_in // 2, n_out) else ""
            raise InvalidInputError(f"load_nvfp4: {p + fmt.weight_name!r} has shape {tuple(w.shape)}; the model's "
                                    f"experts need [N, K/2] = ({n_out}, {k_in // 2}){hint}")


def _projection(get, pattern, e, fmt, names, mode, static) -> Fp4Experts:
    """One projection's E experts (``pattern`` formats the expert index into the tensor-name prefix)."""
    w, s, g, inputs = [], [], [], []
    encode = fmt.kind != "modelopt"
    for x in range(e):
        p = pattern.format(x)
        w.append(get(p + fmt.weight_name))
        s.append(get(p + "weight_scale"))
        gname = p + fmt.required[2]
        g.append(scalar_scale(get(gname), gname, "load_nvfp4", allow_spread=False, encode=encode, spread=_SPREAD))
        if static and p + fmt.input_name in names:
            iname = p + fmt.input_name
            # per fused shard: ModelOpt's largest decode scale, as Fp4Linear takes it; an encode scale must agree
            inputs.append(scalar_scale(get(iname), iname, "load_nvfp4", allow_spread=not encode, encode=encode,
                                       spread=INPUT_SPREAD))
    inp = inputs if static and len(inputs) == e else None
    if fmt.kind == "modelopt":
        return Fp4Experts.from_modelopt(w, s, g, inp, mode=mode)
    return Fp4Experts.from_compressed_tensors(w, s, g, inp, mode=mode)
