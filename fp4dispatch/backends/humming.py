"""``humming:w4a16`` and ``humming:w4a4``: Humming (``pip install humming-kernels``, imported as ``humming``), the
quantized GEMM library vLLM ships for Hopper. ``w4a16`` runs the NVFP4 weight against activations decoded to
bf16/fp16 (any GPU from SM75); ``w4a4`` takes the FP4 activations as they are (SM100+, ``HummingW4A4Backend``).

How ``fp4_mm`` maps onto it (humming-kernels 0.1.20: ``layer.py``, ``schema/modelopt.py``, ``forward.py``,
``config/config.py``, ``tune/``; docs/backends.md):

- ``a`` is decoded exactly to the out dtype (every e2m1 x e4m3 product is exact in bf16 and fp16); its global scale
  stays in alpha. The decode is one small kernel per call, counted in the tuner's timing.
- The weight goes in as ModelOpt's tensors: ``weight`` uint8 [N, K/2] (low nibble = even k, as fp4dispatch's),
  ``weight_scale`` e4m3 [N, K/16] row-major (fp4dispatch's swizzled scales, unswizzled) and ``weight_scale_2`` fp32
  ``(1,)``; ``transform()`` repacks it into Humming's kernel layout. That is done once per weight
  (``_native.PreparedWeightCache``), never per call.
- alpha is passed as each call's ``weight_scale_2``: Humming reads that device tensor in its fp32 epilogue when the
  kernel runs (``out = cast(weight_scale_2 * sum(x * e2m1 * e4m3))``), so the result is the contract's with no host
  sync and nothing of alpha baked into the prepared weight.
- Stream-K is never used: it adds partial sums into the 16-bit output in an order that changes from call to call
  (two identical calls gave different bits on the H200), and fp4dispatch returns the same bits for the same call. The
  tuning config Humming's heuristics choose is passed with ``use_stream_k`` off.
- Out: bf16 or fp16 (Humming's output dtype is its activation dtype). N % 64 == 0 and K % 32 == 0 (its padded tile;
  fp4dispatch does not pad), N % 128 == 0 on SM90 (``tune/sm90_policies.py`` asserts a four-warp WGMMA group of
  32-column warps along N: N = 1216, 1344, 192 raised there on the H200, 1280 and 1408 ran).
- Kernels are compiled on first use (NVRTC or nvcc), so a probe in a worker gets ``PROBE_TIMEOUT_S`` at least.
  ``humming_forward`` compiles every config of the tuning table it is given on its first run (some 30 for a dense
  shape), so a dense layer is given, per M bucket, only the table's entries that serve that bucket's M
  (``bucket_entries``): a new key compiles its own few kernels, the same ones the whole table would run at those M.
  The table is Humming's search in Python (seconds for a grouped layer), kept on disk (``humming_tables.py``).
- A dense W4A16 call on a GPU skips ``humming_forward``'s Python: it runs that function's own two steps, the
  bucket's kernel table (``HummingKernel.prepare_kernels`` of the same strings, kept per string) and Humming's
  launcher op (``torch.ops.humming.launch_kernel.out``) with the same arguments. The W4A4 and grouped calls, whose
  inputs ``humming_forward`` processes or routes, still go through it.
"""
from __future__ import annotations

import contextlib
import json
import logging
from types import ModuleType

import torch

from ..errors import describe_exception
from ..format import BLOCK, dequantize_nvfp4, unswizzle_scales
from ..kernels.dequant import dequantize_to_scratch
from ..problem import M_BUCKETS, Operands, Problem, m_bucket
from ._native import (NativeBackend, PreparedWeightCache, aligned_alpha, alignment_reason, import_library,
                      library_installed)
from .base import Config
from .humming_compile import compile_later
from .humming_tables import heuristics_table

__all__ = ["HummingBackend", "HummingW4A4Backend", "INSTALL_HINT", "bucket_entries"]

log = logging.getLogger("fp4dispatch")
INSTALL_HINT = "pip install fp4dispatch[humming]"
PROBE_TIMEOUT_S = 120.0  # a worker's probe compiles the probe shape's kernels
_HALF = (torch.bfloat16, torch.float16)
_OUT_DTYPE_REASON = "Humming writes bfloat16/float16 only (its output dtype is the activations'); got out_dtype={}"


