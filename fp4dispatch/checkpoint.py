"""``load_nvfp4``: an NVFP4 checkpoint (ModelOpt or compressed-tensors) into a model, one ``Fp4Linear`` per quantized
``nn.Linear`` and one ``Fp4MoeExperts`` per transformers experts module whose experts are quantized
(``checkpoint_experts``), streamed shard by shard.

The two formats (docs/integration.md, "Run a ModelOpt / llm-compressor NVFP4 checkpoint"):

- ModelOpt (``quantization_config.quant_method == "modelopt"``, ``quant_algo == "NVFP4"``, or the older
  ``hf_quant_config.json``): per Linear ``weight`` uint8 [N, K/2], ``weight_scale`` e4m3 [N, K/16],
  ``weight_scale_2`` fp32 (a decode scale), optional ``input_scale`` fp32 (a decode scale); ``exclude_modules``.
- compressed-tensors (``quant_method == "compressed-tensors"``, format ``nvfp4-pack-quantized``): ``weight_packed``
  uint8 [N, K/2], ``weight_scale`` e4m3 [N, K/16], ``weight_global_scale`` fp32 [1] (an encode scale), optional
  ``input_global_scale`` fp32 [1]; ``ignore``.

Stored scales are used as they are, never recomputed from the weights. Each module the checkpoint stores is one
layer with its own scales: modules are never fused here, so shards that carry different global scales stay exact.
Tensors that are not quantized (embeddings, norms, excluded layers) are copied into the model's own parameters.

Nothing changes until everything is decided: every module to replace is planned (``checkpoint_jobs``: its
constructors' checks run on meta tensors of the stored dtypes and shapes), every plain tensor's shape compared and
``strict``'s refusals found; only then are modules replaced and tensors copied, so an error leaves the model as it
was. A model on the meta device is materialized on ``device``.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .checkpoint_experts import experts_job, is_experts_module
from .checkpoint_jobs import Job, linear_job, target_device
from .checkpoint_shards import Shards, missing_path, model_names, read_json
from .errors import InvalidInputError
from .modes import MODES
from .nn import Fp4Linear

__all__ = ["load_nvfp4", "LoadReport", "Nvfp4Format", "nvfp4_format", "read_quantization_config"]

_WHO = "load_nvfp4"
_SUPPORTED = ("fp4dispatch loads NVFP4 checkpoints of NVIDIA ModelOpt (quant_method 'modelopt', quant_algo 'NVFP4') "
              "and compressed-tensors / llm-compressor (quant_method 'compressed-tensors', format "
              "'nvfp4-pack-quantized')")


@dataclass(frozen=True)
class Nvfp4Format:
    """What ``load_nvfp4`` reads: ``kind`` ("modelopt" or "compressed-tensors") and the modules left unquantized
    (``excluded``: ModelOpt's fnmatch patterns, compressed-tensors' names or ``re:`` regexes)."""

    kind: str
    excluded: tuple[str, ...] = ()

    @property
    def weight_name(self) -> str:
        return "weight" if self.kind == "modelopt" else "weight_packed"

    @property
    def required(self) -> tuple[str, ...]:
        return (("weight", "weight_scale", "weight_scale_2") if self.kind == "modelopt"
                else ("weight_packed", "weight_scale", "weight_global_scale"))

    @property
    def input_name(self) -> str:
        return "input_scale" if self.kind == "modelopt" else "input_global_scale"

    def exclusion(self, module: str) -> str | None:
        """The pattern that leaves ``module`` unquantized, or None."""
        for p in self.excluded:
            if p.startswith("re:"):
                if re.fullmatch(p[3:], module) or re.fullmatch(p[3:], module.rsplit(".", 1)[-1]):
                    return p
            elif module == p or fnmatch.fnmatchcase(module, p) or module.endswith("." + p):
                return p
        return None


def read_quantization_config(path: str | Path) -> dict:
    """The ``quantization_config`` of a checkpoint folder: config.json's, else ModelOpt's hf_quant_config.json."""
    d = Path(path)
    err = missing_path(d)
    if err is not None:
        raise err
    cfg = d / "config.json"
    if cfg.is_file():
        q = read_json(cfg).get("quantization_config")
        if q:
            return q
    hq = d / "hf_quant_config.json"
    if hq.is_file():
        q = read_json(hq).get("quantization", {})
        return {"quant_method": "modelopt", **q}
    raise InvalidInputError(f"{_WHO}: {str(d)!r} has no quantization_config in config.json and no "
                            f"hf_quant_config.json: it is not a quantized checkpoint. {_SUPPORTED}; pass "
                            "quantization_config= if the checkpoint keeps it elsewhere")


def nvfp4_format(qcfg: dict) -> Nvfp4Format:
    """The checkpoint format of a ``quantization_config``; raises InvalidInputError for anything but NVFP4 with
    16-element groups."""
    if not isinstance(qcfg, dict):
        raise InvalidInputError(f"{_WHO}: quantization_config must be a dict; got {type(qcfg).__name__}")
    method = qcfg.get("quant_method")
    if method == "modelopt":
        algo = str(qcfg.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise InvalidInputError(f"{_WHO}: the checkpoint is ModelOpt {qcfg.get('quant_algo')!r}, not NVFP4. "
                                    f"{_SUPPORTED}")
        _group_size(qcfg.get("group_size", 16), "group_size")
        for gname, g in (qcfg.get("config_groups") or {}).items():  # newer exports describe their groups too
            _group_size((g.get("weights") or {}).get("group_size", 16), f"config_groups.{gname}.weights.group_size")
        return Nvfp4Format("modelopt", tuple(qcfg.get("exclude_modules") or qcfg.get("ignore") or ()))
    if method == "compressed-tensors":
        groups = qcfg.get("config_groups") or {}
        if not groups:
            raise InvalidInputError(f"{_WHO}: the compressed-tensors quantization_config has no config_groups")
        for gname, g in groups.items():
            fmt = g.get("format") or qcfg.get("format")
            if fmt != "nvfp4-pack-quantized":
                raise InvalidInputError(f"{_WHO}: compressed-tensors group {gname!r} has format {fmt!r}, not "
                                        f"'nvfp4-pack-quantized'. {_SUPPORTED}")
            w = g.get("weights") or {}
            if w.get("num_bits") != 4 or w.get("type") != "float":
                raise InvalidInputError(f"{_WHO}: compressed-tensors group {gname!r} quantizes weights to "
                                        f"{w.get('num_bits')}-bit {w.get('type')}, not NVFP4 (4-bit float)")
            _group_size(w.get("group_size"), f"config_groups.{gname}.weights.group_size")
        return Nvfp4Format("compressed-tensors", tuple(qcfg.get("ignore") or ()))
    raise InvalidInputError(f"{_WHO}: quant_method {method!r} (quant_algo {qcfg.get('quant_algo')!r}) is not an "
                            f"NVFP4 checkpoint. {_SUPPORTED}; FP8, MXFP4, AWQ and GPTQ checkpoints are other formats")


def _group_size(g: object, where: str) -> None:
    if g != 16:
        raise InvalidInputError(f"{_WHO}: {where} must be 16 (NVFP4: one e4m3 scale per 16 values); got {g!r}")


@dataclass
class LoadReport:
    """What ``load_nvfp4`` did: ``replaced`` module -> what it became, ``skipped`` module -> why it stayed,
    ``loaded`` plain tensors copied into the model, ``unused`` checkpoint tensors that nothing took, ``missing``
    tensors of the model's state dict that the checkpoint did not fill (they keep their initial values), ``on_meta``
    tensors of a model built on the meta device that nothing filled (no data: e.g. a non-persistent buffer such as
    a rotary ``inv_freq``, which no checkpoint holds; set them before running the model)."""

    format: str
    replaced: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    on_meta: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.format} checkpoint: {len(self.replaced)} modules replaced (Fp4Linear, Fp4MoeExperts), "
                 f"{len(self.skipped)} left as they are, {len(self.loaded)} plain tensors loaded, "
                 f"{len(self.unused)} unused, {len(self.missing)} of the model's not in the checkpoint"]
        lines += [f"  replaced {m}: {what}" for m, what in self.replaced.items()]
        lines += [f"  skipped  {m}: {why}" for m, why in self.skipped.items()]
        lines += [f"  unused   {n}" for n in self.unused]
        lines += [f"  missing  {n}" for n in self.missing]
        lines += [f"  on meta  {n} (no data)" for n in self.on_meta]
        return "\n".join(lines)


def load_nvfp4(model: nn.Module, checkpoint, *, quantization_config: dict | None = None, device=None,
               mode: str = "auto", static_activation_scales: bool = True, strict: bool = True) -> LoadReport:
    """Replace every quantized ``nn.Linear`` of ``model`` with an ``Fp4Linear`` holding the checkpoint's tensors.

    Args:
        model: a model whose module names are the checkpoint's (e.g. a transformers model made with
            ``from_config``, on a device or on the meta device); changed in place. A model an earlier load changed
            loads again (its ``Fp4Linear`` / ``Fp4MoeExperts`` are replaced with the checkpoint's).
        checkpoint: a checkpoint folder (config.json + safetensors shards), one .safetensors file, or a state dict
            (then ``quantization_config`` is needed).
        quantization_config: the checkpoint's, when not read from its config.json.
        device: where the layers and tensors go (default: each module's current device). Needed for a model on
            the meta device: its tensors are made there.
        mode: the mode of every replaced layer and experts module ("auto", "w4a4", "w4a16").
        static_activation_scales: use the stored activation scales (``input_scale`` / ``input_global_scale``) for
            W4A4; False: dynamic per-call scaling even where they are stored.
        strict: raise when quantized tensors have no module to take them (or an experts module is not of the
            stacked form) or a tensor of the model's state dict is not in the checkpoint; False: load what fits and
            list the rest in the report (``skipped``, ``unused``, ``missing``).

    Returns:
        A :class:`LoadReport`. Raises InvalidInputError, with the model unchanged, for a checkpoint that is not
        NVFP4, a missing tensor (named with its module), a weight whose shape does not fit the model (transposed or
        another model's), or what ``strict`` refuses.
    """
    if mode not in MODES:
        raise InvalidInputError(f"{_WHO}: mode must be one of {MODES}; got {mode!r}. 'auto' picks W4A4 where FP4 "
                                "tensor cores serve it, else W4A16")
    if isinstance(model, (nn.Linear, Fp4Linear)):
        kind = "an nn.Linear" if isinstance(model, nn.Linear) else "an Fp4Linear"
        raise InvalidInputError(f"{_WHO}: model is {kind} itself; it can only replace Linear submodules. "
                                "Wrap it (e.g. nn.Sequential(linear)) with names matching the checkpoint's")
    if quantization_config is None:
        if isinstance(checkpoint, dict):
            raise InvalidInputError(f"{_WHO}: checkpoint is a state dict: pass quantization_config= (the "
                                    "checkpoint's config.json 'quantization_config')")
        p = Path(checkpoint)
        err = missing_path(p)
        if err is not None:
            raise err
        quantization_config = read_quantization_config(p if p.is_dir() else p.parent)
    fmt = nvfp4_format(quantization_config)
    dev = torch.device(device) if device is not None else None
    shards = Shards(checkpoint, dev or torch.device("cpu"))
    try:
        shards.use_names(model_names(model, shards.names()))  # as transformers renames them for this model
        report, jobs, copies = _plan(model, fmt, shards, dev, mode, static_activation_scales, strict)
        report.loaded = [shards.stored_name(n) for n in report.loaded]  # as the checkpoint names them
        report.unused = sorted(shards.stored_name(n) for n in report.unused)
        if strict:
            _check_complete(report)
        for job in jobs:  # every check passed: now the model changes
            layer = job.build(shards.get).to(job.device)
            parent, _, child = job.name.rpartition(".")
            _carry_over(model.get_submodule(job.name), layer)
            setattr(model.get_submodule(parent) if parent else model, child, layer)
        if jobs:
            _mark_quantized(model)
        made: dict[int, torch.Tensor] = {}
        owners = None  # of meta tensors: indexed once, when the first is met
        with torch.no_grad():
            for n, t in copies:
                src = shards.get(n)
                if id(t) in made:  # a tied tensor made on this load
                    made[id(t)].copy_(src)
                elif t.is_meta:
                    owners = _owners(model) if owners is None else owners
                    made[id(t)] = _materialize(owners, t, src.to(dev, t.dtype))
                else:
                    t.copy_(src)
    finally:
        shards.close()
    return report


# the replaced module's forward hooks and pre-hooks (the same dicts: their handles still remove them)
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs")


def _carry_over(old: nn.Module, new: nn.Module) -> None:
    """What the model set on a module that ``new`` replaces: train/eval, and its forward hooks (a model in eval()
    got its new layers in training mode, and hooks on them stopped firing)."""
    new.train(old.training)
    for name in _HOOKS:
        if getattr(old, name, None):
            setattr(new, name, getattr(old, name))


def _mark_quantized(model: nn.Module) -> None:
    """Sets ``config._is_quantized`` on every module with a transformers config, as transformers' own quantizers do:
    models read a Linear's ``weight`` directly unless it is set (Jamba's and FalconMamba's ``dt_proj.weight @ x``,
    which a packed weight would not compute), and flash attention takes its dtype from the config, not from the
    first Linear's weight. transformers leaves it out of a saved config."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type"):
            config._is_quantized = True


def _plan(model, fmt, shards, dev, mode, static, strict) -> tuple[LoadReport, list[Job], list]:
    """(the report, the modules to replace, the plain tensors to copy: (name, the model's tensor)); raises for
    anything the checkpoint and the model disagree on, before anything changes."""
    report, names, used = LoadReport(fmt.kind), shards.names(), set()
    jobs: list[Job] = []
    replaced: set[str] = set()
    for name, module in model.named_modules():
        if _inside(name, replaced):  # a child of a module being replaced (an earlier load's Fp4MoeExperts)
            continue
        if isinstance(module, (nn.Linear, Fp4Linear)):
            parent = type(model.get_submodule(name.rpartition(".")[0])).__name__
            job = linear_job(name, module, fmt, shards, names, used, report, dev, mode, static, parent)
        elif is_experts_module(module):
            job = experts_job(name, module, fmt, shards, names, used, report, dev, mode, static, strict)
        else:
            continue
        if job is not None:
            jobs.append(job)
            replaced.add(name)

    def kept(n: str) -> bool:  # a tensor of the model that stays (not one of a replaced module)
        return not _inside(n, replaced)

    # a tied tensor under its first name only, as before: a second checkpoint tensor of another name is unused
    own = {n: t for n, t in (*model.named_parameters(), *model.named_buffers()) if kept(n)}
    copies = []
    for n in sorted(names - used):
        t = own.get(n)
        if t is None:
            continue
        src = shards.probe(n)
        if tuple(src.shape) != tuple(t.shape):
            raise InvalidInputError(f"{_WHO}: checkpoint tensor {n!r} has shape {tuple(src.shape)}; the model's "
                                    f"has {tuple(t.shape)}: the checkpoint is not of this model")
        target_device(n, t.device, dev)  # a model on the meta device needs device=
        copies.append((n, t))
        used.add(n)
        report.loaded.append(n)
    report.unused = sorted(names - used)
    filled = {id(t) for _, t in copies}
    report.missing = sorted(report.missing + [n for n, t in model.state_dict(keep_vars=True).items()
                                              if n not in used and kept(n) and t.numel() and id(t) not in filled])
    report.on_meta = sorted(n for n, t in own.items() if t.is_meta and id(t) not in filled)
    return report, jobs, copies


def _inside(name: str, modules: set[str]) -> bool:
    """Whether ``name`` (a module's or a tensor's) lies inside one of ``modules`` (one lookup per enclosing name)."""
    i = name.rfind(".")
    while i > 0:
        name = name[:i]
        if name in modules:
            return True
        i = name.rfind(".")
    return False


def _owners(model: nn.Module) -> dict[int, list[tuple[dict, str]]]:
    """id of each meta tensor -> where the model holds it ((a module's parameter or buffer dict, key)): tied weights
    have several owners. One walk of the model, however many tensors are materialized."""
    out: dict[int, list[tuple[dict, str]]] = {}
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for k, v in store.items():
                if v is not None and v.is_meta:
                    out.setdefault(id(v), []).append((store, k))
    return out


def _materialize(owners: dict, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Put ``new`` (data) in place of the meta tensor ``old`` wherever the model holds it (``_owners``); a parameter
    stays a parameter."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for store, k in owners.get(id(old), ()):
        store[k] = new
    return new


_QUANTIZED = (".weight_scale", ".weight_scale_2", ".weight_packed", ".weight_global_scale", ".input_scale",
              ".input_global_scale")


def _check_complete(report: LoadReport) -> None:
    """``strict``'s refusals, found while planning: raised before the model changes."""
    orphans = [n for n in report.unused if n.endswith(_QUANTIZED)]
    if orphans:
        raise InvalidInputError(
            f"{_WHO}: {len(orphans)} quantized checkpoint tensors have no nn.Linear or transformers experts module in "
            f"the model to take them (first: {orphans[:3]}): the model keeps those weights another way, or it is not "
            "the checkpoint's model. The model is unchanged: pass strict=False to load the rest and find them in the "
            "report's unused list")
    if report.missing:
        raise InvalidInputError(
            f"{_WHO}: {len(report.missing)} tensors of the model are not in the checkpoint and would keep their "
            f"initial values (first: {report.missing[:3]}). The model is unchanged: pass strict=False to accept "
            "that (the report lists them as missing)")
