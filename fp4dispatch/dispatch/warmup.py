"""Deciding many keys ahead of their first calls: ``warmup`` decides them, after ``compile_keys`` has compiled, at
once, the kernels all of them will try. A mixin of :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher`: it uses the
dispatcher's lock, states, choices, forced backend and ``_candidates``."""
from __future__ import annotations

import torch

from ..problem import Problem
from .choice import Choice, resolve_device
from .records import key_str
from .precompile import compile_keys_ahead

__all__ = ["Warmup"]


class Warmup:
    def warmup(self, shapes, *, out_dtype: torch.dtype = torch.bfloat16, device=None,
               activations: torch.dtype = torch.uint8, experts: int = 0) -> dict[tuple, Choice]:
        """Decide every (M, N, K) of ``shapes`` now, proven at that M; ``activations`` bf16/fp16: w4a16_mm's keys;
        ``experts`` E > 0: fp4_grouped_mm's keys (w4a16_grouped_mm's with bf16/fp16 ``activations``; M is then T,
        the routed rows of all E experts). The kernels of all new keys are compiled first, at once."""
        dev = resolve_device(device)
        problems = {(m, n, k): Problem(int(m), int(n), int(k), out_dtype, dev, activations, int(experts))
                    for m, n, k in shapes}
        self.compile_keys(problems.values())
        return {s: self.choose(p) for s, p in problems.items()}

    def compile_keys(self, problems) -> int:
        """Compile at once, before they are decided one by one, the kernels that the undecided keys of ``problems``
        will try (``precompile.compile_keys_ahead``: every Triton config of every key on one thread pool, and one
        first run per ``first_run_unit`` of a library that compiles on its first run, in threads beside it); returns
        how many keys that was.
        Nothing is decided or timed here; without CUDA, or with a backend forced, it does nothing."""
        jobs, seen = [], set()
        with self._lock:
            for p in problems:
                if p.device.type != "cuda" or self._forced is not None or p.key in seen:
                    continue
                seen.add(p.key)
                cache, _ = self._state(p.device, p.op)
                if p.key not in self._choices and key_str(p.key) not in cache.decisions:
                    candidates = self._candidates(p.key, p)[0]
                    if candidates:
                        jobs.append((p, candidates))
        compile_keys_ahead(jobs)
        return len(jobs)
