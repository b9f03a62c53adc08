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
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .checkpoint_experts import is_experts_module, load_experts
from .errors import InvalidInputError
from .moe import Fp4MoeExperts
from .nn import Fp4Linear
from .stored import stored_weight

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
    cfg = d / "config.json"
    if cfg.is_file():
        q = json.loads(cfg.read_text()).get("quantization_config")
        if q:
            return q
    hq = d / "hf_quant_config.json"
    if hq.is_file():
        q = json.loads(hq.read_text()).get("quantization", {})
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


class _Shards:
    """The checkpoint's tensors by name: a folder of safetensors shards (read one tensor at a time with
    ``safetensors.safe_open``, never a whole shard), a single file, or an in-memory state dict."""

    def __init__(self, src, device: torch.device):
        self.device = device
        self._dict: dict | None = None
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        if isinstance(src, dict):
            self._dict = src
            return
        p = Path(src)
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        index = p / "model.safetensors.index.json" if p.is_dir() else None
        if index is not None and index.is_file():
            self._where = {k: p / v for k, v in json.loads(index.read_text())["weight_map"].items()}
            return
        if not files:
            raise InvalidInputError(f"{_WHO}: {str(p)!r} holds no *.safetensors file (nor an index)")
        for f in files:
            for k in self._handle(f).keys():
                self._where[k] = f

    def _handle(self, f: Path):
        h = self._open.get(f)
        if h is None:
            from safetensors import safe_open

            h = self._open[f] = safe_open(str(f), framework="pt", device="cpu")
        return h

    def names(self) -> set[str]:
        return set(self._dict) if self._dict is not None else set(self._where)

    def get(self, name: str) -> torch.Tensor:
        t = self._dict[name] if self._dict is not None else self._handle(self._where[name]).get_tensor(name)
        return t.to(self.device)

    def close(self) -> None:
        self._open.clear()


@dataclass
class LoadReport:
    """What ``load_nvfp4`` did: ``replaced`` module -> what it became, ``skipped`` module -> why it stayed,
    ``loaded`` plain tensors copied into the model, ``unused`` checkpoint tensors that nothing took, ``missing``
    tensors of the model's state dict that the checkpoint did not fill (they keep their initial values)."""

    format: str
    replaced: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.format} checkpoint: {len(self.replaced)} modules replaced (Fp4Linear, Fp4MoeExperts), "
                 f"{len(self.skipped)} left as they are, {len(self.loaded)} plain tensors loaded, "
                 f"{len(self.unused)} unused, {len(self.missing)} of the model's not in the checkpoint"]
        lines += [f"  replaced {m}: {what}" for m, what in self.replaced.items()]
        lines += [f"  skipped  {m}: {why}" for m, why in self.skipped.items()]
        lines += [f"  unused   {n}" for n in self.unused]
        lines += [f"  missing  {n}" for n in self.missing]
        return "\n".join(lines)


def load_nvfp4(model: nn.Module, checkpoint, *, quantization_config: dict | None = None, device=None,
               mode: str = "auto", static_activation_scales: bool = True, strict: bool = True) -> LoadReport:
    """Replace every quantized ``nn.Linear`` of ``model`` with an ``Fp4Linear`` holding the checkpoint's tensors.

    Args:
        model: a model whose module names are the checkpoint's (e.g. a transformers model made with
            ``from_config``); changed in place.
        checkpoint: a checkpoint folder (config.json + safetensors shards), one .safetensors file, or a state dict
            (then ``quantization_config`` is needed).
        quantization_config: the checkpoint's, when not read from its config.json.
        device: where the layers and tensors go (default: each module's current device).
        mode: the mode of every replaced layer and experts module ("auto", "w4a4", "w4a16").
        static_activation_scales: use the stored activation scales (``input_scale`` / ``input_global_scale``) for
            W4A4; False: dynamic per-call scaling even where they are stored.
        strict: raise when quantized tensors have no module to take them (or an experts module is not of the
            stacked form) or a tensor of the model's state dict is not in the checkpoint; False: load what fits and
            list the rest in the report (``skipped``, ``unused``, ``missing``).

    Returns:
        A :class:`LoadReport`. Raises InvalidInputError for a checkpoint that is not NVFP4, a missing tensor (named
        with its module), or a weight whose shape does not fit the model (transposed or another model's).
    """
    if quantization_config is None:
        if isinstance(checkpoint, dict):
            raise InvalidInputError(f"{_WHO}: checkpoint is a state dict: pass quantization_config= (the "
                                    "checkpoint's config.json 'quantization_config')")
        p = Path(checkpoint)
        quantization_config = read_quantization_config(p if p.is_dir() else p.parent)
    fmt = nvfp4_format(quantization_config)
    report = LoadReport(fmt.kind)
    dev = torch.device(device) if device is not None else None
    shards = _Shards(checkpoint, dev or torch.device("cpu"))
    try:
        names, used = shards.names(), set()
        if isinstance(model, nn.Linear):
            raise InvalidInputError(f"{_WHO}: model is an nn.Linear itself; it can only replace Linear submodules. "
                                    "Wrap it (e.g. nn.Sequential(linear)) with names matching the checkpoint's")
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                _load_linear(model, name, module, fmt, shards, names, used, report, dev, mode,
                             static_activation_scales)
            elif is_experts_module(module):
                load_experts(model, name, module, fmt, shards, names, used, report, dev, mode,
                             static_activation_scales, strict)
        own = dict(model.named_parameters()) | dict(model.named_buffers())
        for n in sorted(names - used):
            t = own.get(n)
            if t is None:
                continue
            src = shards.get(n)
            if tuple(src.shape) != tuple(t.shape):
                raise InvalidInputError(f"{_WHO}: checkpoint tensor {n!r} has shape {tuple(src.shape)}; the model's "
                                        f"has {tuple(t.shape)}: the checkpoint is not of this model")
            with torch.no_grad():
                t.copy_(src)
            used.add(n)
            report.loaded.append(n)
        report.unused = sorted(names - used)
        filled = {t.data_ptr() for n, t in own.items() if n in used and t.numel()}
        report.missing = sorted(report.missing + [n for n, t in model.state_dict().items()
                                if n not in used and t.numel() and t.data_ptr() not in filled  # tied weights
                                and not _fp4_owned(model, n)])
    finally:
        shards.close()
    if strict:
        _check_complete(report)
    return report


