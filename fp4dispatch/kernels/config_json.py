"""A kernel config from its JSON form (``KernelConfig.to_json``, what the decision cache stores), for every family
of ``config.py`` and ``config_grouped.py``."""
from __future__ import annotations

from ..errors import InvalidInputError
from .config import (BytewiseGemvConfig, CudaCoreGemvConfig, CudaCoreW4A16Config, KernelConfig, MmaBf16Config,
                     MmaW4A16Config, TmaGemvConfig, TmaMmaW4A16Config, WgmmaDecodeWarpsConfig,
                     WgmmaDecodeWarpsW4A16Config, WgmmaRegisterAConfig, WgmmaRegisterAW4A16Config,
                     WgmmaWarpSpecializedConfig, WgmmaWarpSpecializedW4A16Config)
from .config_grouped import GemvGroupedConfig, MmaGroupedConfig, MmaW4A16GroupedConfig, TmaGemvGroupedConfig

__all__ = ["FAMILIES", "from_json"]

FAMILIES: dict[str, type[KernelConfig]] = {c.family: c for c in (
    BytewiseGemvConfig, CudaCoreGemvConfig, TmaGemvConfig, MmaBf16Config, WgmmaRegisterAConfig,
    WgmmaWarpSpecializedConfig, WgmmaDecodeWarpsConfig, CudaCoreW4A16Config, WgmmaRegisterAW4A16Config,
    WgmmaDecodeWarpsW4A16Config, WgmmaWarpSpecializedW4A16Config, MmaW4A16Config, MmaGroupedConfig, GemvGroupedConfig,
    MmaW4A16GroupedConfig, TmaGemvGroupedConfig, TmaMmaW4A16Config)}


def from_json(doc: dict) -> KernelConfig:
    """The config whose :meth:`KernelConfig.to_json` is ``doc`` (checked like any other)."""
    family = doc.get("family")
    if family not in FAMILIES:
        raise InvalidInputError(f"kernel config: family must be one of {sorted(FAMILIES)}; got {family!r}")
    return FAMILIES[family](**{k: v for k, v in doc.items() if k != "family"})
