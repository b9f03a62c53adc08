"""``flashinfer:trtllm``: FlashInfer's TRT-LLM-gen FP4 GEMM, which needs the weight *shuffled*.

FlashInfer prepares a trtllm weight with ``nvfp4_quantize(w, gs, do_shuffle=True)``: the packed rows are permuted by
``shuffle_matrix_a(w, epilogue_tile_m=128)`` and the linear scales by the same row permutation before the 128x4
interleave, reshaped to [N, K/16] (so N % 128 == 0 and K % 64 == 0, no padding). No other backend reads that form.

Choice (documented in docs/backends.md): fp4_mm keeps the canonical weight and prepares the shuffled copy itself,
**once per weight**, in a small LRU cache bounded in entries and bytes. The key is the weight's and its scale's
storage, offset, shape, stride and autograd version counter, and each entry holds weak references to both storages,
so an in-place change (``w.copy_(...)``) or a freed weight whose memory is reused is never served stale. Not seen: a
write that bypasses the version counter (through ``.data``, DLPack or a raw pointer) and in-place changes of
inference-mode tensors (they have no version counter); call :func:`clear_prepared_weights` after such a write.
When the working set exceeds the cache, weights are re-shuffled on every call; that is logged once as a warning.
"""
from __future__ import annotations

import importlib
import logging
import threading
import weakref
from collections import OrderedDict, deque
from typing import Callable

import torch

from ..format import BLOCK, swizzle_scales, unswizzle_scales
from ..problem import Operands, Problem
from ._native import alignment_reason
from .flashinfer import FlashInferBackend

__all__ = ["FlashInferTrtllmBackend", "PreparedWeightCache", "prepare_trtllm_weight", "clear_prepared_weights"]

log = logging.getLogger("fp4dispatch")

EPILOGUE_TILE_M = 128  # what FlashInfer's nvfp4_quantize(do_shuffle=True) uses
DEFAULT_MAX_ENTRIES = 64
DEFAULT_MAX_BYTES = 1 << 30

_ALL_CACHES: "weakref.WeakSet[PreparedWeightCache]" = weakref.WeakSet()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, _version(t))


def prepare_trtllm_weight(b: torch.Tensor, b_scale: torch.Tensor, n: int, k: int,
                          row_indices: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The shuffled weight ``(b_shuffled uint8 [N, K/2], b_sf_shuffled uint8 [N, K/16])`` that trtllm reads.

    ``row_indices`` is FlashInfer's ``get_shuffle_matrix_a_row_indices`` (``new_row r = old_row idx[r]``). The scale
    interleave is fp4dispatch's own 128x4 swizzle, the same layout as FlashInfer's ``block_scale_interleave`` but
    plain torch (no JIT module needed).
    """
    b8 = b.view(torch.uint8)
    idx = row_indices(b8, EPILOGUE_TILE_M).to(b.device)
    b_sh = b8[idx].contiguous()
    lin = unswizzle_scales(b_scale.view(torch.uint8), n, k // BLOCK)
    sf_sh = swizzle_scales(lin[idx].contiguous()).reshape(n, k // BLOCK)
    return b_sh, sf_sh


class PreparedWeightCache:
    """LRU of prepared weights, bounded in entries and bytes, keyed so that a changed or freed weight misses."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (refs, prepared, nbytes)
        self._bytes = 0
        self._evicted: deque[tuple] = deque(maxlen=1024)
        self._lock = threading.Lock()
        self._warned = False
        self.hits = self.misses = 0
        _ALL_CACHES.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def get(self, b: torch.Tensor, b_scale: torch.Tensor, prepare: Callable[[], tuple]) -> tuple:
        """The prepared form of (b, b_scale), made by ``prepare()`` on a miss."""
        key = (b.device, _tensor_key(b), _tensor_key(b_scale))
        sb, ss = b.untyped_storage(), b_scale.untyped_storage()
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e[0][0]() is sb and e[0][1]() is ss:
                self._entries.move_to_end(key)
                self.hits += 1
                return e[1]
        prepared = prepare()
        nbytes = sum(t.numel() * t.element_size() for t in prepared)
        drop = self._make_dropper(key)
        refs = (weakref.ref(sb, drop), weakref.ref(ss, drop))
        with self._lock:
            self.misses += 1
            if key[:2] in self._evicted and not self._warned:
                self._warned = True
                log.warning("fp4dispatch: flashinfer:trtllm re-shuffles weights on every call: its prepared-weight "
                            "cache (%d entries, %d MiB) is smaller than the working set; raise it with "
                            "fp4dispatch.backends.flashinfer_trtllm.PreparedWeightCache limits or disable it with "
                            "FP4DISPATCH_DISABLE=flashinfer:trtllm", self.max_entries, self.max_bytes >> 20)
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            if nbytes <= self.max_bytes:
                self._entries[key] = (refs, prepared, nbytes)
                self._bytes += nbytes
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                k, (_, _, nb) = self._entries.popitem(last=False)
                self._bytes -= nb
                self._evicted.append(k[:2])
        return prepared

    def _make_dropper(self, key: tuple) -> Callable:
        self_ref = weakref.ref(self)

        def drop(_ref) -> None:  # the weight (or its scale) was freed: its prepared copy goes too
            cache = self_ref()
            if cache is None:
                return
            with cache._lock:
                e = cache._entries.pop(key, None)
                if e is not None:
                    cache._bytes -= e[2]

        return drop


def clear_prepared_weights() -> None:
    """Drop every prepared trtllm weight (after a weight write the version counter cannot see)."""
    for cache in list(_ALL_CACHES):
        cache.clear()


class FlashInferTrtllmBackend(FlashInferBackend):
    """``mm_fp4(backend="trtllm")`` with the shuffled weight prepared once per weight (bf16 out, SM100/103)."""

    _transient = ("_lib", "_checked", "prepared")

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__("trtllm")
        self._limits = (max_entries, max_bytes)
        self.prepared = PreparedWeightCache(max_entries, max_bytes)

    def _reset_transient(self) -> None:
        super()._reset_transient()
        self.prepared = PreparedWeightCache(*self._limits)

    def _backend_rules(self, problem: Problem, cc: int) -> str | None:
        if problem.out_dtype != torch.bfloat16:
            return f"trtllm writes bfloat16 only; got out_dtype={problem.out_dtype}"
        return alignment_reason(problem, 128, 64, "trtllm's shuffled weight (rows permuted in 128-row tiles)")

    def operands(self, problem: Problem, ops: Operands) -> tuple:
        def prepare() -> tuple:
            row_indices = importlib.import_module("flashinfer.utils").get_shuffle_matrix_a_row_indices
            return prepare_trtllm_weight(ops.b, ops.b_scale, problem.n, problem.k, row_indices)

        b_sh, sf_sh = self.prepared.get(ops.b, ops.b_scale, prepare)
        return ops.a, b_sh.T, ops.a_scale.view(torch.uint8), sf_sh.T, ops.alpha