def _fp4_owned(model: nn.Module, tensor: str) -> bool:
    """Whether ``tensor`` of the state dict belongs to a module this loader made (it holds checkpoint tensors)."""
    parts = tensor.split(".")
    for j in range(len(parts) - 1, 0, -1):
        if isinstance(model.get_submodule(".".join(parts[:j])), (Fp4Linear, Fp4MoeExperts)):
            return True
    return False


_QUANTIZED = (".weight_scale", ".weight_scale_2", ".weight_packed", ".weight_global_scale", ".input_scale",
              ".input_global_scale")


def _check_complete(report: LoadReport) -> None:
    orphans = [n for n in report.unused if n.endswith(_QUANTIZED)]
    if orphans:
        raise InvalidInputError(
            f"{_WHO}: {len(orphans)} quantized checkpoint tensors have no nn.Linear or transformers experts module in "
            f"the model to take them (first: {orphans[:3]}): the model keeps those weights another way, or it is not "
            "the checkpoint's model. Pass strict=False to load the rest and find them in the report's unused list")
    if report.missing:
        raise InvalidInputError(
            f"{_WHO}: {len(report.missing)} tensors of the model are not in the checkpoint and would keep their "
            f"initial values (first: {report.missing[:3]}); pass strict=False to accept that (the report lists "
            "them as missing)")


def _load_linear(model, name, module, fmt, shards, names, used, report, dev, mode, static) -> None:
    prefix = f"{name}." if name else ""
    why = fmt.exclusion(name)
    if why is not None:
        report.skipped[name] = f"excluded by the checkpoint ({why!r})"
        return
    wname = prefix + fmt.weight_name
    if wname not in names:
        report.skipped[name] = f"not quantized in the checkpoint (no {fmt.weight_name})"
        return
    w = shards.get(wname)
    if w.dtype not in (torch.uint8, torch.int32, torch.int64) and "float4" not in str(w.dtype):
        report.skipped[name] = f"not quantized in the checkpoint ({fmt.weight_name} is {w.dtype})"
        return
    missing = [prefix + k for k in fmt.required if prefix + k not in names]
    if missing:
        raise InvalidInputError(f"{_WHO}: module {name!r} is quantized in the checkpoint ({wname!r} is there) but "
                                f"{', '.join(repr(m) for m in missing)} {'is' if len(missing) == 1 else 'are'} "
                                f"missing; found {sorted(n for n in names if n.startswith(prefix))}")
    who, scale = f"{_WHO}: module {name!r}", shards.get(prefix + "weight_scale")
    if w.dtype in (torch.int32, torch.int64):  # repacked into wider words: named before any shape is compared
        stored_weight(who, w, scale, fmt.weight_name, "weight_scale")
    n_out, k_in = module.out_features, module.in_features
    if tuple(w.shape) != (n_out, k_in // 2):
        hint = (" It is [K/2, N]: the weight is stored transposed; fp4dispatch takes the nn.Linear layout [N, K/2]"
                if tuple(w.shape) == (k_in // 2, n_out) else " The checkpoint is not of this model")
        raise InvalidInputError(f"{_WHO}: {wname!r} has shape {tuple(w.shape)}; the model's {name!r} is "
                                f"Linear({k_in}, {n_out}), so [N, K/2] = ({n_out}, {k_in // 2}) was expected.{hint}")
    stored_weight(who, w, scale, fmt.weight_name, "weight_scale")  # the scales' shape against the weight's
    t = {k: shards.get(prefix + k) for k in fmt.required[1:]}
    inp = shards.get(prefix + fmt.input_name) if static and prefix + fmt.input_name in names else None
    bias = shards.get(prefix + "bias") if prefix + "bias" in names else None
    if bias is None and module.bias is not None:  # the layer keeps the model's initial bias: say so
        bias = module.bias.detach().to(w.device)
        report.missing.append(prefix + "bias")
    if fmt.kind == "modelopt":
        layer = Fp4Linear.from_modelopt(w, t["weight_scale"], t["weight_scale_2"], inp, bias=bias, mode=mode)
    else:
        layer = Fp4Linear.from_compressed_tensors(w, t["weight_scale"], t["weight_global_scale"], inp, bias=bias,
                                                  mode=mode)
    if dev is None:
        layer = layer.to(module.weight.device)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)
    used.update(prefix + k for k in (*fmt.required, fmt.input_name, "bias") if prefix + k in names)
    report.replaced[name] = (f"Fp4Linear({k_in} -> {n_out}, mode={mode}, activation scale "
                             f"{'static' if inp is not None else 'dynamic'})")
