"""``python -m fp4dispatch.tune`` on the CPU: shape sources, presets vs the models' published configs, --json,
--self-test, profiles, exit codes, --devices processes, and a torchrun (gloo) run with two ranks."""
from __future__ import annotations

import logging

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch

from fp4dispatch.cli import distributed
from fp4dispatch.cli import presets
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.problem import Problem
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs
from fp4dispatch.tune import TuneOptions, main

REPO = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour (no CUDA device)")

# Published config.json values. GLM-5: GLM-5 technical report table (https://glennklockwood.com/garden/GLM-5 quotes
# it) and NVIDIA NeMo AutoModel's GlmMoeDsaConfig (docs.nvidia.com/nemo/automodel, glm_moe_dsa/config).
GLM_5 = {"hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_attention_heads": 64,
         "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
         "v_head_dim": 256, "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
         "num_experts_per_tok": 8}
# Qwen3.5-397B-A17B text_config: NVIDIA Megatron-LM's MIMO config for it ("All values match the HuggingFace
# text_config").
QWEN35_397B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
               "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "num_experts": 512,
               "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "attn_output_gate": True, "num_experts_per_tok": 10}
# deepseek-ai/DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json).
DEEPSEEK_V3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3}
# meta-llama/Llama-3.1-70B config.json (huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json).
LLAMA_31_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8}


