"""``Fp4MoeExperts``: a transformers MoE experts module on NVFP4 ``fp4_grouped_mm``, what ``load_nvfp4`` puts in place
of a model's routed experts.

transformers (5.x) gives the routed experts of its MoE models one interface: a module with stacked ``gate_up_proj``
[E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I] parameters and an ``act_fn``, called as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` (Qwen3-MoE, Qwen3.5,
DeepSeek-V3, GLM-4.5/5, Mixtral, ...). ``Fp4MoeExperts`` takes the same call with three ``Fp4Experts`` (gate, up,
down: separate grouped GEMMs, so gate and up keep their own global scales, exactly as a checkpoint stores them):

1. the T*k routed rows are sorted by expert (a stable sort on the GPU) and ``offs`` counted there: no host sync, so
   the layer can be captured in a CUDA graph and any routing replayed;
2. ``act_fn(gate(x)) * up(x)``, then ``down``, each one ``fp4_grouped_mm`` over all experts;
3. the rows go back to (token, slot) order and are weighted and summed over the k slots in a fixed order (no
   atomic adds: the same call returns the same bits).

A slot routed to no expert of this module (an index outside [0, E), as expert parallelism marks another rank's
experts) contributes zero, and with a dynamic activation scale its row enters as zeros, so that it cannot move the
scale of this rank's rows. ``top_k_index`` must be an integer tensor, ``top_k_weights`` a floating-point one.
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import InvalidInputError
from .experts import Fp4Experts

__all__ = ["Fp4MoeExperts"]

_WANT = {"hidden_states": "a float32, bfloat16 or float16 tensor [T, H] (the tokens)",
         "top_k_index": "an integer tensor [T, k] (each token's expert ids)",
         "top_k_weights": "a floating-point tensor [T, k] (the routing weights)"}


def _ok(name: str, dtype: torch.dtype) -> bool:
    if name == "hidden_states":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    integer = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return integer if name == "top_k_index" else dtype.is_floating_point


class Fp4MoeExperts(nn.Module):
    """``forward(hidden_states, top_k_index, top_k_weights)`` of a transformers experts module, on NVFP4 experts."""

    def __init__(self, gate: Fp4Experts, up: Fp4Experts, down: Fp4Experts, act_fn: nn.Module):
        super().__init__()
        for name, p in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(p, Fp4Experts):
                raise InvalidInputError(f"Fp4MoeExperts: {name} must be an Fp4Experts (the E experts' {name} "
                                        f"projections); got {type(p).__name__}. Build it with Fp4Experts.from_modelopt "
                                        "or from_compressed_tensors, or load the model with load_nvfp4")
        if not callable(act_fn):
            raise InvalidInputError(f"Fp4MoeExperts: act_fn must be the activation module or function applied to the "
                                    f"gate projection (e.g. nn.SiLU()); got {type(act_fn).__name__}")
        e, h, i = down.num_experts, down.out_features, down.in_features
        for name, p in (("gate", gate), ("up", up)):
            if (p.num_experts, p.in_features, p.out_features) != (e, h, i):
                raise InvalidInputError(f"Fp4MoeExperts: {name} must be Fp4Experts(E={e}, in={h}, out={i}) to match "
                                        f"down (E={e}, in={i}, out={h}); got E={p.num_experts}, in={p.in_features}, "
                                        f"out={p.out_features}")
        self.gate, self.up, self.down, self.act_fn = gate, up, down, act_fn
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        for name, v in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
            if not isinstance(v, torch.Tensor) or not _ok(name, v.dtype):
                got = f"dtype={v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                fix = ("Cast the tokens to the model's dtype" if name == "hidden_states" else
                       "Pass the router's outputs as transformers does (top_k_index: the int64 indices of topk)")
                raise InvalidInputError(f"Fp4MoeExperts: {name} must be {_WANT[name]}; got {got}. {fix}")
        if not top_k_index.device == top_k_weights.device == hidden_states.device:
            raise InvalidInputError(f"Fp4MoeExperts: hidden_states, top_k_index and top_k_weights must be on one "
                                    f"device; got {hidden_states.device}, {top_k_index.device} and "
                                    f"{top_k_weights.device}. Move the router's outputs to the tokens' device")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise InvalidInputError(f"Fp4MoeExperts: hidden_states must be [T, {self.hidden_dim}]; got "
                                    f"{tuple(hidden_states.shape)}")
        t = hidden_states.shape[0]
        if top_k_index.dim() != 2 or top_k_index.shape[0] != t or tuple(top_k_weights.shape) != tuple(
                top_k_index.shape):
            raise InvalidInputError(f"Fp4MoeExperts: top_k_index and top_k_weights must both be [T={t}, k]; got "
                                    f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
        e, k = self.num_experts, top_k_index.shape[1]
        if t * k == 0:
            return torch.zeros_like(hidden_states)
        idx = top_k_index.reshape(-1).long()
        local = (idx >= 0) & (idx < e)
        idx = torch.where(local, idx, e - 1)  # computed on the last expert, then dropped: no host sync
        order = torch.argsort(idx, stable=True)
        counts = torch.zeros(e, dtype=torch.long, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = hidden_states[order // k]
        if self._scales_by_batch(x.device):
            # a dynamic scale is the amax of all routed rows: another rank's slots (run on expert E-1) must not move
            # it, so their rows enter as zeros (mid is then zero too); static and W4A16 rows are independent
            x = torch.where(local[order].unsqueeze(1), x, 0.0)
        mid = self.act_fn(self.gate(x, offs, check_offs=False)) * self.up(x, offs, check_offs=False)
        y = self.down(mid, offs, check_offs=False)
        slots = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1).float()
        # detached, as every fp4dispatch result is (no autograd through the experts): the router alone would get a
        # gradient, silently
        w = torch.where(local, top_k_weights.detach().reshape(-1).float(), 0.0).view(t, k, 1)
        out = torch.where(local.view(t, k, 1), slots * w, 0.0).sum(1)
        return out.to(hidden_states.dtype)

    def _scales_by_batch(self, device: torch.device) -> bool:
        """Whether a projection quantizes its rows with a per-call scale over all of them (dynamic W4A4)."""
        return any(not p.static_scale and p.resolved_mode(device) == "w4a4" for p in (self.gate, self.up, self.down))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"
