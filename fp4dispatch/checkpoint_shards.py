"""``load_nvfp4``'s reading of a checkpoint's tensors: a folder of safetensors shards (read one tensor at a time with
``safetensors.safe_open``, never a whole shard), a single file, or an in-memory state dict.

Everything about the files that can be wrong is found when they are opened, before ``load_nvfp4`` changes the model:
a path that does not exist, an index that names a shard the folder lacks, or a tensor the index maps to a shard that
does not hold it. ``probe`` gives what the checks need without reading the bulk data: a tensor's dtype and shape (a
meta tensor), and the values of the per-tensor scales.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import InvalidInputError

__all__ = ["Shards", "missing_path", "read_json", "model_names"]

_WHO = "load_nvfp4"
# safetensors' dtype names; a tensor of another (F4, ...) is read to be probed
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# the tensors whose values the checks read (per-tensor scales, a few elements each): probed as they are
_VALUES = (".weight_scale_2", ".input_scale", ".weight_global_scale", ".input_global_scale")


def missing_path(path: Path) -> InvalidInputError | None:
    """The error for a checkpoint path that does not exist (None where it does)."""
    if path.exists():
        return None
    return InvalidInputError(f"{_WHO}: checkpoint {str(path)!r} does not exist; pass a checkpoint folder (config.json "
                             "and *.safetensors shards), one .safetensors file, or a state dict")


def model_names(model, names: set[str]) -> dict[str, str]:
    """Stored name -> the model's name for it, where transformers renames it when it loads ``model``'s type (its
    checkpoint conversion mapping's plain renamings: Mixtral's, PhiMoE's and MiniMax's ``block_sparse_moe`` is the
    model's ``mlp``); only the names it changes. Nothing without transformers or a mapping for the type."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping
        from transformers.core_model_loading import apply_renamings

        rules = [r for r in get_checkpoint_conversion_mapping(model.config.model_type) or []
                 if isinstance(r, WeightRenaming)]
    except Exception:  # noqa: BLE001 - not a transformers model, or a transformers without these: names as stored
        return {}
    return {n: new for n in names if (new := apply_renamings(n, rules)) != n} if rules else {}


def read_json(path: Path, key: str | None = None) -> dict:
    """A checkpoint's JSON file as a dict (``key``: the dict it must hold under that name, as the index's
    ``weight_map``); InvalidInputError naming the file where it is not one (truncated, hand-edited)."""
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{_WHO}: {str(path)!r} is not valid JSON ({e}); the checkpoint is damaged: fetch "
                                "that file again") from None
    part = d.get(key) if isinstance(d, dict) and key is not None else d
    if not isinstance(part, dict):
        what = f"an object with a {key!r} object" if key is not None else "a JSON object"
        raise InvalidInputError(f"{_WHO}: {str(path)!r} must hold {what}; got {type(part).__name__}. The checkpoint "
                                "is damaged: fetch that file again")
    return part


class Shards:
    """The checkpoint's tensors by name, read on ``device``."""

    def __init__(self, src, device: torch.device):
        self.device = device
        self._dict: dict | None = None
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        self._stored: dict[str, str] = {}  # the model's name -> the stored one, where they differ (use_names)
        if isinstance(src, dict):
            self._dict = src
            return
        p = Path(src)
        err = missing_path(p)
        if err is not None:
            raise err
        index = p / "model.safetensors.index.json" if p.is_dir() else None
        if index is not None and index.is_file():
            self._where = {k: p / v for k, v in read_json(index, "weight_map").items()}
            self._check_index(index)
            return
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        if not files:
            raise InvalidInputError(f"{_WHO}: {str(p)!r} holds no *.safetensors file (nor an index)")
        for f in files:
            for k in self._handle(f).keys():
                self._where[k] = f

    def _check_index(self, index: Path) -> None:
        """Every shard the index names is there and holds the tensors it maps to it."""
        by_file: dict[Path, list[str]] = {}
        for k, f in self._where.items():
            by_file.setdefault(f, []).append(k)
        absent = sorted(f.name for f in by_file if not f.is_file())
        if absent:
            f = index.parent / absent[0]
            raise InvalidInputError(
                f"{_WHO}: {index.name} maps {len(by_file[f])} tensors (first: {by_file[f][0]!r}) to {absent[0]!r}, "
                f"which {str(index.parent)!r} does not hold ({len(absent)} of {len(by_file)} shards missing: "
                f"{absent[:3]}): the checkpoint is incomplete. Fetch the missing shards")
        held = {f: set(self._handle(f).keys()) for f in by_file}
        for f, ks in by_file.items():
            wrong = [k for k in ks if k not in held[f]]
            if wrong:
                k = wrong[0]
                where = next((g.name for g, h in held.items() if k in h), None)
                raise InvalidInputError(
                    f"{_WHO}: {index.name} maps {k!r} to {f.name!r}, which does not hold it "
                    f"({'it is in ' + repr(where) if where else 'no shard holds it'}; {len(wrong)} such in that "
                    "shard): the index is not the shards'. Rewrite the index from the shards, or fetch the checkpoint "
                    "again")

    def _handle(self, f: Path):
        h = self._open.get(f)
        if h is None:
            from safetensors import safe_open

            try:
                h = self._open[f] = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # a truncated or foreign file: safetensors' own error names no checkpoint
                raise InvalidInputError(f"{_WHO}: {str(f)!r} is not a readable safetensors file ({e}); fetch it "
                                        "again") from e
        return h

    def use_names(self, renamed: dict[str, str]) -> None:
        """Name the tensors that ``renamed`` maps (stored name -> the model's name for it) by the model's names."""
        self._stored = {new: old for old, new in renamed.items()}

    def stored_name(self, name: str) -> str:
        """The name ``name`` (the model's) has in the checkpoint."""
        return self._stored.get(name, name)

    def names(self) -> set[str]:
        stored = set(self._dict) if self._dict is not None else set(self._where)
        renamed = {old: new for new, old in self._stored.items()}
        return {renamed.get(n, n) for n in stored}

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read onto ``device``."""
        name = self.stored_name(name)
        t = self._dict[name] if self._dict is not None else self._handle(self._where[name]).get_tensor(name)
        return t.to(self.device)

    def probe(self, name: str) -> torch.Tensor:
        """What the checks read, without the bulk data: the per-tensor scales as they are (on the CPU), every other
        tensor as a meta tensor of its stored dtype and shape."""
        name = self.stored_name(name)
        if name.endswith(_VALUES):
            t = self._dict[name] if self._dict is not None else self._handle(self._where[name]).get_tensor(name)
            return t.cpu()
        if self._dict is not None:
            return torch.empty_like(self._dict[name], device="meta")
        s = self._handle(self._where[name]).get_slice(name)
        dtype = _DTYPES.get(s.get_dtype())
        if dtype is None:  # a dtype whose stored shape is not torch's (F4 counts values, torch pairs): read it
            return self._handle(self._where[name]).get_tensor(name).to("meta")
        return torch.empty(list(s.get_shape()), dtype=dtype, device="meta")

    def close(self) -> None:
        self._open.clear()
