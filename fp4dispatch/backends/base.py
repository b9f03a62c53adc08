"""The backend protocol (documented in docs/backends.md).

A backend is a small object with a ``name`` that
  * says why it cannot run on a device at all (``unavailable(device) -> reason | None``: library missing, SM refused);
  * says why it cannot run one problem (``unsupported(problem) -> reason | None``: alignment, out dtype);
  * offers configs to tune (``configs(problem) -> list[Config]``, ``[{}]`` when there is nothing to tune): a
    JSON-able dict, or a frozen dataclass with ``to_json() -> dict``; that JSON form is what the cache stores, and a
    cached config is used again only if it equals the JSON form of a config the backend still offers;
  * computes ``ops.out = alpha * dequant(ops.a) @ dequant(ops.b).T`` from canonical operands
    (``run(problem, ops, config)``); adapting to a library's own layout is the backend's job.

``risky`` marks native kernels whose crash can poison the CUDA context: with isolation on they are probed in a
worker process, and they are probed after the safe backends. Imports of optional libraries happen lazily inside
``unavailable``/``run`` so that a missing library never breaks ``import fp4dispatch``.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..problem import Operands, Problem

__all__ = ["Backend", "BaseBackend", "Config", "config_id", "config_json"]

Config = Any  # a JSON-able dict, or a frozen dataclass with to_json() -> dict


def config_json(config: Config) -> dict:
    """The JSON form of a config: what the cache stores and what a cached config is matched by."""
    to_json = getattr(config, "to_json", None)
    return to_json() if to_json is not None else dict(config)


def config_id(config: Config) -> str:
    """Stable short text for a config, used in cache entries and reports."""
    d = config_json(config)
    if not d:
        return "default"
    return ",".join(f"{k}={d[k]}" for k in sorted(d))


@runtime_checkable
class Backend(Protocol):
    name: str
    risky: bool

    def unavailable(self, device: torch.device) -> str | None: ...

    def unsupported(self, problem: Problem) -> str | None: ...

    def configs(self, problem: Problem) -> list[Config]: ...

    def run(self, problem: Problem, ops: Operands, config: Config) -> None: ...


class BaseBackend:
    """Convenience base: available everywhere, supports every problem, one default config."""

    name = "base"
    risky = False

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def unsupported(self, problem: Problem) -> str | None:
        return None

    def configs(self, problem: Problem) -> list[Config]:
        return [{}]

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