class HummingBackend(NativeBackend):
    """NVFP4 weight x decoded activations through ``humming.forward.humming_forward`` (SM75+, bf16 from SM80)."""

    name = "humming:w4a16"
    ops = ("fp4_mm", "w4a16")  # fp4_mm: a decoded first; w4a16: a as given
    fp4_tensor_cores = False  # 16-bit MMA on the decoded weight
    probe_timeout_s = PROBE_TIMEOUT_S
    compiles_on_first_run = True  # a new bucket's kernels: the tuner runs it once while the Triton configs compile
    input_config: dict | None = None  # None: 16-bit activations (W4A16)
    gemm_type = "dense"  # the kind of Humming GEMM whose heuristics' tuning configs are run
    tuning_per_bucket = True  # dense: each M bucket gets its own entries of the table (``bucket_entries``)
    direct_launch = True  # dense W4A16 on a GPU: the launcher op called directly (``run``)
    _transient = ("_lib", "prepared", "layers", "wanted")

    def __init__(self) -> None:
        super().__init__()
        self.prepared = PreparedWeightCache(self.name)
        self.layers: dict[tuple, tuple] = {}  # _shape(problem) -> (layer config, table), once a weight was prepared
        self.wanted: dict[tuple, int] = {}  # shape -> M whose nearest buckets compile first (compile_other_buckets)

    def _reset_transient(self) -> None:
        super()._reset_transient()
        self.prepared = PreparedWeightCache(self.name)
        self.layers, self.wanted = {}, {}

    # -- availability --------------------------------------------------------------------------------------------
    def unavailable_before_import(self, device: torch.device) -> str | None:
        """What rules Humming out here without importing it (an import takes seconds: it imports torch._dynamo), so
        that its probe worker can start before this process imports it (``health.device_health``)."""
        cc = self.device_capability(device)
        if cc is None:
            return f"needs a CUDA GPU (Humming compiles CUDA kernels); got device type {device.type!r}"
        if cc < 75:
            return f"Humming needs compute capability >= 7.5; got {cc // 10}.{cc % 10}"
        if not library_installed("humming"):
            return f"humming is not installed ({INSTALL_HINT})"
        return None

    def unavailable(self, device: torch.device) -> str | None:
        if why := self.unavailable_before_import(device):
            return why
        lib, why = _import_humming()
        self._lib = lib
        return why

    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype not in _HALF:
            return _OUT_DTYPE_REASON.format(problem.out_dtype)
        if problem.op == "w4a16" and problem.a_dtype != problem.out_dtype:
            return (f"Humming writes its activations' dtype: out_dtype must be a's dtype ({problem.a_dtype}); got "
                    f"{problem.out_dtype}")
        cc = self.device_capability(problem.device) or 0
        if problem.out_dtype == torch.bfloat16 and cc < 80:
            return "Humming's bfloat16 activations need compute capability >= 8.0; use out_dtype=torch.float16"
        if cc // 10 == 9:
            # its SM90 heuristics keep a four-warp WGMMA group of 32-column warps along N, and assert it
            return alignment_reason(problem, 128, 32, "Humming on SM90 (four 32-column warps along N)")
        return alignment_reason(problem, 64, 32, "Humming (its padded tile)")

    # -- the call ------------------------------------------------------------------------------------------------
    def weight_tensors(self, problem: Problem, ops: Operands) -> dict:
        """The weight as ModelOpt stores it and ``HummingLayer.load_from_tensors`` takes it; the global scale is 1
        here because alpha comes with each call."""
        scale = unswizzle_scales(ops.b_scale.view(torch.uint8), problem.n, problem.k // BLOCK)
        return {"weight": ops.b.view(torch.uint8), "weight_scale": scale.view(torch.float8_e4m3fn).contiguous(),
                "weight_scale_2": torch.ones(1, dtype=torch.float32, device=ops.b.device)}

    def layer_tensors(self, problem: Problem, ops: Operands) -> dict:
        """What ``load_from_tensors`` gets: the weight's tensors (and, with FP4 activations, their static scale)."""
        return self.weight_tensors(problem, ops)

    def activations(self, problem: Problem, ops: Operands) -> torch.Tensor:
        """``a`` decoded exactly to the out dtype, [M, K] (kept scratch on a GPU: no allocation per call); a
        ``w4a16`` call's ``a`` as it is."""
        if problem.op == "w4a16":
            return ops.a
        if not ops.a.is_cuda:
            return dequantize_nvfp4(ops.a, ops.a_scale, dtype=problem.out_dtype)
        return dequantize_to_scratch("humming_a", ops.a, ops.a_scale, problem.out_dtype)

    def forward_inputs(self, problem: Problem, ops: Operands, layer_extra: dict) -> dict:
        """``humming_forward``'s activation arguments."""
        return {"inputs": self.activations(problem, ops)}

    def epilogue_scale(self, problem: Problem, ops: Operands) -> torch.Tensor:
        """alpha as Humming's per-call ``weight_scale_2``: fp32 ``(1,)``, contiguous, 16-byte aligned (its launcher
        checks); a misaligned alpha is copied (on the device) into an aligned one."""
        return aligned_alpha(ops.alpha)

    def layer_options(self, problem: Problem) -> dict:
        """More ``HummingLayer`` arguments (the experts of a grouped layer)."""
        return {}

    def _prepare(self, problem: Problem, ops: Operands) -> tuple:
        lib = self._lib or self._load()
        # the layer makes its lock buffer on the current CUDA device: make it on the weight's
        with torch.cuda.device(ops.b.device) if ops.b.is_cuda else contextlib.nullcontext():
            layer = lib.layer.HummingLayer(shape_n=problem.n, shape_k=problem.k,
                                           weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                                           input_config=self.input_config,
                                           torch_dtype=problem.out_dtype,
                                           **self.layer_options(problem)).to(ops.b.device)
            layer.load_from_tensors(self.layer_tensors(problem, ops))
            layer.transform()
        tuning = heuristics_table(lib, layer.humming_config, self.gemm_type, ops.b.device)  # Stream-K off
        self.layers[_shape(problem)] = (layer.humming_config, tuning)
        self._compile_wanted(_shape(problem))
        extra = {"input_scale_2": layer.input_scale_2} if self.input_config is not None else {}
        return (layer.weight, layer.weight_scale, layer.locks, layer.humming_config,
                _Tuning(tuning, self.tuning_per_bucket), extra)

    def first_run_unit(self, problem: Problem) -> tuple:
        """The problems whose first run compiles the same kernels (``precompile``): a dense shape's M bucket, a
        grouped layer's whole shape."""
        unit = super().first_run_unit(problem)
        return unit + (problem.bucket,) if self.tuning_per_bucket else unit

    def compile_other_buckets(self, problem: Problem) -> None:
        """Compile, in the background, the kernels of ``problem``'s shape's whole table (``humming_compile``: no CUDA
        call), those nearest to its M first: now if the shape's layer was prepared, else once it is (in the first
        run of the key being decided, beside the compile of that key's own bucket). The tuner asks for this before it
        tunes a key on its first call (``KeyTuning._compile_other_buckets``)."""
        if not self.tuning_per_bucket or self.device_capability(problem.device) is None:
            return
        shape = _shape(problem)
        self.wanted[shape] = problem.m
        if shape in self.layers:
            self._compile_wanted(shape)

    def _compile_wanted(self, shape: tuple) -> None:
        """The background compile asked for ``shape``, started; it runs inside ``_prepare`` too, where anything it
        raises would fail the run it is a head start for, so that is logged and dropped."""
        m = self.wanted.pop(shape, None)
        if m is None:
            return
        config, table = self.layers[shape]
        try:
            compile_later(self._lib or self._load(), config, table, m, self.device_capability(shape[0]),
                          own=bucket_entries(table, m_bucket(m)))  # the key's first run compiles those
        except Exception as e:  # noqa: BLE001 - a head start only: each key still compiles what it needs
            log.debug("fp4dispatch: %s could not compile ahead for %s (%s)", self.name, shape, describe_exception(e))

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        # the prepared weight depends on the out dtype (Humming's layer dtype): one cache entry per dtype
        w, ws, locks, cfg, tuning, extra = self.prepared.get(ops.b, ops.b_scale, lambda: self._prepare(problem, ops),
                                                             variant=problem.out_dtype)
        lib = self._lib or self._load()
        alpha, fwd = self.epilogue_scale(problem, ops), self.forward_inputs(problem, ops, extra)
        if self.direct_launch and ops.out.is_cuda:
            # humming_forward's own two steps for a dense W4A16 layer (its input needs no processing), without the
            # per-call Python around them: the bucket's kernels (prepare_kernels, compiled on their first call,
            # then a [lo, hi, kernel, sms] table that the launcher searches by M) and its launcher op
            kernels = tuning.kernels(problem.m, lambda s: _kernels(lib, cfg, s, ops.b.device))
            torch.ops.humming.launch_kernel.out(kernels, fwd["inputs"], w, ws, alpha, None, None, None, None, ops.out,
                                                None, None, None, None, locks, 1, 0)
            return
        lib.forward.humming_forward(cfg, weight=w, weight_scale=ws, weight_scale_2=alpha, outputs=ops.out,
                                    locks=locks, tuning_config=tuning.for_m(problem.m), **fwd)

    def _import(self) -> tuple[ModuleType | None, str | None]:
        return _import_humming()


class HummingW4A4Backend(HummingBackend):
    """``humming:w4a4``: FP4 activations as they are, on block-scaled MMA (SM100+). Path B of ``humming_forward``:
    ``inputs`` uint8 [M, K/2] (ModelOpt's nibble order, fp4dispatch's), ``input_scale`` e4m3 [M, K/16] row-major
    packed four to an int32 (not the 128x4 swizzle: fp4dispatch's scales are unswizzled per call), and the layer's
    static ``input_scale_2`` (a decode scale) at 1; alpha goes in as ``weight_scale_2``, and the fp32 epilogue
    multiplies by both. The weight stays raw; ``transform()`` moves its scales into the SM100 tile layout."""

    name = "humming:w4a4"
    ops = ("fp4_mm",)
    fp4_tensor_cores = True
    input_config = {"quant_method": "modelopt", "quant_algo": "nvfp4"}  # static activation scale (input_scale)
    direct_launch = False  # humming_forward passes the activation scales its own way

    def unavailable_before_import(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is not None and cc < 100:
            return (f"Humming's FP4 activations need block-scaled MMA (SM100+); got compute capability "
                    f"{cc // 10}.{cc % 10} (humming:w4a16 runs there)")
        return super().unavailable_before_import(device)

    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype not in _HALF:
            return _OUT_DTYPE_REASON.format(problem.out_dtype)
        return alignment_reason(problem, 128, 128, "Humming's block-scaled tile")

    def layer_tensors(self, problem: Problem, ops: Operands) -> dict:
        return {**self.weight_tensors(problem, ops),
                "input_scale": torch.ones(1, dtype=torch.float32, device=ops.b.device)}

    def forward_inputs(self, problem: Problem, ops: Operands, layer_extra: dict) -> dict:
        scale = unswizzle_scales(ops.a_scale.view(torch.uint8), problem.m, problem.k // BLOCK)
        return {"inputs": ops.a.view(torch.uint8), "input_scale": scale.contiguous().view(torch.int32),
                "input_scale_2": layer_extra["input_scale_2"]}


def _shape(problem: Problem) -> tuple:
    """What a prepared layer's kernels depend on, less M (the table serves every M)."""
    return problem.device, problem.n, problem.k, problem.out_dtype, problem.a_dtype, problem.experts


def bucket_entries(table: list, bucket: int) -> list:
    """The entries of a Humming tuning table (``[lo, hi, config]``: the config of ``lo < M <= hi``) that serve M
    bucket ``bucket`` (``bucket/2 < M <= bucket``; bucket 1 is M = 1, the last bucket every larger M), the first
    widened down to 0 and the last up to the table's end, so that any M still finds an entry."""
    lo, hi = (bucket // 2 if bucket > 1 else 0), (bucket if bucket < M_BUCKETS[-1] else 1 << 62)
    entries = [list(e) for e in table if e[0] < hi and e[1] > lo] or [list(table[-1])]
    entries[0][0], entries[-1][1] = 0, table[-1][1]
    return entries


class _Tuning:
    """A prepared weight's tuning table (Stream-K off) as ``humming_forward``'s JSON string: per M bucket, or whole
    (``per_bucket`` False). A string, because ``humming_forward`` serializes a list on every call (host time that
    grows with the table) and keys its compiled kernels by that string; each string is made once, and so is each
    string's kernel table for the direct launch."""

    __slots__ = ("table", "per_bucket", "strings", "tables")

    def __init__(self, table: list, per_bucket: bool) -> None:
        self.table, self.per_bucket, self.strings, self.tables = table, per_bucket, {}, {}

    def for_m(self, m: int) -> str:
        bucket = m_bucket(m) if self.per_bucket else 0
        s = self.strings.get(bucket)
        if s is None:
            s = self.strings[bucket] = json.dumps(bucket_entries(self.table, bucket) if bucket else self.table)
        return s

    def kernels(self, m: int, prepare) -> torch.Tensor:
        """The kernel table of M's entries: ``prepare(string)``'s, made once per string."""
        s = self.for_m(m)
        t = self.tables.get(s)
        if t is None:
            t = self.tables[s] = prepare(s)
        return t


def _kernels(lib: ModuleType, cfg, tuning: str, device: torch.device) -> torch.Tensor:
    """``humming_forward``'s kernel table for a dense layer: ``HummingKernel.prepare_kernels`` of the layer's config
    string, no compute config and the tuning string, on the weight's device (as its ``prepare_kernels`` op does)."""
    with torch.cuda.device(device):
        return lib.kernel.HummingKernel.prepare_kernels(cfg.to_str(), None, tuning, device)


def _import_humming() -> tuple[ModuleType | None, str | None]:
    """``(humming, None)`` with the parts the adapter calls, or ``(None, why)``: not installed, fails to import, or
    a release without them (the adapter is written against humming-kernels 0.1.20)."""
    lib, why = import_library("humming", INSTALL_HINT)
    if lib is None:
        return None, why
    for sub, attr in (("layer", "HummingLayer"), ("forward", "humming_forward"), ("tune", "get_heuristics_config"),
                      ("kernel", "HummingKernel")):
        mod, why = import_library(f"humming.{sub}", INSTALL_HINT)
        if mod is None or not hasattr(mod, attr):
            version = getattr(lib, "__version__", "?")
            return None, (f"humming {version} lacks humming.{sub}.{attr} (fp4dispatch's adapter is written against "
                          f"humming-kernels 0.1.20){': ' + why if why else ''}")
    return lib, None
