"""Launch plans: the launches of one kernel ``fp4_mm`` or ``w4a16_mm`` call, recorded once and then replayed with only
the addresses that change bound, straight into the compiled kernels' launchers (:class:`Plans` keeps them per op).

An eager call through ``kernel[grid](...)`` (or even ``runtime.launch``) spends most of its host time on what is the
same for every call of one (config, M, N, K, out dtype, device): the grid, the constexprs, the compiled kernel's
handles and launcher, the views and TMA descriptors of each operand. ``record`` runs a family's ``run`` once with
``runtime.recording`` on, which captures every launch (compiled kernel, grid, full argument list) and every scratch
buffer (``workspace``). ``build`` then names each argument by where its value comes from:

- a tensor or TMA descriptor base whose address is one of the operands' (``fp4_mm``: a, b, a_scale, b_scale, alpha,
  out; ``w4a16_mm``: the same without a_scale) or a recorded scratch buffer's: bound on every call (a descriptor's
  tensor map, built by Triton's own ``make_tensordesc_arg``, is cached per address and slot: the weight's is built
  once; the map encodes only the address and the view, so it holds no reference to any tensor and needs no
  invalidation when values change in place);
- anything else (ints from the shapes, constexprs): a constant.

A plan is refused (the call keeps the ordinary path) when anything is ambiguous or unknown: two operands at one
address, an address that is none of them, an operand not 16-byte aligned (Triton specializes pointers on it), a
launcher that needs global scratch, or a Triton whose launcher is not shaped as expected. A replay also gives way to
the ordinary path while Triton's launch hooks are set (a profiler must see every launch).

Replaying launches exactly what the recorded call launched, on the current stream, so its result has the same bits.
"""
from __future__ import annotations

import dataclasses
import logging
from functools import reduce
from operator import or_

import torch

from . import runtime, workspace

__all__ = ["Plan", "Plans", "unplannable", "record", "build", "MAX_DESCRIPTORS", "MAX_PLANS"]

log = logging.getLogger("fp4dispatch")

MAX_DESCRIPTORS = 4096  # tensor maps kept per descriptor argument (one per weight address a layer shape meets)
MAX_PLANS = 1024  # plans kept per op
_data_ptr = torch.Tensor.data_ptr


def _launcher_parts(compiled) -> tuple | str:
    """(``runtime.direct_launcher``'s tuple with the C launcher itself first, tensordesc parameter indices, their
    metadata) of a compiled kernel, or why it cannot be replayed."""
    direct = runtime.direct_launcher(compiled)
    if isinstance(direct, str):
        return direct
    fn = direct[0]
    code = getattr(fn, "__code__", None)
    if code is None:  # no descriptor parameter: the launcher is the C function itself
        return direct, set(), []
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return "Triton's descriptor-expanding launcher is not shaped as this module expects"
    return (cells["launcher"], *direct[1:]), set(cells["tensordesc_indices"]), list(cells["tensordesc_meta"])


def _expand_descriptor():
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg


class _Descriptor:
    """One descriptor argument: its launcher values (tensor map, shape, strides) per base address."""
    __slots__ = ("desc", "meta", "cache", "expand")

    def __init__(self, desc, meta, expand):
        self.desc, self.meta, self.cache, self.expand = desc, meta, {}, expand

    def values(self, ptr: int) -> list:
        got = self.cache.get(ptr)
        if got is None:
            if len(self.cache) >= MAX_DESCRIPTORS:
                self.cache.clear()
            d = dataclasses.replace(self.desc, base=runtime.Address(ptr, self.desc.base.dtype))
            got = self.cache[ptr] = self.expand(d, self.meta)
        return got


