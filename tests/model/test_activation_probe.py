"""Measured saved-activation bytes per layer are at or below Korthikanti et al. 2022's formulas
(Table 2, Eqs. 1-6) for all six techniques, with dropout on: bf16, p = 0.1, s=128, b=2, h=64,
a=4, tp=2 where tensor parallelism is used, and equal the planner's count for the attention that
ran. Both paths: the Triton kernels' (what a GPU keeps) and the PyTorch one (what a CPU run
keeps), which differ by the attention output's second copy."""
import dataclasses

import torch

from megalite.config import RunConfig
from megalite.model.activation_probe import (TECHNIQUES, korthikanti_layer_bytes, measure_layer_bytes,
                                             probe_config)
from megalite.plan.activations import layer_activation_bytes
from megalite.testing import run_distributed

PLANNER_NAMES = {"triton": "triton", "torch": "reference"}  # the probe's backends as the planner names them

S, B, TP, BACKENDS = 128, 2, 2, ("triton", "torch")


def _tensor_parallel_world(config):
    from megalite.distributed.mesh import init_mesh

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
        # the Triton attention writes its output in the [s, b, h/tp] memory the projection reads, so a
        # kept core output is kept once (the PyTorch path also keeps its [b, h, s, d] form): 2 bytes an element
        tp = TP if technique.tensor_parallel else 1
        kept_once = 2 * sbh // tp if technique.recompute == "none" else 0
        assert triton_bytes == torch_bytes - kept_once, (technique.name, triton_bytes / sbh, torch_bytes / sbh)
        layout = RunConfig.build(tp=tp, sequence_parallel=technique.sequence_parallel, recompute=technique.recompute,
                                 micro_batch_size=B, precision="bf16")
        for backend in BACKENDS:
            planned = layer_activation_bytes(config, layout, attention=PLANNER_NAMES[backend])
            assert measured[technique.name, backend] == planned, (technique.name, backend)
        assert triton_bytes <= formula, f"{technique.name}: {triton_bytes / sbh} sbh > {formula / sbh} sbh"
    # the formulas as printed in the paper, in units of sbh at this shape (5as/h = 40)
    assert [korthikanti_layer_bytes(t, S, B, 64, 4, TP) / sbh for t in TECHNIQUES] == [74, 42, 37, 22, 17, 2]


def test_grouped_queries_without_dropout_keep_sdpas_repeated_heads():
    """The PyTorch path runs SDPA with k, v repeated per query head, which keeps the repeats; the
    planner counts them, and its count is exact for the Triton path and an upper bound for SDPA's,
    whose output layout is torch's (torch 2.13's CPU kernel writes q's layout: one copy fewer)."""
    config = dataclasses.replace(probe_config(hidden_dropout=0.0, attention_dropout=0.0), num_query_groups=2)
    technique = TECHNIQUES[0]  # no parallelism
    layout = RunConfig.build(micro_batch_size=B, precision="bf16")
    measured = {backend: measure_layer_bytes(config, technique, None, S, B, torch.bfloat16, backend)
                for backend in BACKENDS}
    core_output = 2 * S * B * config.hidden_size                       # [s, b, nq*d] bf16
    assert measured["triton"] == layer_activation_bytes(config, layout, attention="triton")
    assert measured["torch"] - measured["triton"] >= 2 * core_output   # k and v repeated to nq heads
    slack = layer_activation_bytes(config, layout, attention="reference") - measured["torch"]
    assert slack in (0, core_output), slack