def _run(capsys, argv, **kw):
    code = main(argv, **kw)
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, argv, **kw):
    code, out, err = _run(capsys, argv, **kw)
    return code, json.loads(out), err


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One fake-backend tuning run (M 1 and 16, N 256, K 512) shared by the tests that read its cache or output."""
    cdir = tmp_path_factory.mktemp("tuned") / "cache"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["--shape", "1,16,256,512", "--json", "--cache-dir", str(cdir)], backends=_fakes(),
                    do_bench=fake_do_bench)
    return code, json.loads(buf.getvalue()), cdir


def _copy(cdir: Path, tmp_path: Path) -> str:
    return str(shutil.copytree(cdir, tmp_path / "copy"))


def _fakes():
    """fast wins everywhere; flaky is second but wrong at M=16 (so dropped there); slow is last."""
    return [FakeBackend("fast", cost=1e-5), FakeBackend("slow", cost=4e-5),
            FakeBackend("flaky", cost=2e-5, wrong_for_m=(16,))]


# -- shape sources ----------------------------------------------------------------------------------------------
def test_shape_list_and_range_expand_to_m_buckets(capsys):
    code, data, _ = _json(capsys, ["--shape", "1,3,256,512", "--shape", "60-200,512,256", "--list", "--json"])
    assert code == 0
    got = [(s["m"], s["m_bucket"], s["n"], s["k"]) for s in data["shapes"]]
    # 60-200 touches buckets 64, 128 and 256; the last is tuned at the range end, 200
    assert got == [(1, 1, 256, 512), (3, 4, 256, 512), (64, 64, 512, 256), (128, 128, 512, 256),
                   (200, 256, 512, 256)]


@pytest.mark.parametrize("spec,match", [
    ("1,2", r"--shape '1,2': expected M,N,K where M is an integer, a list 1,16,128, or a range 1-8192 \(expanded to "
            r"the M buckets\), e\.g\. --shape 1-8192,4096,4096; got 2 comma-separated values$"),
    # it was "got 4 comma-separated value(s)"
    ("1,64,64,", r"--shape '1,64,64,': expected M,N,K .*; value 4 of 4 is empty \(a comma too many\?\)$"),
    ("1,256,100", r"K=100 must be a multiple of 16 .* pad K to 112"),
    ("x,256,512", r"M must be a positive integer; got 'x'"),
    ("200-60,256,512", r"M range '200-60' must go up"),
    ("1,0,512", r"N must be a positive integer; got 0"),
    # each was accepted, then crashed allocating its operands
    ("9999999999,64,64",
     r"argument --shape: '9999999999,64,64': M must be at most 2147483647 \(2\*\*31 - 1\); got 9999999999$"),
    ("4,99999999999,64", r"'4,99999999999,64': N must be at most 2147483647 \(2\*\*31 - 1\); got 99999999999$"),
    ("2147483647,64,64", r"--shape '2147483647,64,64': A \(M\*K\) = 2147483647\*64 = 137438953408 elements, over the "
                         r"bound of 2147483647 \(2\*\*31 - 1\) per operand; tune a smaller shape \(every M above 8192 "
                         r"shares the 8192 bucket\)$"),
    ("70000,65536,64", r"out \(M\*N\) = 70000\*65536 = 4587520000 elements, over the bound"),
])
def test_bad_shape_exits_2_naming_value_and_form(capsys, spec, match):
    code, out, err = _run(capsys, ["--shape", spec])
    assert code == 2 and out == ""
    assert re.search(match, err, re.M), err


def test_a_preset_at_an_m_too_large_exits_2_naming_the_layer(capsys):
    code, out, err = _run(capsys, ["--preset", "llama-3.1-70b-nvfp4", "--m", "300000", "--list"])
    assert code == 2 and out == "" and ("error: attn.qkv (N=10240, K=8192) at M=300000: A (M*K) = 300000*8192 = "
                                        "2457600000 elements, over the bound of 2147483647 (2**31 - 1)") in err, err


def test_argument_misuse_exits_2(capsys):
    assert main(["--help"]) == 0 and "--preset" in capsys.readouterr().out
    for argv, text in [(["--tp", "8"], "error: --tp, --ep and --m apply to --preset / --hf-config; give one (or put M "
                                       "in --shape M,N,K)"),
                       (["--ep", "8", "--shape", "4,64,64"], "error: --tp, --ep and --m apply to --preset"),  # was run
                       (["--preset", "llama-3.1-70b-nvfp4", "--ep", "8"],  # was accepted
                        "error: --ep 8 splits routed experts, and preset llama-3.1-70b-nvfp4 has none (num_experts, "
                        "n_routed_experts, num_local_experts unset); drop --ep"),
                       # was argparse's "expected one argument"
                       (["--shape", "-1,64,64"], "error: argument --shape: '-1,64,64': M must be a positive integer; "
                                                 "got -1"),
                       (["--shape", "-2-5,64,64"],  # was "got ''"
                        "error: argument --shape: '-2-5,64,64': the range start must be a positive integer; got -2"),
                       (["--preset", "llama-3.1-70b-nvfp4", "--m", "-1,16"],
                        "error: argument --m: '-1,16': M must be a positive integer; got -1"),
                       (["export"], "export needs a FILE"),
                       (["--preset", "nope"], "invalid choice: 'nope'"),
                       (["--preset", "llama-3.1-70b-nvfp4", "--tp", "3"],
                        "--tp 3 does not divide num_attention_heads=64"),
                       (["show", "--shape", "1,256,512"], "show takes no shape options")]:
        code, _, err = _run(capsys, argv)
        assert code == 2 and text in err, (argv, err)


@pytest.mark.parametrize("name,value,accepted", [
    ("FP4DISPATCH_TUNE", "maybe", "accepted: 1/true/yes/on or 0/false/no/off"),
    ("FP4DISPATCH_LOG", "loud", "accepted: DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("FP4DISPATCH_TIMER", "cuda", "accepted: graph or eager"),
    ("FP4DISPATCH_COMPILE_WORKERS", "x", "accepted: a whole number from 0 (0: none) to"),
    ("FP4DISPATCH_DISABLE", "nosuch", "names no backend ['nosuch']; accepted names: ['fast', 'flaky', "),
    # was exit 1, every shape "no usable backend" with the error repeated, its tables on stdout
    ("FP4DISPATCH_BACKEND", "refrence", "names no backend; accepted names: ['fast', 'flaky', "),
])
def test_an_invalid_env_variable_exits_2_with_its_one_line_message(capsys, monkeypatch, name, value, accepted):
    monkeypatch.setenv(name, value)
    for argv in (["--shape", "1,256,512", "--json"], ["--self-test"]):  # was a traceback and exit 1
        code, out, err = _run(capsys, argv, backends=_fakes(), do_bench=fake_do_bench)
        assert code == 2 and out == "" and err.startswith(f"fp4dispatch.tune: {name}={value!r} ") and accepted in err
        assert err.count("\n") == 1, err


@cpu_only
def test_devices_without_cuda_exits_2(capsys):
    code, _, err = _run(capsys, ["--devices", "0"])
    assert code == 2 and "no CUDA device is visible" in err and "--devices needs GPUs" in err


# -- presets and --hf-config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,published", [("glm-5-nvfp4", GLM_5), ("qwen3.5-397b-a17b-nvfp4", QWEN35_397B),
                                            ("llama-3.1-70b-nvfp4", LLAMA_31_70B)])
def test_preset_values_are_the_published_ones(name, published):
    cfg = presets.PRESETS[name]["config"]
    assert {k: cfg.get(k) for k in published} == published


def _pairs(gemms):
    return {g.layer: (g.n, g.k) for g in gemms}


def test_preset_shapes_at_tp8_follow_the_layer_formulas():
    tp = 8
    c = LLAMA_31_70B
    hd = c["hidden_size"] // c["num_attention_heads"]
    assert _pairs(presets.preset_gemms("llama-3.1-70b-nvfp4", tp)) == {
        "attn.qkv": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd // tp, c["hidden_size"]),
        "attn.o": (c["hidden_size"], c["num_attention_heads"] * hd // tp),
        "mlp.gate_up": (2 * c["intermediate_size"] // tp, c["hidden_size"]),
        "mlp.down": (c["hidden_size"], c["intermediate_size"] // tp)}
    g = GLM_5
    qk = g["qk_nope_head_dim"] + g["qk_rope_head_dim"]
    assert _pairs(presets.preset_gemms("glm-5-nvfp4", tp)) == {
        "attn.q_a+kv_a": (g["q_lora_rank"] + g["kv_lora_rank"] + g["qk_rope_head_dim"], g["hidden_size"]),
        "attn.q_b": (g["num_attention_heads"] * qk // tp, g["q_lora_rank"]),
        "attn.kv_b": (g["num_attention_heads"] * (g["qk_nope_head_dim"] + g["v_head_dim"]) // tp, g["kv_lora_rank"]),
        "attn.o": (g["hidden_size"], g["num_attention_heads"] * g["v_head_dim"] // tp),
        "mlp.gate_up": (2 * g["intermediate_size"] // tp, g["hidden_size"]),
        "mlp.down": (g["hidden_size"], g["intermediate_size"] // tp),
        "expert.gate/up": (g["moe_intermediate_size"], g["hidden_size"]),  # experts are not TP-split (EP)
        "expert.down": (g["hidden_size"], g["moe_intermediate_size"]),
        "shared_expert.gate_up": (2 * g["moe_intermediate_size"] // tp, g["hidden_size"]),
        "shared_expert.down": (g["hidden_size"], g["moe_intermediate_size"] // tp)}
    q = QWEN35_397B
    # 32/8 = 4 query heads (x2: output gate) and 2 KV heads < TP 8, so one replicated KV head per rank
    assert _pairs(presets.preset_gemms("qwen3.5-397b-a17b-nvfp4", tp)) == {
        "attn.qkv": ((2 * q["num_attention_heads"] // tp + 2 * 1) * q["head_dim"], q["hidden_size"]),
        "attn.o": (q["hidden_size"], q["num_attention_heads"] * q["head_dim"] // tp),
        "linear_attn.in_qkvz": ((2 * 16 * 128 + 2 * 64 * 128) // tp, q["hidden_size"]),
        "linear_attn.out": (q["hidden_size"], 64 * 128 // tp),
        "expert.gate/up": (q["moe_intermediate_size"], q["hidden_size"]),
        "expert.down": (q["hidden_size"], q["moe_intermediate_size"]),
        "shared_expert.gate_up": (2 * q["shared_expert_intermediate_size"] // tp, q["hidden_size"]),
        "shared_expert.down": (q["hidden_size"], q["shared_expert_intermediate_size"] // tp)}


def test_routed_experts_are_grouped_keys_of_e_over_ep_experts_and_t_rows(capsys):
    d = DEEPSEEK_V3
    experts = {g.layer: (g.n, g.k, g.experts, g.top_k) for g in presets.preset_gemms("deepseek-v3-nvfp4", 8, 8)
               if g.experts}
    assert experts == {"expert.gate/up": (d["moe_intermediate_size"], d["hidden_size"], 256 // 8, 8),
                       "expert.down": (d["hidden_size"], d["moe_intermediate_size"], 256 // 8, 8)}
    code, data, _ = _json(capsys, ["--preset", "deepseek-v3-nvfp4", "--tp", "8", "--ep", "8", "--m", "1,16", "--list",
                                   "--json"])
    grouped = {(s["m"], s["n"], s["k"], s["experts"]) for s in data["shapes"] if s["experts"]}
    assert code == 0 and grouped == {(m * 8, n, k, 32) for m in (1, 16) for n, k in ((2048, 7168), (7168, 2048))}
    code, _, err = _run(capsys, ["--preset", "kimi-k2-nvfp4", "--ep", "5", "--list"])
    assert code == 2 and "--ep 5 does not divide n_routed_experts=384; choose an EP size that divides it" in err
    code, data, _ = _json(capsys, ["--preset", "deepseek-v3-nvfp4", "--op", "w4a16", "--m", "1", "--list", "--json"])
    assert code == 0 and {s["experts"] for s in data["shapes"]} == {0, 256} and not data["skipped"]


@cpu_only
def test_tuning_a_moe_config_decides_grouped_keys(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
                               "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}))
    code, data, _ = _json(capsys, ["--hf-config", str(cfg), "--m", "3", "--json", "--cache-dir", str(tmp_path / "c")])
    rows = {r["key"]: r for r in data["shapes"]}
    # gate and up N = 128 each, as Fp4MoeExperts calls them (the fused gate_up, N = 256, was warmed and never used)
    assert code == 0 and {k for k in rows if k.startswith("grouped")} == {"grouped-e4-m8-n128-k256-bfloat16",
                                                                           "grouped-e4-m8-n256-k128-bfloat16"}
    assert all(r["status"] == "ok" and r["op"] == "fp4_grouped_mm" for k, r in rows.items() if k.startswith("grouped"))
    code, data, _ = _json(capsys, ["--hf-config", str(cfg), "--m", "3", "--json", "--cache-dir", str(tmp_path / "c"),
                                   "--op", "w4a16"])
    rows = {r["key"]: r for r in data["shapes"]}
    assert code == 0 and "w4a16-bfloat16-grouped-e4-m8-n256-k128-bfloat16" in rows
    assert all(r["status"] == "ok" and r["op"] == "w4a16_grouped_mm" for k, r in rows.items() if "grouped" in k)


def test_preset_cli_crosses_layers_with_the_default_m_list(capsys):
    code, data, _ = _json(capsys, ["--preset", "llama-3.1-70b-nvfp4", "--tp", "8", "--list", "--json"])
    assert code == 0
    keys = {(s["m"], s["n"], s["k"]) for s in data["shapes"]}
    assert keys == {(m, n, k) for m in (1, 16, 128, 1024, 4096)
                    for n, k in ((1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584))}


def test_hf_config_matches_the_preset_and_reads_text_config(capsys, tmp_path):
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **LLAMA_31_70B, "num_hidden_layers": 80}))
    qwen = tmp_path / "qwen.json"
    qwen.write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": QWEN35_397B}))
    for path, preset in ((llama, "llama-3.1-70b-nvfp4"), (qwen, "qwen3.5-397b-a17b-nvfp4")):
        _, from_file, _ = _json(capsys, ["--hf-config", str(path), "--tp", "8", "--m", "1", "--list", "--json"])
        _, from_preset, _ = _json(capsys, ["--preset", preset, "--tp", "8", "--m", "1", "--list", "--json"])
        assert from_file["shapes"] == from_preset["shapes"] and from_file["shapes"]


def test_hf_config_missing_key_is_named(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({k: v for k, v in LLAMA_31_70B.items() if k != "num_key_value_heads"}))
    code, _, err = _run(capsys, ["--hf-config", str(cfg), "--list"])
    assert code == 2 and "key 'num_key_value_heads' is missing" in err
    cfg.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}))
    code, _, err = _run(capsys, ["--hf-config", str(cfg), "--list"])
    assert code == 2 and "neither 'intermediate_size' nor 'moe_intermediate_size'" in err
    code, _, err = _run(capsys, ["--hf-config", str(tmp_path / "absent.json"), "--list"])
    assert code == 2 and "no such file" in err


MOE = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 512,
       "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("cfg,message", [
    # each was a TypeError traceback, a negative or float N, or head_dim 1 (True)
    ({**LLAMA_31_70B, "head_dim": "128"}, "head_dim must be a positive integer; got '128'"),
    ({**LLAMA_31_70B, "head_dim": [128]}, "head_dim must be a positive integer; got [128]"),
    ({**LLAMA_31_70B, "head_dim": -128}, "head_dim must be a positive integer; got -128"),
    ({**LLAMA_31_70B, "head_dim": 128.0}, "head_dim must be a positive integer; got 128.0"),
    ({**LLAMA_31_70B, "head_dim": True}, "head_dim must be a positive integer; got True"),
    ({**LLAMA_31_70B, "head_dim": 0}, "head_dim must be a positive integer; got 0"),
    ({**LLAMA_31_70B, "hidden_size": 32}, "head_dim is absent and hidden_size // num_attention_heads = 32 // 64 = 0; "
                                          "add head_dim"),
    ({**MOE, "first_k_dense_replace": "3"}, "first_k_dense_replace must be an integer >= 0; got '3'"),
    ({**MOE, "n_shared_experts": "1"}, "n_shared_experts must be an integer >= 0; got '1'"),
    ({**MOE, "shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be an integer >= 0; got -1"),
    ({**MOE, "num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4 (a token is routed to that many "
                                        "distinct experts); fix the config"),
    # "false" is truthy: the qkv width doubled without a word
    ({**LLAMA_31_70B, "attn_output_gate": "false"}, "attn_output_gate must be true or false (a JSON boolean); got "
                                                    "'false'"),
])
def test_hf_config_values_are_checked_like_the_required_keys(capsys, tmp_path, cfg, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = _run(capsys, ["--hf-config", str(path), "--list"])
    assert code == 2 and out == "" and f"error: --hf-config {path}: {message}" in err, err
    assert "Traceback" not in err


def test_a_deeply_nested_hf_config_exits_2(capsys, tmp_path):
    """It was a RecursionError traceback and exit 1."""
    cfg = tmp_path / "config.json"
    cfg.write_text("[" * 100000 + "]" * 100000)
    code, out, err = _run(capsys, ["--hf-config", str(cfg)])
    assert code == 2 and out == "" and "--hf-config: cannot read" in err and "RecursionError" in err


def test_tp_split_giving_k_not_multiple_of_16_is_skipped_and_said(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA_31_70B, "intermediate_size": 1000}))
    code, data, _ = _json(capsys, ["--hf-config", str(cfg), "--m", "1", "--list", "--json"])
    assert code == 0
    assert [s["layer"] for s in data["skipped"]] == ["mlp.down"]
    assert "K=1000 (at --tp 1) is not a multiple of 16" in data["skipped"][0]["reason"]
    assert all(s["k"] % 16 == 0 for s in data["shapes"])


# -- tuning, tables, json -------------------------------------------------------------------------------------
@cpu_only
def test_default_run_on_cpu_says_so_and_prints_both_tables(capsys):
    code, out, _ = _run(capsys, [])
    assert code == 0
    assert "No CUDA device found: deciding on the CPU" in out and "nothing is timed on a CPU" in out
    assert "Per shape" in out and "Per backend" in out
    shape_rows = [ln for ln in out.splitlines() if "cpu-small" in ln]
    assert len(shape_rows) == len(presets.default_shapes(on_gpu=False))
    assert all("reference" in ln and "| 1/1 ok |" in ln for ln in shape_rows)
    assert any(ln.startswith("| cpu") and "reference" in ln and "| ok" in ln for ln in out.splitlines())


def test_json_run_ranks_backends_and_reports_speedup(tuned):
    code, data, _ = tuned
    assert code == 0 and data["failed"] == [] and data["exit_code"] == 0 and data["mode"] == "single"
    m1, m16 = data["shapes"]
    for row in (m1, m16):
        assert row["status"] == "ok" and row["winner"] == "fast" and row["time_us"] == pytest.approx(10.0)
        assert row["tflops"] == pytest.approx(2 * row["m"] * 256 * 512 / 10e-6 / 1e12, rel=1e-3)
        assert {t["backend"] for t in row["tried"]} == {"fast", "slow", "flaky"}
    assert m1["runner_up"] == "flaky" and m1["speedup_vs_runner_up"] == pytest.approx(2.0)
    assert m16["runner_up"] == "slow" and m16["speedup_vs_runner_up"] == pytest.approx(4.0)
    flaky16 = next(t for t in m16["tried"] if t["backend"] == "flaky")
    assert flaky16["time_us"] is None and flaky16["reason"].startswith("incorrect: all zeros at M=16")
    assert [(b["name"], b["status"], b["wins"]) for b in data["backends"]] == [
        ("fast", "ok", 2), ("slow", "ok", 0), ("flaky", "ok", 0)]
    # the wall time of each stage (no cuBLAS baseline on the CPU), for bench_cold_start's breakdown
    assert set(data["seconds"]) == {"probe", "compile", "decide", "baseline", "beside", "hand_out"}
    # nothing probed in workers on the CPU
    assert data["seconds"]["baseline"] == data["seconds"]["beside"] == data["seconds"]["hand_out"] == 0
    assert all(v >= 0 for v in data["seconds"].values())


def test_a_tune_probes_the_backends_of_its_ops_and_lists_the_others_as_not_probed(capsys, tmp_path):
    moe = FakeBackend("moe", ops=("grouped",))
    code, data, _ = _json(capsys, ["--shape", "1,256,512", "--json", "--cache-dir", str(tmp_path / "c")],
                          backends=[FakeBackend("dense"), moe], do_bench=fake_do_bench)
    assert code == 0 and moe.calls == 0
    assert {b["name"]: b["status"] for b in data["backends"]} == {"dense": "ok", "moe": "not probed"}
    code, data, _ = _json(capsys, ["--self-test", "--json"], backends=[FakeBackend("dense"), moe])
    assert {b["name"]: b["status"] for b in data["backends"]} == {"dense": "ok", "moe": "ok"} and moe.calls > 0


def test_table_shows_winner_config_and_runner_up(capsys):
    fast = FakeBackend("fast", cost=1e-5, configs=[{"BLOCK_M": 64}, {"BLOCK_M": 128, "cost_factor": 3.0}])
    code, out, _ = _run(capsys, ["--shape", "1,256,512"], backends=[fast, FakeBackend("slow", cost=4e-5)],
                        do_bench=fake_do_bench)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("| 1 ")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert code == 0 and cells[:3] == ["1", "256", "512"]
    assert cells[4:9] == ["2/2 ok", "fast [BLOCK_M=64]", "10.0", f"{2 * 256 * 512 / 10e-6 / 1e12:.3g}", "4.00x (slow)"]


class FirstRunSlow(FakeBackend):
    """Stands for a backend that compiles its kernels for a shape on its first run there (Humming, Triton)."""

    def __init__(self, name: str, first_s: float, **kw):
        super().__init__(name, **kw)
        self.first_s, self.seen = first_s, set()

    def run(self, problem, ops, config):
        if problem not in self.seen:
            self.seen.add(problem)
            time.sleep(self.first_s)
        super().run(problem, ops, config)


def test_table_shows_the_slowest_first_run_of_each_shape(capsys):
    """A candidate's check is its first run on the shape: a compile shows there, in the table and in --json."""
    backends = [FakeBackend("fast", cost=1e-5), FirstRunSlow("compiling", 0.3, cost=4e-5)]
    # a shape the probe does not run (its shapes are N=256, K=512), so the first run there is the tuning check
    code, out, _ = _run(capsys, ["--shape", "1,384,768"], backends=backends, do_bench=fake_do_bench)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("| 1 ")]
    last = [c.strip() for c in line.strip("|").split("|")][9]
    assert code == 0 and last.endswith(" s (compiling)") and float(last.split()[0]) >= 0.3, last
    code, data, _ = _json(capsys, ["--shape", "1,384,1024", "--json"],
                          backends=[FakeBackend("fast", cost=1e-5), FirstRunSlow("compiling", 0.3, cost=4e-5)],
                          do_bench=fake_do_bench)
    tried = {t["backend"]: t for t in data["shapes"][0]["tried"]}
    assert tried["compiling"]["check_s"] >= 0.3 and tried["fast"]["check_s"] < tried["compiling"]["check_s"]


