"""Measured saved-activation bytes per layer are at or below Korthikanti et al. 2022's formulas
(Table 2, Eqs. 1-6) for all six techniques, with dropout on: bf16, p = 0.1, s=128, b=2, h=64,
a=4, tp=2 where tensor parallelism is used. Both paths: the Triton kernels' (what a GPU keeps)
and the PyTorch one (what a CPU run keeps)."""
import torch

from megalite.model.activation_probe import (TECHNIQUES, korthikanti_layer_bytes, measure_layer_bytes,
                                             probe_config)
from megalite.testing import run_distributed

S, B, TP, BACKENDS = 128, 2, 2, ("triton", "torch")


def _tensor_parallel_world(config):
    from megalite.mesh import init_mesh

    mesh = init_mesh(tp=TP)
    return {(t.name, backend): measure_layer_bytes(config, t, mesh.tp_group, S, B, torch.bfloat16, backend)
            for t in TECHNIQUES if t.tensor_parallel for backend in BACKENDS}


def test_measured_bytes_per_layer_are_at_most_korthikantis_formulas():
    config = probe_config()
    measured = {(t.name, backend): measure_layer_bytes(config, t, None, S, B, torch.bfloat16, backend)
                for t in TECHNIQUES if not t.tensor_parallel for backend in BACKENDS}
    ranks = run_distributed(_tensor_parallel_world, TP, config)
    assert ranks[0] == ranks[1]  # tp ranks keep the same bytes
    measured.update(ranks[0])
    sbh = S * B * config.hidden_size
    for technique in TECHNIQUES:
        formula = korthikanti_layer_bytes(technique, S, B, config.hidden_size, config.num_attention_heads, TP)
        triton_bytes, torch_bytes = measured[technique.name, "triton"], measured[technique.name, "torch"]
        assert triton_bytes == torch_bytes, (technique.name, triton_bytes / sbh, torch_bytes / sbh)
        assert triton_bytes <= formula, f"{technique.name}: {triton_bytes / sbh} sbh > {formula / sbh} sbh"
    # the formulas as printed in the paper, in units of sbh at this shape (5as/h = 40)
    assert [korthikanti_layer_bytes(t, S, B, 64, 4, TP) / sbh for t in TECHNIQUES] == [74, 42, 37, 22, 17, 2]
