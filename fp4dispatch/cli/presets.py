"""Where the tuner's shapes come from: ``--shape`` specs, M lists, model presets, and Hugging Face ``config.json``.

A model is turned into the (N, K) of each of its linear layers on one tensor-parallel rank (``Gemm``), then crossed
with a list of M (tokens). Layer rules, with TP = ``--tp``:

* attention (GQA): fused qkv ``N = (heads/TP * (2 if attn_output_gate) + 2*max(1, kv_heads/TP)) * head_dim``,
  ``K = hidden`` (KV heads are replicated when TP > kv_heads, as vLLM and SGLang do); o_proj ``N = hidden``,
  ``K = heads*head_dim/TP``.
* attention (MLA, when ``kv_lora_rank`` is set): fused q_a+kv_a ``N = q_lora_rank + kv_lora_rank + qk_rope_head_dim``,
  ``K = hidden`` (replicated, not split); q_b ``N = heads*(qk_nope+qk_rope)/TP``, ``K = q_lora_rank``; kv_b
  ``N = heads*(qk_nope+v_head_dim)/TP``, ``K = kv_lora_rank``; o_proj ``N = hidden``, ``K = heads*v_head_dim/TP``.
* linear attention (Gated DeltaNet, when ``linear_num_value_heads`` is set): in_proj_qkvz
  ``N = (2*key_heads*key_dim + 2*value_heads*value_dim)/TP``, ``K = hidden``; out_proj ``N = hidden``,
  ``K = value_heads*value_dim/TP``. (in_proj_ba, N = 2*value_heads/TP, is left out: too small to matter.)
* dense MLP: gate_up ``N = 2*intermediate/TP``, ``K = hidden``; down ``N = hidden``, ``K = intermediate/TP``.
* MoE routed experts: gate and up ``N = moe_intermediate`` each (one key: ``Fp4MoeExperts``, which ``load_nvfp4``
  builds, runs them as two grouped calls), ``K = hidden``; down ``N = hidden``, ``K = moe_intermediate`` -- NOT split
  by TP: serving stacks run experts expert-parallel, each expert whole on one GPU, E/EP experts per rank (``--ep``).
  With ``--op fp4_mm`` they are ``fp4_grouped_mm`` keys of E/EP experts whose T is M x ``num_experts_per_tok`` (M
  tokens per rank after the dispatch, each routed to top-k experts: the rows of one grouped call); with ``--op
  w4a16`` ``w4a16_grouped_mm`` keys.
* MoE shared expert: like the dense MLP with ``shared_expert_intermediate_size`` (or ``n_shared_experts *
  moe_intermediate_size``), split by TP.

Not modelled: embeddings, lm_head, routers, DSA indexer projections (all usually kept in bf16). Which layers a given
NVFP4 checkpoint really quantizes is in its ``quantization_config``; the presets list every projection above.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..problem import M_BUCKETS, m_bucket

__all__ = ["Gemm", "ConfigError", "PRESETS", "DEFAULT_MS", "gemms_from_config", "preset_gemms", "read_hf_config",
           "parse_m_spec", "parse_shape_spec", "parse_positive", "default_shapes", "expand_shapes", "ShapeSpec",
           "check_size", "config_rows", "MAX_ELEMENTS", "negative_values"]

BLOCK = 16  # NVFP4: one e4m3 scale per 16 K-elements, so K must be a multiple of 16
DEFAULT_MS = (1, 16, 128, 1024, 4096)
MAX_ELEMENTS = 2**31 - 1  # the largest M, N, K and operand (M*K, N*K, M*N) a shape may have


class ConfigError(ValueError):
    """A model config, preset or shape spec cannot be turned into GEMM shapes (the message says why and how)."""


@dataclass(frozen=True)
class Gemm:
    """One linear layer on one TP rank: out[M, n] = x[M, k] @ W[n, k].T; ``skip`` says why it cannot be NVFP4."""

    layer: str
    n: int
    k: int
    skip: str | None = None
    experts: int = 0  # routed experts on this rank: an fp4_grouped_mm of that many experts (0: a dense layer)
    top_k: int = 0  # experts per token (num_experts_per_tok)


@dataclass
class ShapeSpec:
    """One tuning key's shape: M (the M tuned at), N, K and the layers that share it."""

    m: int
    n: int
    k: int
    layers: list[str] = field(default_factory=list)
    experts: int = 0  # E of an fp4_grouped_mm key (m is then T, the routed rows); 0: a dense key