def test_second_run_reads_the_cache(capsys, tuned, tmp_path):
    cdir = _copy(tuned[2], tmp_path)
    counting = _fakes()
    code, data, _ = _json(capsys, ["--shape", "1,256,512", "--json", "--cache-dir", cdir], backends=counting,
                          do_bench=fake_do_bench)
    assert code == 0 and data["shapes"][0]["source"] == "cache" and data["shapes"][0]["winner"] == "fast"
    assert all(b.calls == 0 for b in counting)  # neither probed nor tuned again


def test_a_cache_lock_held_throughout_the_run_is_said_and_exits_1(capsys, tmp_path, monkeypatch):
    """The run printed "cache: <file>" and exited 0 with its decisions unwritten (and, the exit flush holding caches
    weakly, lost)."""
    from filelock import FileLock

    from fp4dispatch.cli import output
    from fp4dispatch.dispatch import cache as cache_mod
    from fp4dispatch.dispatch.fingerprint import device_fingerprint

    monkeypatch.setattr(output, "LOCK_WAIT_S", 0.2)
    monkeypatch.setattr(cache_mod, "LOCK_TIMEOUT_S", 0.05)
    monkeypatch.setattr(cache_mod, "_pending_caches", set())
    cdir = tmp_path / "c"
    cdir.mkdir()
    path = cache_mod.DecisionCache(cdir, device_fingerprint(torch.device("cpu"))).path
    peer = FileLock(str(path) + ".lock")
    peer.acquire()
    try:
        code, data, _ = _json(capsys, ["--shape", "1,256,512", "--json", "--cache-dir", str(cdir)], backends=_fakes(),
                              do_bench=fake_do_bench)
    finally:
        peer.release()
    assert code == 1 and data["exit_code"] == 1 and data["notes"][-1] == (
        f"the cache lock {path}.lock was held by another process for 0.2 s: these decisions are not written to {path} "
        "yet (tried once more at exit). Run tune again once that process is done")
    assert not path.exists()
    cache_mod._flush_at_exit()  # the lock free: what the run decided is written
    assert list(json.loads(path.read_text())["decisions"]) == ["m1-n256-k512-bfloat16"]


