"""--cuda-graph is refused, one line per reason and exit code 2, wherever a capture cannot hold.

The capture itself (training/cuda_graph.py) needs a GPU: tools/gpu_plan.sh runs it
(bench_train --cuda-graph). Here: the configuration's refusals and the missing-CUDA error.
"""
import pytest
import torch

from megalite.config import RunConfig
from megalite.errors import ConfigError, UsageError
from megalite.mesh import single_process_mesh
from megalite.model import preset
from megalite.training.loop import configure
from megalite.training.step import build_data_parallel, build_model_chunks


@pytest.mark.parametrize("settings,reason", [
    (dict(tp=2), "tp=2, pp=1, cp=1: their collectives run inside forward and backward"),
    (dict(zero=3), "--zero 3 allocates and frees"),
    (dict(zero=2), "--zero 2 allocates and frees"),
    (dict(hidden_dropout=0.1), "dropout draws its seeds on the host"),
    (dict(recompute="selective"), "--recompute selective re-runs forward"),
    (dict(offload_optimizer=True), "--offload-optimizer moves state"),
])
def test_cuda_graph_refuses_what_a_capture_cannot_hold(settings, reason):
    world = settings.get("tp", 1)
    with pytest.raises(ConfigError) as error:
        configure(RunConfig.build(cuda_graph=True, **settings), world, 257)
    lines = [line for line in str(error.value).splitlines() if "--cuda-graph" in line]
    assert any(reason in line and "drop --cuda-graph" in line for line in lines), lines


def test_cuda_graph_allows_plain_data_parallel_runs():
    problems = RunConfig.build(cuda_graph=True, zero=1).resolved(4, 257).validate(4, 257)
    assert not [p for p in problems if "cuda-graph" in p]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graph_without_cuda_is_a_usage_error():
    with pytest.raises(ConfigError, match="--cuda-graph needs a CUDA GPU"):
        configure(RunConfig.build(cuda_graph=True), 1, 257)
    from megalite.training.cuda_graph import StepGraphs

    cfg = RunConfig.build(cuda_graph=True)
    mesh = single_process_mesh("cpu")
    model = build_data_parallel(build_model_chunks(preset("tiny", num_layers=1, seq_length=8), cfg, mesh), cfg, mesh)
    with pytest.raises(UsageError, match="needs a CUDA GPU"):
        StepGraphs(model)