_DEEPSEEK_V3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
                "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3}

# Published config.json values of each preset (an NVFP4 checkpoint keeps the base model's shapes).
PRESETS: dict[str, dict] = {
    # zai-org/GLM-5 (architecture GlmMoeDsaForCausalLM). Values: GLM-5 technical report table (hidden 6144, dense
    # intermediate 12288, MoE intermediate 2048, 64 heads, q/kv LoRA 2048/512, V head dim 256, 3 dense layers,
    # 256 experts + 1 shared, top-8), as quoted at https://glennklockwood.com/garden/GLM-5, and NVIDIA NeMo AutoModel's
    # GlmMoeDsaConfig defaults (https://docs.nvidia.com/nemo/automodel/nemo-automodel/nemo_automodel/components/
    # models/glm_moe_dsa/config): qk_nope_head_dim 192, qk_rope_head_dim 64, num_key_value_heads 64.
    "glm-5-nvfp4": {
        "source": "zai-org/GLM-5 config.json via the GLM-5 technical report and NVIDIA NeMo GlmMoeDsaConfig",
        "config": {"hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
                   "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
                   "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
                   "n_shared_experts": 1, "first_k_dense_replace": 3, "num_experts_per_tok": 8},
    },
    # Qwen/Qwen3.5-397B-A17B text_config. Values: NVIDIA Megatron-LM MIMO example config for Qwen3.5-397B-A17B
    # ("All values match the HuggingFace text_config"): hidden 4096, 32 heads, 2 KV heads, head_dim 256, attention
    # output gate, 512 experts (top-10) with moe_ffn 1024 and shared expert 1024, every layer MoE, Gated DeltaNet
    # with 16 key / 64 value heads of dim 128.
    "qwen3.5-397b-a17b-nvfp4": {
        "source": "Qwen/Qwen3.5-397B-A17B text_config via NVIDIA Megatron-LM's Qwen3.5-397B-A17B config",
        "config": {"hidden_size": 4096, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
                   "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True,
                   "num_experts": 512, "num_experts_per_tok": 10, "linear_num_key_heads": 16,
                   "linear_num_value_heads": 64,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128},
    },
    # deepseek-ai/DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json; the NVFP4
    # release nvidia/DeepSeek-V3-0324-FP4 keeps it): 128 heads, MLA ranks 1536/512, 256 experts top-8.
    "deepseek-v3-nvfp4": {
        "source": "deepseek-ai/DeepSeek-V3 config.json",
        "config": _DEEPSEEK_V3,
    },
    # moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's architecture with 64 heads, 384 experts, one dense layer.
    "kimi-k2-nvfp4": {
        "source": "moonshotai/Kimi-K2-Instruct config.json",
        "config": {**_DEEPSEEK_V3, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
                   "first_k_dense_replace": 1},
    },
    # meta-llama/Llama-3.1-70B config.json (https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json):
    # hidden 8192, intermediate 28672, 64 heads, 8 KV heads, 80 layers; head_dim = 8192/64 = 128.
    "llama-3.1-70b-nvfp4": {
        "source": "meta-llama/Llama-3.1-70B config.json",
        "config": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                   "num_key_value_heads": 8},
    },
}

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _need(cfg: dict, key: str, where: str) -> int:
    v = cfg.get(key)
    if v is None:
        raise ConfigError(f"{where}: key {key!r} is missing; it is needed to compute the layer shapes. Add it "
                          f"(see the model's config.json on Hugging Face) or tune explicit shapes with --shape M,N,K")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{where}: {key} must be a positive integer; got {v!r}")
    return v