def test_a_key_whose_winner_was_banned_since_shows_the_backend_that_serves_it(capsys, tmp_path):
    """The table named the cached winner, banned from the key by a later proof, with its time, and 2x over the
    backend that actually serves the key."""
    def fakes():  # b: fastest, but all zeros at M=6 (inside bucket 8, no probe M)
        return [FakeBackend("a", cost=2e-5), FakeBackend("b", cost=1e-5, wrong_for_m=(6,))]

    cdir = str(tmp_path / "c")
    code, data, _ = _json(capsys, ["--shape", "8,64,64", "--json", "--cache-dir", cdir], backends=fakes(),
                          do_bench=fake_do_bench)
    assert code == 0 and data["shapes"][0]["winner"] == "b"
    d = Dispatcher(fakes(), cache_dir=cdir, do_bench=fake_do_bench)
    d.fp4_mm(*make_nvfp4_inputs(6, 64, 64))  # proves b wrong at M=6: banned from m8-n64-k64-bfloat16
    code, data, _ = _json(capsys, ["--shape", "8,64,64", "--json", "--cache-dir", cdir], backends=fakes(),
                          do_bench=fake_do_bench)
    row = data["shapes"][0]
    assert code == 0 and (row["winner"], row["time_us"], row["source"]) == ("a", 20.0, "cache")
    assert {b["name"]: b["wins"] for b in data["backends"]} == {"a": 1, "b": 0}