class _Launch:
    """One recorded launch: the launcher's argument list with the slots that each call fills."""
    __slots__ = ("raw", "template", "pointers", "descriptors")

    def __init__(self, raw, template: list, pointers: list, descriptors: list):
        self.raw, self.template, self.pointers, self.descriptors = raw, template, pointers, descriptors

    def __call__(self, ptrs: list, stream: int) -> None:
        args = self.template.copy()
        args[3] = stream
        for pos, i in self.pointers:
            args[pos] = ptrs[i]
        for pos, end, i, d in self.descriptors:
            args[pos:end] = d.values(ptrs[i])
        self.raw(*args)


class Plan:
    """The replayable form of one call: scratch requests (``workspace``'s), then launches in order."""
    __slots__ = ("config", "device", "needs", "launches", "_kept")

    def __init__(self, config, device: torch.device, needs: tuple, launches: tuple):
        self.config, self.device, self.launches = config, device, launches
        self.needs = needs  # ("scratch", purpose, nbytes) or ("counters", tiles), in the order the call got them
        self._kept = None  # ((stream, thread, workspace.generation), addresses) of the kept buffers last used

    def __call__(self, *ops: torch.Tensor) -> bool:
        """Launch the plan on these operands (as many, in the order, of the recorded call); False (nothing launched)
        when it may not, and the caller must take the ordinary path."""
        ptrs = list(map(_data_ptr, ops))  # C-level loops: this runs on every eager call
        if reduce(or_, ptrs) & 15 or runtime.launch_hooks_set():
            return False
        stream = runtime.raw_stream(self.device.index)
        keep: list = []  # scratch allocated for this call only: alive until every launch is queued
        if self.needs:
            capturing = runtime.capturing()
            kept = self._kept
            where = (stream, workspace.thread_key(), workspace.generation)
            if not capturing and kept is not None and kept[0] == where:
                ptrs.extend(kept[1])
            else:
                got = [workspace.address(need, self.device, stream, capturing, keep) for need in self.needs]
                ptrs.extend(got)
                if not capturing and not keep:
                    self._kept = (where, got)
        for launch in self.launches:
            launch(ptrs, stream)
        return True


def unplannable(operands: tuple) -> str | None:
    """Why a call on these operands must not be recorded (what its plan would assume may not hold later), or None."""
    ptrs = [t.data_ptr() for t in operands]
    if any(p & 15 for p in ptrs):
        return "an operand is not 16-byte aligned"
    if len(set(ptrs)) != len(ptrs):
        return "two operands share an address"
    return None


def record(run) -> list:
    """Run ``run()`` (one kernel ``fp4_mm`` or ``w4a16_mm`` call) and return what it launched and which scratch it
    got."""
    rec: list = []
    runtime.recording(rec)
    try:
        run()
    finally:
        runtime.recording(None)
    return rec


def build(rec: list, operands: tuple, config, device: torch.device, expand=None) -> tuple[Plan | None, str]:
    """(the plan of a recorded call, "") or (None, why not). ``expand(descriptor, metadata)``: a descriptor's launcher
    values (default: Triton's ``make_tensordesc_arg``)."""
    ptrs = [t.data_ptr() for t in operands]
    needs = []
    for item in rec:
        if item[0] == "buffer":
            ptrs.append(item[1])
            needs.append(item[2])
    if len(set(ptrs)) != len(ptrs) or any(p & 15 for p in ptrs[:len(operands)]):
        return None, unplannable(operands) or "a scratch buffer shares an address with an operand"
    if len({n[:2] for n in needs}) != len(needs):
        # a second request of one purpose may replace the buffer the first one's address points into
        return None, "the call asked twice for scratch of one purpose"
    where = {p: i for i, p in enumerate(ptrs)}
    launches = []
    for item in rec:
        if item[0] != "launch":
            continue
        _, compiled, grid, args, tail = item
        if compiled is None:
            return None, "a kernel was launched through kernel[grid] (the interpreter, or direct launches are off)"
        parts = _launcher_parts(compiled)
        if isinstance(parts, str):
            return None, parts
        launch, why = _bind(compiled, parts, grid, [*args, *tail], where, expand)
        if launch is None:
            return None, why
        launches.append(launch)
    if not launches:
        return None, "nothing was launched"
    return Plan(config, device, tuple(needs), tuple(launches)), ""