def _optional(cfg: dict, key: str, where: str, default: int, least: int = 1) -> int:
    """``cfg[key]`` checked as ``_need`` checks its keys (an integer >= ``least``), or ``default`` when absent or
    null."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ConfigError(f"{where}: {key} must be {'a positive integer' if least else 'an integer >= 0'}; got {v!r}")
    return v


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ConfigError(f"--tp {tp} does not divide {what}={value}; choose a TP size that divides it")
    return value // tp


def gemms_from_config(cfg: dict, tp: int = 1, where: str = "config", ep: int = 1) -> list[Gemm]:
    """The per-rank linear layers of a model described by Hugging Face config keys (see the module docstring)."""
    if tp < 1 or ep < 1:
        raise ConfigError(f"--tp and --ep must be positive integers; got {tp}, {ep}")
    if ep > 1 and not any(cfg.get(k) for k in _EXPERT_KEYS):
        raise ConfigError(f"--ep {ep} splits routed experts, and {where} has none ({', '.join(_EXPERT_KEYS)} unset); "
                          "drop --ep")
    hidden = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    h_tp = _split(heads, tp, "num_attention_heads")
    out: list[Gemm] = []
    if cfg.get("kv_lora_rank") is not None:
        kv_lora = _need(cfg, "kv_lora_rank", where)
        nope, rope = _need(cfg, "qk_nope_head_dim", where), _need(cfg, "qk_rope_head_dim", where)
        v_dim = _need(cfg, "v_head_dim", where)
        q_lora = cfg.get("q_lora_rank")
        if q_lora is not None:
            q_lora = _need(cfg, "q_lora_rank", where)
            out.append(Gemm("attn.q_a+kv_a", q_lora + kv_lora + rope, hidden))
            out.append(Gemm("attn.q_b", h_tp * (nope + rope), q_lora))
        else:  # MLA without a query LoRA (DeepSeek-V2-Lite style): a plain q_proj
            out.append(Gemm("attn.q", h_tp * (nope + rope), hidden))
            out.append(Gemm("attn.kv_a", kv_lora + rope, hidden))
        out.append(Gemm("attn.kv_b", h_tp * (nope + v_dim), kv_lora))
        out.append(Gemm("attn.o", hidden, h_tp * v_dim))
    else:
        kv = _need(cfg, "num_key_value_heads", where)
        # Llama configs do not publish head_dim; transformers derives it the same way
        head_dim = _optional(cfg, "head_dim", where, hidden // heads)
        if head_dim < 1:
            raise ConfigError(f"{where}: head_dim is absent and hidden_size // num_attention_heads = {hidden} // "
                              f"{heads} = 0; add head_dim")
        kv_tp = _split(kv, tp, "num_key_value_heads") if kv >= tp else 1
        gate = cfg.get("attn_output_gate", False)
        if not isinstance(gate, bool):  # "false" is truthy: it doubled the qkv width without a word
            raise ConfigError(f"{where}: attn_output_gate must be true or false (a JSON boolean); got {gate!r}")
        q_heads = h_tp * (2 if gate else 1)
        out.append(Gemm("attn.qkv", (q_heads + 2 * kv_tp) * head_dim, hidden))
        out.append(Gemm("attn.o", hidden, h_tp * head_dim))
    if cfg.get("linear_num_value_heads") is not None:
        kh, vh = _need(cfg, "linear_num_key_heads", where), _need(cfg, "linear_num_value_heads", where)
        kd, vd = _need(cfg, "linear_key_head_dim", where), _need(cfg, "linear_value_head_dim", where)
        out.append(Gemm("linear_attn.in_qkvz", _split(2 * kh * kd + 2 * vh * vd, tp, "linear attention width"),
                        hidden))
        out.append(Gemm("linear_attn.out", hidden, _split(vh * vd, tp, "linear_num_value_heads*linear_value_head_dim")))
    has_experts = any(cfg.get(k) for k in _EXPERT_KEYS)
    inter, moe_inter = cfg.get("intermediate_size"), cfg.get("moe_intermediate_size")
    if inter is None and moe_inter is None:
        raise ConfigError(f"{where}: neither 'intermediate_size' nor 'moe_intermediate_size' is set; one is needed "
                          "for the MLP shapes. Add it or tune explicit shapes with --shape M,N,K")
    dense = inter is not None and (not has_experts or _optional(cfg, "first_k_dense_replace", where, 0, 0) > 0
                                   or bool(cfg.get("mlp_only_layers")))
    if dense:
        i_tp = _split(_need(cfg, "intermediate_size", where), tp, "intermediate_size")
        out += [Gemm("mlp.gate_up", 2 * i_tp, hidden), Gemm("mlp.down", hidden, i_tp)]
    if has_experts or moe_inter is not None:
        # experts whole on one GPU (expert parallel); Mixtral-style configs size experts with intermediate_size
        e = _need(cfg, "moe_intermediate_size" if moe_inter is not None else "intermediate_size", where)
        key = next((k for k in _EXPERT_KEYS if cfg.get(k)), _EXPERT_KEYS[0])
        n_exp = _need(cfg, key, where)
        if n_exp % ep:
            raise ConfigError(f"--ep {ep} does not divide {key}={n_exp}; choose an EP size that divides it")
        top_k = _need(cfg, "num_experts_per_tok", where)
        if top_k > n_exp:
            raise ConfigError(f"{where}: num_experts_per_tok={top_k} exceeds {key}={n_exp} (a token is routed to that "
                              "many distinct experts); fix the config")
        # gate and up as Fp4MoeExperts runs them: two grouped calls of N = e (a fused gate_up of 2e it never runs)
        out += [Gemm("expert.gate/up", e, hidden, experts=n_exp // ep, top_k=top_k),
                Gemm("expert.down", hidden, e, experts=n_exp // ep, top_k=top_k)]
        shared = (_optional(cfg, "shared_expert_intermediate_size", where, 0, 0)
                  or _optional(cfg, "n_shared_experts", where, 0, 0) * e)
        if shared:
            s_tp = _split(shared, tp, "shared expert intermediate size")
            out += [Gemm("shared_expert.gate_up", 2 * s_tp, hidden), Gemm("shared_expert.down", hidden, s_tp)]
    return [g if g.k % BLOCK == 0 else replace(g, skip=f"K={g.k} (at --tp {tp}) is not a multiple of {BLOCK}, so "
                                                    "this layer cannot be NVFP4; it is skipped") for g in out]


def preset_gemms(name: str, tp: int = 1, ep: int = 1) -> list[Gemm]:
    """The per-rank GEMMs of preset ``name`` at tensor parallelism ``tp`` and expert parallelism ``ep``."""
    if name not in PRESETS:
        raise ConfigError(f"--preset must be one of {sorted(PRESETS)}; got {name!r}")
    return gemms_from_config(PRESETS[name]["config"], tp, where=f"preset {name}", ep=ep)


def read_hf_config(path: str | Path) -> dict:
    """A Hugging Face config.json as a dict; a multimodal config's ``text_config`` when it holds the LM."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--hf-config: no such file {str(p)!r}; pass the path of a model's config.json") from None
    except (OSError, ValueError, RecursionError) as e:  # deep nesting recurses in the parser
        raise ConfigError(f"--hf-config: cannot read {str(p)!r} as JSON ({type(e).__name__}: {str(e)[:100]}); pass a "
                          "model's config.json") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--hf-config: {str(p)!r} must hold a JSON object; got {type(cfg).__name__}")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        return cfg["text_config"]
    return cfg