@cpu_only
def test_no_usable_backend_exits_1_and_lists_the_shape(capsys, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "reference")
    code, out, _ = _run(capsys, ["--shape", "1,256,512"])
    assert code == 1
    assert "No usable backend for 1 shape(s)" in out
    assert "m1-n256-k512-bfloat16" in out and "reference: unavailable: disabled by FP4DISPATCH_DISABLE" in out
    code, data, _ = _json(capsys, ["--shape", "1,256,512", "--json"])
    assert code == 1 and data["failed"] == ["m1-n256-k512-bfloat16"] and data["shapes"][0]["status"] == "no_backend"


def test_self_test_prints_one_line_per_backend(capsys):
    fakes = [FakeBackend("good"), FakeBackend("zeros", result="zeros"), FakeBackend("gone", unavailable="lib missing"),
             FakeBackend("boom", raises=RuntimeError("kernel exploded"))]
    code, out, _ = _run(capsys, ["--self-test"], backends=fakes)
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in
             {"good", "zeros", "gone", "boom"}}
    assert code == 0 and len(lines) == 4
    assert lines["good"].split()[1] == "ok" and lines["gone"].split()[1:] == ["unavailable", "lib", "missing"]
    assert lines["zeros"].split()[1] == "incorrect" and "all zeros" in lines["zeros"]
    assert lines["boom"].split()[1] == "failed" and "RuntimeError: kernel exploded" in lines["boom"]
    code, data, _ = _json(capsys, ["--self-test", "--json"], backends=fakes[1:])
    assert code == 1 and {b["name"]: b["status"] for b in data["backends"]} == {
        "zeros": "incorrect", "gone": "unavailable", "boom": "failed"}


