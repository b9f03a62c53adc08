"""The backend protocol (documented in docs/backends.md).

A backend is a small object with a ``name`` that
  * says why it cannot run on a device at all (``unavailable(device) -> reason | None``: library missing, SM refused);
  * says why it cannot run one problem (``unsupported(problem) -> reason | None``: alignment, out dtype);
  * offers configs to tune (``configs(problem) -> list[Config]``, ``[{}]`` when there is nothing to tune): a
    JSON-able dict, or a frozen dataclass with ``to_json() -> dict``; that JSON form is what the cache stores, and a
    cached config is used again only if it equals the JSON form of a config the backend still offers;
  * computes ``ops.out = alpha * dequant(ops.a) @ dequant(ops.b).T`` from canonical operands
    (``run(problem, ops, config)``); adapting to a library's own layout is the backend's job;
  * names the ops it computes (``ops``, default ``("fp4_mm",)``): ``"w4a16"`` is ``alpha * a @ dequant(b).T`` with
    ``a`` bf16/fp16 as given (``w4a16_mm``; ``problem.op`` says which op a problem is); ``"grouped"`` is
    ``fp4_grouped_mm``, run on ``GroupedOperands`` (each expert's rows of ``a`` against its own weight);
    ``"w4a16_grouped"`` is ``w4a16_grouped_mm``, the same with ``a`` bf16/fp16 as given (``a_scale`` empty).

``compiles_ahead`` marks a backend whose ``run`` launches only through ``kernels.runtime.launch`` (Triton kernels):
inside ``runtime.compiles_ahead`` such a run starts the compiles of its kernels not yet compiled instead of launching
them, so that the tuner compiles all of a key's configs at once (``dispatch/precompile.py``). A backend whose run
does other work (a library's kernels, a cache filled from its operands) leaves it False. ``compiles_on_first_run``
marks a library that compiles a new shape's kernels in its first call (Humming): the tuner runs it once in a thread
meanwhile.

``set_cache_root(root)`` (optional): a backend that keeps a cache of its own (``loop:fp4_mm``'s dispatcher) is told
the directory of the dispatcher that holds it, and keeps it under that one.

``risky`` marks native kernels whose crash can poison the CUDA context: with isolation on they are probed in a
worker process, and they are probed after the safe backends. Imports of optional libraries happen lazily inside
``unavailable``/``run`` so that a missing library never breaks ``import fp4dispatch``.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..problem import Operands, Problem

__all__ = ["Backend", "BaseBackend", "Config", "config_id", "config_json", "OPS", "backend_ops", "computes",
           "probe_op"]

OPS = ("fp4_mm", "w4a16", "grouped", "w4a16_grouped")

Config = Any  # a JSON-able dict, or a frozen dataclass with to_json() -> dict


def config_json(config: Config) -> dict:
    """The JSON form of a config: what the cache stores and what a cached config is matched by."""
    to_json = getattr(config, "to_json", None)
    return to_json() if to_json is not None else dict(config)


def backend_ops(backend) -> tuple[str, ...]:
    """The ops ``backend`` computes (a backend without ``ops`` computes ``fp4_mm`` only)."""
    return getattr(backend, "ops", ("fp4_mm",))


def computes(backend, op: str) -> bool:
    return op in backend_ops(backend)


def probe_op(backend) -> str:
    """The op a backend's device probe computes: ``fp4_mm`` where it computes that, else its first op."""
    ops = backend_ops(backend)
    return "fp4_mm" if "fp4_mm" in ops else ops[0]


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
    ops: tuple[str, ...] = ("fp4_mm",)
    fp4_tensor_cores = False  # multiplies on FP4 tensor cores (what makes W4A4 pay: Fp4Linear's mode="auto")
    compiles_ahead = False  # its run only launches Triton kernels through runtime.launch (see above)
    compiles_on_first_run = False  # its first call at a new shape compiles kernels (see above)

    def first_run_unit(self, problem: Problem) -> tuple:
        """The problems one first run compiles for (``compiles_on_first_run``): by default a whole shape."""
        return self.name, problem.n, problem.k, problem.out_dtype, problem.a_dtype, problem.experts

    def set_cache_root(self, root) -> None:
        """The cache directory of the dispatcher that holds it (see above); no cache of its own by default."""

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