# -- M and shape specs --------------------------------------------------------------------------------------------
def parse_positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"must be a positive integer; got {text!r}")
    return int(text)



_M_FORM = "an integer, a list 1,16,128, or a range 1-8192 (expanded to the M buckets)"


def _pos_int(text: str, what: str, spec: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(f"{spec!r}: {what} must be a positive integer; got {text!r}") from None
    if v < 1:
        raise ConfigError(f"{spec!r}: {what} must be a positive integer; got {v}")
    if v > MAX_ELEMENTS:
        raise ConfigError(f"{spec!r}: {what} must be at most {MAX_ELEMENTS} (2**31 - 1); got {v}")
    return v


def check_size(m: int, n: int, k: int, what: str) -> None:
    """ConfigError unless A (M x K), a weight (N x K; one expert's) and out (M x N) each hold at most
    ``MAX_ELEMENTS`` elements: the tuner allocates them, and kernels index them with 32-bit offsets."""
    for name, x, y in (("A (M*K)", m, k), ("the weight (N*K)", n, k), ("out (M*N)", m, n)):
        if x * y > MAX_ELEMENTS:
            raise ConfigError(f"{what}: {name} = {x}*{y} = {x * y} elements, over the bound of {MAX_ELEMENTS} "
                              "(2**31 - 1) per operand; tune a smaller shape (every M above 8192 shares the 8192 "
                              "bucket)")


def config_rows(gemms: list[Gemm], ms: list[int]) -> list[tuple]:
    """(M, N, K, layer, experts) of each NVFP4 layer of ``gemms`` at each M of ``ms`` (a routed expert's M is T = M x
    top-k), each checked by ``check_size``."""
    rows = [(m * (g.top_k or 1), g.n, g.k, g.layer, g.experts) for g in gemms if g.skip is None for m in ms]
    for m, n, k, layer, experts in rows:
        check_size(m, n, k, f"{layer} (N={n}, K={k}) at {'T' if experts else 'M'}={m}")
    return rows


def negative_values(argv: list[str]) -> list[str]:
    """``--shape -1,64,64`` as ``--shape=-1,64,64`` (and ``--m``'s likewise): argparse takes a value that starts with
    '-' (and is not a number) for an option and says only "expected one argument"; joined, the spec's check names it."""
    out: list[str] = []
    for a in argv:
        if out and out[-1] in ("--shape", "--m") and re.match(r"-\d", a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _m_items(items: list[str], spec: str) -> list[int]:
    ms: list[int] = []
    for item in items:
        if "-" in item[1:]:  # a range; "-1" is a negative M
            cut = item.index("-", 1)  # "-2-5": the start is "-2", named as such
            lo_s, hi_s = item[:cut], item[cut + 1:]
            lo, hi = _pos_int(lo_s, "the range start", spec), _pos_int(hi_s, "the range end", spec)
            if lo > hi:
                raise ConfigError(f"{spec!r}: M range {item!r} must go up (start <= end), e.g. 1-8192")
            # one M per bucket the range touches, tuned at the bucket's edge (or at the range end inside it)
            ms += [min(b, hi) for b in M_BUCKETS if m_bucket(lo) <= b <= m_bucket(hi)]
        else:
            ms.append(_pos_int(item, "M", spec))
    return ms


def parse_m_spec(spec: str) -> list[int]:
    """``"1,16,128"`` / ``"1-8192"`` / a mix -> list of M."""
    items = [s.strip() for s in spec.split(",")]
    if not spec.strip() or any(not s for s in items):
        raise ConfigError(f"M list {spec!r} must be {_M_FORM}")
    return _m_items(items, spec)


def parse_shape_spec(spec: str) -> list[tuple[int, int, int]]:
    """``"M,N,K"`` where M may be a list (``1,16,128,N,K``) or a range (``1-8192,N,K``) -> [(m, n, k), ...]."""
    items = [s.strip() for s in spec.split(",")]
    if len(items) < 3 or any(not s for s in items):
        got = (f"value {items.index('')+1} of {len(items)} is empty (a comma too many?)" if "" in items else
               f"got {len(items)} comma-separated value{'s' if len(items) != 1 else ''}")
        raise ConfigError(f"--shape {spec!r}: expected M,N,K where M is {_M_FORM}, e.g. --shape 1-8192,4096,4096; "
                          f"{got}")
    n = _pos_int(items[-2], "N", spec)
    k = _pos_int(items[-1], "K", spec)
    if k % BLOCK:
        raise ConfigError(f"--shape {spec!r}: K={k} must be a multiple of {BLOCK} (one e4m3 scale per {BLOCK} "
                          f"values); pad K to {-(-k // BLOCK) * BLOCK}")
    ms = _m_items(items[:-2], spec)
    check_size(max(ms), n, k, f"--shape {spec!r}")
    return [(m, n, k) for m in ms]


def expand_shapes(shapes: list[tuple]) -> list[ShapeSpec]:
    """Merge (m, n, k, layer[, experts]) rows that share a tuning key (M bucket, N, K, experts): one entry per key,
    sorted, keeping the largest M of the bucket and every layer name."""
    keyed: dict[tuple[int, int, int, int], ShapeSpec] = {}
    for m, n, k, layer, *e in shapes:
        experts = e[0] if e else 0
        s = keyed.setdefault((m_bucket(m), n, k, experts), ShapeSpec(m, n, k, experts=experts))
        s.m = max(s.m, m)
        if layer and layer not in s.layers:
            s.layers.append(layer)
    return [keyed[key] for key in sorted(keyed, key=lambda t: (t[3], t[1], t[2], t[0]))]


def default_shapes(on_gpu: bool) -> list[tuple[int, int, int, str]]:
    """The no-argument run: on a GPU a small mix of common LLM layer shapes (Llama-3.1-8B's qkv, o, gate_up, down:
    hidden 4096, intermediate 14336, 32 heads, 8 KV heads) at M 1..4096; on a CPU, small shapes that the exact
    reference finishes in seconds."""
    if not on_gpu:
        return [(m, n, k, "cpu-small") for m in (1, 16, 128) for n, k in ((256, 512), (512, 256))]
    layers = (("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 28672, 4096), ("8b.down", 4096, 14336))
    return [(m, n, k, name) for m in DEFAULT_MS for name, n, k in layers]
