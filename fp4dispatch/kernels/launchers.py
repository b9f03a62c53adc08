"""A table from config class to the kernel family module that launches it, as each op (``fp4_mm.py``,
``w4a16_mm.py``, ``grouped_mm.py``) keeps one: the module is imported on first use, so that a family whose
Triton features are missing here never breaks the others."""
from __future__ import annotations

import importlib
from typing import Callable

from ..errors import InvalidInputError
from .config import KernelConfig

__all__ = ["LauncherTable"]


class LauncherTable:
    """``table[config]``: the ``run`` of the family module (under fp4dispatch.kernels) that ``families`` names for
    the config's class; ``op`` and ``source`` (the heuristics function that offers its configs) name it in errors."""

    def __init__(self, op: str, source: str, families: dict[type[KernelConfig], str]):
        self.op, self.source, self.families = op, source, families
        self._run: dict[type, Callable] = {}

    def __getitem__(self, config: KernelConfig) -> Callable:
        run = self._run.get(type(config))
        if run is None:
            kind = type(config)
            if kind not in self.families:
                raise InvalidInputError(f"{self.op}: config must be one of "
                                        f"{', '.join(c.__name__ for c in self.families)} (from {self.source}); got "
                                        f"{kind.__name__}")
            run = self._run[kind] = importlib.import_module(f"{__package__}.{self.families[kind]}").run
        return run