# -- cache commands and profiles ---------------------------------------------------------------------------------
def test_show_then_clear(capsys, tuned, tmp_path):
    cdir = _copy(tuned[2], tmp_path)
    _, shown, _ = _json(capsys, ["show", "--json", "--cache-dir", cdir])
    assert shown["exists"] and shown["decisions"]["m1-n256-k512-bfloat16"]["backend"] == "fast"
    code, out, _ = _run(capsys, ["clear", "--cache-dir", cdir])
    assert code == 0 and out.startswith("removed ") and shown["path"] in out
    code, out, _ = _run(capsys, ["clear", "--cache-dir", cdir])  # it listed the lock file it had made itself
    assert code == 0 and ".lock" not in out and not list(Path(cdir).iterdir()), (out, list(Path(cdir).iterdir()))
    _, shown, _ = _json(capsys, ["show", "--json", "--cache-dir", cdir])
    assert not shown["exists"] and shown["decisions"] == {}


def test_clear_all_removes_cache_files_only(capsys, tuned, tmp_path):
    """Its glob was decisions-*.json, under the directory: a user's decisions-2025-q3.json went too."""
    cdir = Path(_copy(tuned[2], tmp_path))
    (cdir / "notes").mkdir()
    mine = [cdir / "notes" / "decisions-2025-q3.json", cdir / "decisions-summary.json"]
    for p in mine:
        p.write_text("{}")
    other = cdir / "sub" / "decisions-0123456789abcdef.json"  # another fingerprint's, in a subdirectory
    other.parent.mkdir()
    other.write_text("{}")
    code, out, _ = _run(capsys, ["clear", "--all", "--cache-dir", str(cdir)])
    assert code == 0 and all(p.exists() for p in mine) and not other.exists() and str(other) in out
    assert not list(cdir.glob("decisions-*.json.lock")) and not list(cdir.glob("decisions-????????????????.json"))


@pytest.mark.parametrize("value", ["", "  "])
def test_a_blank_cache_dir_flag_exits_2(capsys, value):
    """It wrote into the working directory (tune) or read the default one (show, clear), or made a directory named by
    its spaces."""
    for command in ("tune", "show"):
        code, out, err = _run(capsys, [command, "--cache-dir", value])
        assert code == 2 and out == "" and f"--cache-dir: must name a directory; got {value!r}" in err


def test_cache_dir_flag_expands_the_home_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _, shown, _ = _json(capsys, ["show", "--json", "--cache-dir=~/fp4c"])
    assert shown["path"].startswith(str(tmp_path / "fp4c") + os.sep)


