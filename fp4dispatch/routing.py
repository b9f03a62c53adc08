"""Routings for ``fp4_grouped_mm``'s checks, tuning and benchmarks: which expert each routed row belongs to, as
``offs`` (int32 [E], each expert's cumulative end row).

A MoE layer routes each token to its ``top_k`` highest-scoring experts; real routers are uneven (some experts get
many tokens, many get none at small batch), which random router logits reproduce well enough to time kernels on.
"""
from __future__ import annotations

import torch

from .errors import InvalidInputError

__all__ = ["topk_counts", "offs_from_counts", "check_routing", "timing_routing", "DEFAULT_TOP_K"]

DEFAULT_TOP_K = 8  # DeepSeek-V3/R1, Kimi-K2, GLM-5 and Qwen3-30B-A3B route each token to 8 experts


def topk_counts(tokens: int, experts: int, top_k: int, *, seed: int = 0, device="cpu",
                skip_first: bool = False, bias: float = 1.0) -> torch.Tensor:
    """Rows per expert (int64 [E]) when ``tokens`` tokens each pick the ``top_k`` largest of random router logits
    (``skip_first``: expert 0 is never picked, so that a check always holds an expert without rows). ``bias``: the
    spread of a per-expert bias added to every token's logits (0: every expert equally likely; the default 1 as
    uneven as trained routers are; 3: a few hot experts take most tokens). ``tokens``, ``experts``, ``top_k``: ints
    >= 0 (InvalidInputError otherwise)."""
    if not (isinstance(bias, (int, float)) and 0 <= bias < float("inf")):
        raise InvalidInputError(f"topk_counts: bias must be a finite number >= 0; got {bias!r}. Pass 0 for uniform "
                                "routing, 1 for a trained router's spread, larger for a few hot experts")
    for name, v in (("tokens", tokens), ("experts", experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidInputError(f"topk_counts: {name} must be an int >= 0; got {v!r}. Pass e.g. "
                                    f"topk_counts(64, 256, 8) (64 tokens, 256 experts, top-8)")
    top_k = min(top_k, experts - int(skip_first))
    if tokens == 0 or top_k <= 0:
        return torch.zeros(experts, dtype=torch.int64, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    logits += bias * torch.randn(1, experts, generator=g, device=device)
    if skip_first:
        logits[:, 0] = -float("inf")
    picked = logits.topk(top_k, dim=1).indices.flatten()
    return torch.bincount(picked, minlength=experts)


def offs_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """Rows per expert (an integer tensor [E], or a sequence of ints) -> ``offs`` (int32 [E], cumulative end rows)."""
    if not isinstance(counts, torch.Tensor):
        try:
            counts = torch.tensor(counts, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise InvalidInputError(f"offs_from_counts: counts must be rows per expert, an integer tensor [E] or a "
                                    f"sequence of ints; got {type(counts).__name__}") from None
    if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise InvalidInputError(f"offs_from_counts: counts must be a 1-D integer tensor [E] of rows per expert; got "
                                f"dtype={counts.dtype}, shape={tuple(counts.shape)}")
    return torch.cumsum(counts, 0).to(torch.int32)


def _check_sizes(who: str, rows: object, experts: object) -> None:
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise InvalidInputError(f"{who}: rows must be an int >= 0; got {rows!r}")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise InvalidInputError(f"{who}: experts must be an int >= 1 (a table has one end row per expert); got "
                                f"{experts!r}")


def check_routing(rows: int, experts: int, seed: int, device) -> torch.Tensor:
    """``offs`` of exactly ``rows`` rows for a correctness check: mostly a top-8 routing of random logits with expert
    0 left empty (trimmed to ``rows``); every fourth seed, all rows on the last expert (one expert's tile loop runs
    across the whole batch)."""
    _check_sizes("check_routing", rows, experts)
    if seed % 4 == 3 or experts == 1:
        counts = torch.zeros(experts, dtype=torch.int64, device=device)
        counts[-1] = rows
        return offs_from_counts(counts)
    return _topk_rows(rows, experts, seed, device, skip_first=experts > 1)


def timing_routing(rows: int, experts: int, seed: int, device) -> torch.Tensor:
    """``offs`` of exactly ``rows`` rows for timing (what the tuner times a grouped key on): a top-8 routing of
    random logits, as a decode or prefill step of a MoE model routes its tokens, trimmed to ``rows``."""
    _check_sizes("timing_routing", rows, experts)
    return _topk_rows(rows, experts, seed, device, skip_first=False)


def _topk_rows(rows: int, experts: int, seed: int, device, skip_first: bool) -> torch.Tensor:
    top_k = min(DEFAULT_TOP_K, max(1, experts - int(skip_first)))
    counts = topk_counts(-(-rows // top_k), experts, top_k, seed=seed, device=device, skip_first=skip_first)
    excess = int(counts.sum()) - rows
    # drop the excess rows from the fullest experts (the last token's picks): the counts still sum to rows
    while excess > 0:
        i = int(counts.argmax())
        take = min(excess, int(counts[i]) - 1) or 1
        counts[i] -= take
        excess -= take
    return offs_from_counts(counts)