class Plans:
    """The launch plans of one op (``fp4_mm``, ``w4a16_mm``): ``plans(ops, config, key)`` runs ``run(*ops, config)``
    (the op's ordinary path, which launches through ``runtime.launch``), on a GPU the first time of each key by
    recording it into a plan, later times by replaying that plan. ``ops`` end with out, whose device the plan runs on;
    ``key`` names the call's shapes and dtypes (all that the recorded constants depend on) and ends with the device
    index; it starts with ``id(config)``, and the entry holds the config, so that the id cannot be reused while the
    entry lives. The oldest entry goes first past MAX_PLANS (those of configs tried while tuning come first)."""

    def __init__(self, op: str, run):
        self.op, self.run = op, run
        self.table: dict[tuple, tuple] = {}  # key -> (config, Plan or None: no plan, the ordinary path)

    def __call__(self, ops: tuple, config, key: tuple) -> None:
        hit = self.table.get(key)
        if hit is not None and hit[0] is config:
            if hit[1] is None or not self.replay(key, hit, ops):
                self.run(*ops, config)
            return
        if runtime.jit_interpreted() or runtime.compiling_ahead() or unplannable(ops):
            self.run(*ops, config)
            return
        rec = record(lambda: self.run(*ops, config))
        new, why = build(rec, ops, config, ops[-1].device)
        if new is None:
            log.debug("fp4dispatch: no %s launch plan for %s at %s: %s", self.op, config, key[1:-1], why)
        if len(self.table) >= MAX_PLANS:
            self.table.pop(next(iter(self.table)))
        self.table[key] = (config, new)

    def replay(self, key: tuple, hit: tuple, ops: tuple) -> bool:
        """Replay a plan; if its launcher refuses the argument list (TypeError: a Triton whose launcher wants other
        arguments), drop the plan of this key and say so: the caller then takes the ordinary path, which relaunches
        every kernel (their writes are the same). Any other error (a CUDA one, such as a capture voided elsewhere) is
        the call's and propagates, as the ordinary path's would; the plan is kept."""
        try:
            return hit[1](*ops)
        except TypeError as e:
            self.table[key] = (hit[0], None)
            log.warning("fp4dispatch: the %s launch plan of %s failed (%s: %s); this key launches through Triton "
                        "from now on", self.op, hit[0], type(e).__name__, e)
            return False


def _bind(compiled, parts: tuple, grid: tuple, params: list, where: dict, expand) -> tuple[_Launch | None, str]:
    (raw, function, coop, pdl, packed), desc_indices, metas = parts
    template = [*grid, None, function, coop, pdl, None, None, packed, None, None, None]
    pointers, descriptors, found = [], [], set()
    for i, v in enumerate(params):
        pos = len(template)
        if isinstance(v, torch.Tensor):
            if v.data_ptr() not in where:
                return None, f"parameter {i} is a tensor that is none of the operands or scratch buffers"
            pointers.append((pos, where[v.data_ptr()]))
            template.append(None)
        elif hasattr(v, "block_shape") and hasattr(getattr(v, "base", None), "data_ptr"):
            if i not in desc_indices:
                return None, f"parameter {i} is a descriptor the launcher does not expand"
            base = v.base.data_ptr()
            if base not in where:
                return None, f"parameter {i} is a descriptor over none of the operands or scratch buffers"
            d = _Descriptor(v, metas[len(found)] if metas else None, expand or _expand_descriptor())
            width = len(d.values(base))
            descriptors.append((pos, pos + width, where[base], d))
            found.add(i)
            template.extend([None] * width)
        else:
            template.append(v)
    if found != desc_indices:
        return None, "the launcher expands descriptors at other parameters than the recorded call passed"
    return _Launch(raw, template, pointers, descriptors), ""