def test_import_says_what_the_cache_bound_dropped(capsys, tuned, tmp_path, monkeypatch):
    """It said "imported 6000 decisions" of a profile that the 4096-key bound cut."""
    from fp4dispatch.dispatch import cache as cache_mod

    prof = tmp_path / "p.json"
    assert _run(capsys, ["export", str(prof), "--cache-dir", str(tuned[2])])[0] == 0
    monkeypatch.setattr(cache_mod, "MAX_KEYS", 1)
    data = json.loads(prof.read_text())
    over = sum(len(data[s]) - 1 for s in ("decisions", "health", "shape_blacklist", "verified", "faults")
               if len(data.get(s, {})) > 1)
    code, out, _ = _run(capsys, ["import", str(prof), "--cache-dir", str(tmp_path / "dst")])
    assert code == 0 and over >= 1 and out.startswith("imported 1 decisions, ") and out.rstrip().endswith(
        f"; {over} more of its entries were over the cache's bound of 1 keys a section")


def test_export_import_round_trip_and_refusal_on_mismatch(capsys, tuned, tmp_path):
    src, dst, other = str(tuned[2]), str(tmp_path / "dst"), str(tmp_path / "other")
    prof = tmp_path / "h200-profile.json"
    code, out, _ = _run(capsys, ["export", str(prof), "--cache-dir", src])
    assert code == 0 and "exported 2 decisions" in out
    code, out, _ = _run(capsys, ["import", str(prof), "--cache-dir", dst])
    assert code == 0 and "imported 2 decisions" in out
    fresh = _fakes()
    d = Dispatcher(fresh, cache_dir=dst, do_bench=fake_do_bench)
    # the device the CLI tuned and exported for: its default one (a GPU where there is one)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert d.choose(Problem(16, 256, 512, torch.bfloat16, dev)).backend.name == "fast"
    assert all(b.calls == 0 for b in fresh)  # the imported verdicts and decisions are used as they are

    data = json.loads(prof.read_text())
    data["fingerprint"]["libs"]["torch"] = "0.0.0-tampered"
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(data))
    code, out, err = _run(capsys, ["import", str(bad), "--cache-dir", other])
    assert code == 1 and out == ""
    # the fingerprint holds the installed distribution's version (a CUDA build's torch.__version__ adds +cu130)
    assert "refusing" in err and f"libs.torch: {metadata.version('torch')} (here) vs 0.0.0-tampered (file)" in err
    assert not list(Path(other).glob("decisions-*.json"))  # nothing was written

    cache_file = next(Path(src).glob("decisions-*.json"))
    code, _, err = _run(capsys, ["import", str(cache_file), "--cache-dir", other])
    assert code == 1 and "must be an fp4dispatch profile" in err


def test_export_of_an_empty_cache_says_what_to_run(capsys, tmp_path):
    code, _, err = _run(capsys, ["export", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "empty")])
    assert code == 1 and "holds nothing for this device yet" in err and "python -m fp4dispatch.tune" in err


