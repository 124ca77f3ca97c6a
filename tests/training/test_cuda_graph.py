"""--cuda-graph is refused, one line per reason and exit code 2, wherever a capture cannot hold.

The capture itself (training/cuda_graph.py) needs a GPU: tools/gpu_plan.sh runs it
(bench_train --cuda-graph). Here: the configuration's refusals, the missing-CUDA error and, with a
re-running stand-in for the graph, everything around the capture at pp = 1 (pp = 2:
test_cuda_graph_pipeline.py).
"""
import contextlib

import pytest
import torch

from megalite.config import RunConfig
from megalite.errors import ConfigError, UsageError
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.training.loop import configure
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step


@pytest.mark.parametrize("settings,reason", [
    (dict(tp=2), "tp=2, cp=1, ep=1: their collectives run inside forward and backward"),
    (dict(model="moe-tiny"), "MoE layers record their routing statistics in Python"),
    (dict(zero=3), "--zero 3 allocates and frees"),
    (dict(zero=2), "--zero 2 allocates and frees"),
    (dict(hidden_dropout=0.1), "dropout draws its seeds on the host"),
    (dict(recompute="selective"), "--recompute selective re-runs forward"),
    (dict(offload_optimizer=True), "--offload-optimizer moves state"),
])
def test_cuda_graph_refuses_what_a_capture_cannot_hold(settings, reason):
    world = settings.get("tp", 1) * settings.get("pp", 1)
    with pytest.raises(ConfigError) as error:
        configure(RunConfig.build(cuda_graph=True, **settings), world, 257)
    lines = [line for line in str(error.value).splitlines() if "--cuda-graph" in line]
    assert any(reason in line and "drop --cuda-graph" in line for line in lines), lines


@pytest.mark.parametrize("settings", [dict(zero=1), dict(pp=2, zero=1), dict(pp=2, virtual_stages=2),
                                      dict(pp=2, pipeline_schedule="gpipe"), dict(pp=2, pipeline_schedule="zb-h1")])
def test_cuda_graph_allows_data_parallel_and_pipeline_runs(settings):
    problems = RunConfig.build(cuda_graph=True, **settings).resolved(4, 257).validate()
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
    from megalite.training.pipeline_graphs import PipelineGraphs

    with pytest.raises(UsageError, match="needs a CUDA GPU"):
        PipelineGraphs(model, mesh)


class _RerunGraph:
    """Stands in for a captured CUDA graph on CPU: replay re-runs the captured Python on the same
    static tensors and writes the result where the graph's output lives (as a replay does)."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.out.copy_(self.fn())
        self.replays += 1


class _Stream:
    def wait_stream(self, other):
        pass


def test_replayed_steps_equal_eager_steps(monkeypatch):
    """Everything around the capture: static inputs, the loss scale as a captured input, warm-ups
    discarded, no bucket bookkeeping in captured backwards, the dp reduction and optimizer after
    the replays: three steps of two microbatches give the eager steps' losses and parameters."""
    from megalite.training import cuda_graph

    def run(graphed):
        torch.manual_seed(0)
        cfg = RunConfig.build(micro_batch_size=2, global_batch_size=4, zero=1, lr=1e-3, cuda_graph=graphed)
        mesh = single_process_mesh("cpu")
        model_cfg = preset("tiny", num_layers=2, hidden_size=64, seq_length=8)
        chunks = build_model_chunks(model_cfg, cfg, mesh)
        optimizer = build_optimizer(build_data_parallel(chunks, cfg, mesh), cfg)
        graphs = cuda_graph.StepGraphs(optimizer.model) if graphed else None
        losses = []
        for step in range(3):
            ids = torch.randint(0, model_cfg.vocab_size, (4, 9), generator=torch.Generator().manual_seed(step))
            labels = ids[:, 1:].clone()
            labels[step, :2] = -100
            mbs = [{"input_ids": i, "labels": t} for i, t in zip(ids[:, :-1].split(2), labels.split(2))]
            losses.append(train_step(optimizer.model, optimizer, mbs, mesh, cfg, lr=1e-3, graphs=graphs).loss)
        return losses, [p.detach().clone() for p in chunks[0].parameters()], graphs

    eager_losses, eager_params, _ = run(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graph, "capture", lambda fn, pool: (lambda out: (_RerunGraph(fn, out), out))(fn()))
    losses, params, graphs = run(True)
    assert losses == eager_losses
    for p, q in zip(params, eager_params):
        assert torch.equal(p, q)
    assert [slot.graph.replays for slot in graphs.slots] == [3, 3]  # captured once, replayed every step


def test_a_later_step_of_another_shape_is_refused_before_anything_communicates(monkeypatch):
    """Issue 40: the shape check ran inside the replays, after the step's token-count all-reduce."""
    from megalite.training import cuda_graph, step as step_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graph, "capture", lambda fn, pool: (lambda out: (_RerunGraph(fn, out), out))(fn()))
    counted = []
    real_tokens = step_module.GlobalTokens
    monkeypatch.setattr(step_module, "GlobalTokens", lambda mbs, mesh, **kw: counted.append(1) or real_tokens(mbs, mesh, **kw))
    cfg = RunConfig.build(micro_batch_size=2, global_batch_size=4, lr=1e-3, cuda_graph=True)
    mesh = single_process_mesh("cpu")
    model_cfg = preset("tiny", num_layers=1, hidden_size=32, seq_length=8)
    optimizer = build_optimizer(build_data_parallel(build_model_chunks(model_cfg, cfg, mesh), cfg, mesh), cfg)
    graphs = cuda_graph.StepGraphs(optimizer.model)

    def microbatches(seq):
        ids = torch.randint(0, model_cfg.vocab_size, (4, seq + 1), generator=torch.Generator().manual_seed(seq))
        return [{"input_ids": i, "labels": t} for i, t in zip(ids[:, :-1].split(2), ids[:, 1:].split(2))]

    train_step(optimizer.model, optimizer, microbatches(8), mesh, cfg, lr=1e-3, graphs=graphs)
    assert counted == [1]
    with pytest.raises(UsageError, match=r"microbatch 0's input_ids has shape \(2, 7\) but its graph was captured for "
                                         r"\(2, 8\)"):
        train_step(optimizer.model, optimizer, microbatches(7), mesh, cfg, lr=1e-3, graphs=graphs)
    assert counted == [1]  # refused before the step's first collective
