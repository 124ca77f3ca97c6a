"""--cuda-graph at pp = 2: every (chunk, microbatch)'s forward and backward replayed, on CPU.

There is no GPU here, so a stand-in takes the CUDA graph's place: capturing runs the function
once (standing for the capture and the first replay), each later replay re-runs it and writes
the result into the tensor the capture returned. What this proves is everything around the
graphs: the static inputs and outputs, the copies in and out, the executor's transfers between
the graphs, the backward graph's input gradient passed on to the previous stage, the parameter
gradients accumulated in the DP wrapper's buffers, the slots reused across steps, the warm-up's
gradients discarded. What it cannot prove is the CUDA side (the pool shared in capture order, the
replay writing into the captured addresses): only a GPU run at pp > 1 checks that.

One forked world of four ranks (pp = 2, dp = 2, ZeRO 1): 1F1B, interleaved (2 chunks per stage) and
ZB-H1 (its W pass a third graph), three steps each, against the same steps without graphs.
"""
import contextlib

import torch

from megalite.distributed import mesh as mesh_lib
from megalite.config import RunConfig
from megalite.model import preset
from megalite.testing import run_distributed
from megalite.training import cuda_graph
from megalite.distributed.host_reads import no_host_reads
from megalite.errors import UsageError
from megalite.training.pipeline_graphs import PipelineGraphs
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

SEQ, MICRO, GLOBAL, STEPS, DP = 8, 2, 8, 3, 2  # 2 microbatches per dp rank and step
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))  # (name, chunks per stage)


class _CapturedRun:
    """A CUDA graph's stand-in: the capture ran fn once (on a GPU the capture records and the first
    replay computes); each later replay re-runs fn and copies its result into the captured output."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.replays += 1
        if self.replays == 1:
            return
        result = self.fn()
        if self.out is not None:
            with torch.no_grad():
                self.out.copy_(result)


class _Stream:
    def wait_stream(self, other):
        pass


def _stand_in_cuda():
    """This forked rank's torch.cuda, as far as the graphs use it (the mesh is built already)."""
    torch.cuda.is_available = lambda: True
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda: _Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    cuda_graph.capture = lambda fn, pool: (lambda out: (_CapturedRun(fn, out), out))(fn())


class _DroppedInputGrad(PipelineGraphs):
    """A broken wiring: the backward graph's input gradient is not passed on (zeros go back instead)."""

    def backward(self, chunk, microbatch, grad, deferred=False):
        grad_in = super().backward(chunk, microbatch, grad, deferred)
        return None if grad_in is None else torch.zeros_like(grad_in)


def _microbatches(m, vocab, step, seq=SEQ, count=GLOBAL // MICRO):
    """This dp rank's `count / dp` microbatches of the step's `count`."""
    gen = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, vocab, (count * MICRO, seq + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[step, :3] = -100  # uneven target counts
    per_rank = count * MICRO // m.dp_size
    mine = slice(m.dp_rank * per_rank, (m.dp_rank + 1) * per_rank)
    return [{"input_ids": i, "labels": t} for i, t in zip(ids[mine, :-1].split(MICRO), labels[mine].split(MICRO))]


def _train(m, schedule, v, graphs_class=None, steps=STEPS):
    cfg = RunConfig.build(pp=m.pp_size, dp=m.dp_size, micro_batch_size=MICRO, global_batch_size=GLOBAL, zero=1,
                          seed=5, pipeline_schedule=schedule, virtual_stages=v)
    model_cfg = preset("tiny", num_layers=4, hidden_size=32, seq_length=SEQ)
    chunks = build_model_chunks(model_cfg, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    graphs = graphs_class(optimizer.model, m) if graphs_class is not None else None
    results = [train_step(optimizer.model, optimizer, _microbatches(m, model_cfg.vocab_size, s), m, cfg, lr=1e-3,
                          graphs=graphs) for s in range(steps)]
    params = [p.detach().clone() for chunk in chunks for p in chunk.parameters()]
    step = lambda mbs: train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3, graphs=graphs)  # noqa: E731
    return [(r.loss, r.grad_norm) for r in results], params, graphs, step, model_cfg.vocab_size


def _refusal(step) -> str:
    try:
        step()
    except (ValueError, UsageError) as error:  # UsageError: refused before the step communicates (issue 40)
        return str(error)
    return "not refused"


def _world():
    m = mesh_lib.init_mesh(pp=2, dp=DP)
    eager = {name: _train(m, name, v)[:2] for name, v in SCHEDULES}
    _stand_in_cuda()
    graphed, replays = {}, {}
    for name, v in SCHEDULES:
        results, params, graphs, step, vocab = _train(m, name, v, PipelineGraphs)
        graphed[name] = (results, params)
        replays[name] = sorted({tuple(g.replays if g is not None else 0
                                      for g in (slot.forward_graph, slot.backward_graph, slot.weight_graph))
                                for slot in graphs.slots.values()}), len(graphs.slots)
    refused = [_refusal(lambda: step(_microbatches(m, vocab, 0, seq=SEQ // 2))),
               _refusal(lambda: step(_microbatches(m, vocab, 0, count=GLOBAL // MICRO // 2)))]
    dropped = _train(m, "1f1b", 1, _DroppedInputGrad, steps=1)[0]
    return eager, graphed, replays, refused, dropped


def test_replayed_pipeline_steps_equal_eager_steps():
    with no_host_reads(python_entry_points=False):  # its first use imports torch._dynamo (seconds): once
        torch.zeros(1).add_(1)                        # here, not in every forked rank (a no-op in a full run)
    for rank, (eager, graphed, replays, refused, dropped) in enumerate(run_distributed(_world, 2 * DP, timeout_s=120)):
        for name, chunks_per_stage in SCHEDULES:
            (eager_results, eager_params), (results, params) = eager[name], graphed[name]
            assert results == eager_results, (rank, name)  # per step: the loss and the grad norm, exactly
            assert len(params) == len(eager_params)
            for p, q in zip(params, eager_params):
                assert torch.equal(p, q), (rank, name)
            # one slot per (chunk, microbatch), each graph captured once and replayed every step (ZB-H1: W too)
            graphs_per_slot = (STEPS, STEPS, STEPS if name == "zb-h1" else 0)
            assert replays[name] == ([graphs_per_slot], chunks_per_stage * GLOBAL // MICRO // DP), (rank, name)
        assert "this step has 2 microbatches of input_ids [(2, 4)], the captured pipeline 2 of (2, 8)" in refused[0], \
            refused[0]
        assert "this step has 1 microbatches" in refused[1] and "the captured pipeline 2 of" in refused[1], refused[1]
        # Sensitivity: had the backward graph's input gradient not reached stage 0, its gradients (and so
        # the global grad norm) would differ while the loss (a forward) would not.
        assert dropped[0][0] == eager["1f1b"][0][0][0] and dropped[0][1] != eager["1f1b"][0][0][1]