# -- processes ---------------------------------------------------------------------------------------------------
def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP4DISPATCH_")}
    env.update(FP4DISPATCH_CACHE_DIR=str(cache), PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def test_python_dash_m_runs_in_a_subprocess(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fp4dispatch.tune", "--json", "--shape", "1,256,512"], cwd=REPO,
                       env=_env(tmp_path / "c"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert [r["status"] for r in data["shapes"]] == ["ok"] and data["shapes"][0]["winner"]
    assert any(b["status"] == "ok" and b["name"] == data["shapes"][0]["winner"] for b in data["backends"])


def test_devices_processes_split_shapes_of_equal_devices(tmp_path):
    shapes = presets.expand_shapes([(m, 256, 512, "x") for m in (1, 16, 128)])
    opts = TuneOptions(progress=False, cache_dir=str(tmp_path / "c"))
    results = distributed.run_on_devices(["cpu", "cpu"], shapes, opts)
    assert [r["error"] for r in results] == [None, None]
    keys = [[row["key"] for row in r["rows"]] for r in results]
    assert sorted(keys[0] + keys[1]) == sorted(f"m{m}-n256-k512-bfloat16" for m in (1, 16, 128))
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])
    (cache,) = Path(opts.cache_dir).glob("decisions-*.json")
    assert set(json.loads(cache.read_text())["decisions"]) == set(keys[0] + keys[1])
    # a device whose process died: its share is reported as failed rows, the others' rows stay
    dead = {"device": "cuda:1", "rows": [], "backends": [], "error": "it died, exit code -11",
            "unfinished": presets.expand_shapes([(4096, 1024, 1024, "layer")])}
    rows, backends, notes = distributed.merge_device_results(results + [dead])
    assert len(rows) == 4 and len(backends) == len(results[0]["backends"]) + len(results[1]["backends"])
    assert [r["status"] for r in rows if r["tuned_by"] == "cuda:1"] == ["error"]
    assert notes == ["cuda:1: its tuning process failed (it died, exit code -11)"]


def test_a_device_process_that_raises_reports_why_with_its_unfinished_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_SEARCH", "bogus")  # read by each device process's dispatcher, not by this one
    shapes = presets.expand_shapes([(m, 256, 512, "x") for m in (1, 16)])
    results = distributed.run_on_devices(["cpu", "cpu"], shapes, TuneOptions(progress=False, cache_dir=str(tmp_path)))
    assert [r["rows"] for r in results] == [[], []]
    assert [r["unfinished"] for r in results] == [shapes[:1], shapes[1:]]
    assert all(r["error"] == "InvalidInputError: FP4DISPATCH_SEARCH='bogus' is not valid; accepted: fast or full. "
               "Unset it for the default 'fast'" for r in results)


def test_torchrun_gloo_two_ranks_identical_tables_one_cache(tmp_path):
    cache, logs = tmp_path / "shared-cache", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", "-m", "fp4dispatch.tune", "--json",
           "--shape", "1,16,256,512", "--shape", "1,512,256"]
    # gloo on the CPU, also on a GPU machine: two ranks need two GPUs for nccl (one has its own test below)
    env = {**_env(cache), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    outs = sorted(logs.glob("*/attempt_0/*/stdout.log"))
    assert len(outs) == 2
    runs = [json.loads(o.read_text()) for o in outs]
    assert {r["rank"] for r in runs} == {0, 1} and all(r["mode"] == "torchrun" for r in runs)
    assert runs[0]["shapes"] == runs[1]["shapes"]
    rows = runs[0]["shapes"]
    assert {r["key"] for r in rows} == {"m1-n256-k512-bfloat16", "m16-n256-k512-bfloat16", "m1-n512-k256-bfloat16"}
    assert {r["tuned_by"] for r in rows} == {"rank0", "rank1"} and all(r["source"] == "tuned" for r in rows)
    (cache_file,) = cache.glob("decisions-*.json")
    decisions = json.loads(cache_file.read_text())["decisions"]
    assert set(decisions) == {r["key"] for r in rows}
    assert all(decisions[r["key"]]["backend"] == r["winner"] for r in rows)


def test_a_torchrun_rank_without_a_gpu_of_its_own_is_told_how_many_processes_fit(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 needs GPU 1, but this machine has 1 visible GPU\(s\); start "
                       r"at most 1 process\(es\) per node \(--nproc-per-node 1\)"):
        distributed._local_gpu()
    monkeypatch.setattr(distributed, "torchrun_detected", lambda: True)
    monkeypatch.setattr(distributed, "run_torchrun", lambda *a: distributed._local_gpu())
    code, out, err = _run(capsys, ["--shape", "1,256,512", "--cache-dir", str(tmp_path)], backends=_fakes())
    assert code == 2 and out == "" and err.startswith("fp4dispatch.tune: torchrun: LOCAL_RANK=1 needs GPU 1")


@pytest.mark.parametrize("rank, world", [("x", "2"), ("3", "2"), ("0", "")])
def test_torchrun_ranks_that_cannot_make_a_group_exit_2(monkeypatch, capsys, tmp_path, rank, world):
    """RANK=x printed int()'s message without naming RANK; RANK=3 of WORLD_SIZE=2 waited forever for its group."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "localhost")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "torchrun_detected", lambda: True)
    code, out, err = _run(capsys, ["--shape", "1,256,512", "--cache-dir", str(tmp_path)], backends=_fakes())
    assert code == 2 and out == "" and err == (
        f"fp4dispatch.tune: torchrun: RANK must be an integer in 0..WORLD_SIZE-1 and WORLD_SIZE a positive integer; "
        f"got RANK={rank!r}, WORLD_SIZE={world!r}. Launch with torchrun, which sets them\n")


def test_op_w4a16_tunes_w4a16_keys_among_w4a16_backends_and_says_what_fp4linear_auto_runs(capsys, tmp_path):
    fakes = [FakeBackend("fp4", cost=1e-6), FakeBackend("w4-fast", cost=1e-5, ops=("w4a16",)),
             FakeBackend("w4-slow", cost=4e-5, ops=("fp4_mm", "w4a16"))]
    argv = ["--shape", "1,16,256,512", "--op", "w4a16", "--cache-dir", str(tmp_path)]
    code, data, _ = _json(capsys, argv + ["--json"], backends=fakes, do_bench=fake_do_bench)
    assert code == 0
    assert [r["key"] for r in data["shapes"]] == ["w4a16-bfloat16-m1-n256-k512-bfloat16",
                                                 "w4a16-bfloat16-m16-n256-k512-bfloat16"]
    assert {r["op"] for r in data["shapes"]} == {"w4a16"} and {r["winner"] for r in data["shapes"]} == {"w4-fast"}
    assert all({t["backend"] for t in r["tried"]} == {"w4-fast", "w4-slow"} for r in data["shapes"])
    code, out, _ = _run(capsys, argv, backends=fakes, do_bench=fake_do_bench)
    assert code == 0 and "Per shape (w4a16_mm: 16-bit activations)" in out
    assert "Fp4Linear(mode='auto') on cpu: W4A16 (no backend on FP4 tensor cores is healthy here)" in out
    fakes[0].fp4_tensor_cores = True
    _, out, _ = _run(capsys, argv, backends=fakes, do_bench=fake_do_bench)
    assert "Fp4Linear(mode='auto') on cpu: W4A4 (fp4 runs on FP4 tensor cores)" in out


def test_verbose_logs_name_their_logger_once():
    from fp4dispatch.cli.log_setup import NamedFormatter

    def line(name, msg):
        return NamedFormatter().format(logging.LogRecord(name, logging.INFO, __file__, 1, msg, None, None))

    assert line("fp4dispatch", "fp4dispatch: probe reference on cpu: ok") == "fp4dispatch: probe reference on cpu: ok"
    assert line("fp4dispatch", "tune m1: a -> b") == "fp4dispatch: tune m1: a -> b"
    assert line("triton", "a warning") == "triton: a warning"
