"""GPU: a checkpoint written by compressed-tensors and loaded with ``load_nvfp4`` runs on the GPU's own backends
(``Fp4Linear(mode="auto")``), gives the CPU reference's logits within the stated tolerance, and a CUDA-graph replay
of the model's forward returns the eager bits. Skipped without a GPU or the clients."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the layers run there")
pytest.importorskip("transformers", reason="needs transformers (pip install fp4dispatch[test])")
pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (pip install fp4dispatch[test])")


def test_a_loaded_model_runs_on_the_gpu_eagerly_and_in_a_cuda_graph(tmp_path):
    import test_checkpoint as tc
    from fp4dispatch import load_nvfp4
    from fp4dispatch.nn import Fp4Linear

    src, cfg = tc._tiny_llama()
    path, ref = tc._compressed_tensors_checkpoint(tmp_path, src, cfg)
    model, _ = tc._tiny_llama(seed=1)
    model = model.cuda()
    report = load_nvfp4(model, path, device="cuda")
    assert len(report.replaced) == 14 and report.unused == []
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(layer, Fp4Linear) and layer.weight.is_cuda
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        cpu_model, _ = tc._tiny_llama(seed=1)
        load_nvfp4(cpu_model, path, mode=layer.resolved_mode(ids.device))
        want = cpu_model(ids.cpu(), use_cache=False).logits.double()
        assert float((eager.double().cpu() - want).norm() / want.norm()) < 2e-2
    assert torch.equal(_graph_logits(model, ids), eager)


def test_a_loaded_moe_model_runs_its_experts_on_the_gpu_eagerly_and_in_a_cuda_graph(tmp_path):
    """Fp4MoeExperts on the GPU: the routing is sorted and counted there (no host sync), so the forward captures;
    the replay gives the eager bits, and the logits match the CPU load of the same checkpoint."""
    import test_checkpoint_moe as tm
    from fp4dispatch import load_nvfp4
    from fp4dispatch.nn import Fp4MoeExperts

    src, cfg = tm._tiny_moe()
    path, _ = tm._compressed_tensors_moe(tmp_path, src, cfg)
    model, _ = tm._tiny_moe(seed=1)
    model = model.cuda()
    load_nvfp4(model, path, device="cuda")
    assert isinstance(model.get_submodule("model.layers.1.mlp.experts"), Fp4MoeExperts)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        cpu_model, _ = tm._tiny_moe(seed=1)
        load_nvfp4(cpu_model, path, mode=model.get_submodule("model.layers.0.self_attn.q_proj").resolved_mode(
            ids.device))
        want = cpu_model(ids.cpu(), use_cache=False).logits.double()
        assert float((eager.double().cpu() - want).norm() / want.norm()) < 2e-2
    assert torch.equal(_graph_logits(model, ids), eager)


def _graph_logits(model, ids):
    """The model's logits for ``ids`` from a CUDA graph captured once (after a warm-up pass on a side stream)."""
    with torch.no_grad():
        static = ids.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static, use_cache=False)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(static, use_cache=False).logits
        g.replay()
        torch.cuda.synchronize()
    return out
