"""Graph safety: nothing inside forward or backward reads a tensor's value on the host.

A real training step at tp = pp = dp = 2 runs with `check_host_reads=True` (item, tolist, numpy,
bool/int/float/index of a tensor, aten._local_scalar_dense, nonzero, masked_select and
device-to-host copies raise inside forward and backward), with ZeRO 1 and ZeRO 3, on the PyTorch
reference path and (ZeRO 1 with sequence parallelism) on the Triton path a GPU runs, launches
skipped; and the check fails when a block's forward reads a value, at pp = 1 and in a pipeline.
"""
import pytest
import torch

from megalite.distributed import mesh
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.model.activation_probe import kernels_without_launch
from megalite.model.transformer import TransformerBlock
from megalite.testing import RankFailed, run_distributed
from megalite.distributed.host_reads import HostReadError, no_host_reads
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

SEQ, MICRO, GLOBAL = 8, 2, 8


def _microbatches(vocab, dp, dp_rank, step):
    gen = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100
    per_rank = GLOBAL // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [{"input_ids": i, "labels": t} for i, t in zip(ids[mine, :-1].split(MICRO), labels[mine].split(MICRO))]


def _steps(m, zero, steps=2, **extra):
    cfg = RunConfig.build(tp=m.tp_size, pp=m.pp_size, dp=m.dp_size, micro_batch_size=MICRO, global_batch_size=GLOBAL,
                          zero=zero, seed=5, **extra)
    model_cfg = preset("tiny", num_layers=2, hidden_size=64, seq_length=SEQ)
    chunks = build_model_chunks(model_cfg, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    return [train_step(optimizer.model, optimizer, _microbatches(model_cfg.vocab_size, m.dp_size, m.dp_rank, s), m,
                       cfg, lr=1e-3, check_host_reads=True).loss for s in range(steps)]  # step 1 calibrates


def _world():
    m = mesh.init_mesh(tp=2, pp=2, dp=2)
    # ZeRO 1: step 1 calibrates the buckets, step 2 reduces them from backward hooks (steady state);
    # ZeRO 3 gathers, frees and reduce-scatters every unit in every step alike.
    reference = {1: _steps(m, 1, steps=2), 3: _steps(m, 3, steps=1)}
    with kernels_without_launch():  # the GPU path: Triton autograd functions, launches skipped
        _steps(m, 1, steps=1, sequence_parallel=True)  # (the bucket logic is the torch path's, run above)
    return reference


def test_training_step_reads_nothing_on_the_host_in_forward_or_backward():
    results = run_distributed(_world, 8, timeout_s=180)
    for losses in results:  # real steps: finite, falling losses, the same on every rank
        for zero in (1, 3):
            assert all(torch.isfinite(torch.tensor(losses[zero])))
            assert losses[zero] == results[0][zero]


PLANTED = {
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x.abs().max() > 1e9),
    "tolist": lambda x: x[0, 0, :2].tolist(),
    "float": lambda x: float(x[0, 0, 0]),
    "nonzero": lambda x: x.flatten().nonzero(),
}


@pytest.mark.parametrize("read", sorted(PLANTED))
def test_a_read_planted_in_a_blocks_forward_fails(read, monkeypatch):
    forward = TransformerBlock.forward

    def planted(self, x, rope, rng):
        PLANTED[read](x)
        return forward(self, x, rope, rng)

    monkeypatch.setattr(TransformerBlock, "forward", planted)
    with pytest.raises(HostReadError, match="reads a tensor's value on the host"):
        _steps(single_process_mesh("cpu"), 0, steps=1)


def _planted_in_a_pipeline():
    forward = TransformerBlock.forward

    def planted(self, x, rope, rng):
        x.sum().item()
        return forward(self, x, rope, rng)

    TransformerBlock.forward = planted  # this forked rank's copy of the class
    _steps(mesh.init_mesh(tp=1, pp=2, dp=1), 1, steps=1)


def test_a_read_planted_in_a_pipeline_stage_fails():
    """The pipeline path (run_pipeline's check_host_reads) is guarded too: stage 0's first forward raises."""
    with pytest.raises(RankFailed, match="HostReadError: Tensor.item reads a tensor's value on the host"):
        run_distributed(_planted_in_a_pipeline, 2, timeout_s=60)


def test_reads_outside_the_guard_are_untouched():
    x = torch.ones(3)
    with no_host_reads():
        y = x * 2  # device work is fine
        with pytest.raises(HostReadError):
            y.sum().item()
    assert y.sum().item() == 6.0 and bool(y[0] == 2) and y.tolist() == [2.0, 2.0, 2.0]


def test_the_dispatch_level_check_alone_catches_scalar_reads():
    """What --cuda-graph's warm-up keeps: every scalar read still ends in a rejected aten op."""
    x = torch.ones(3)
    for read in (lambda: x.sum().item(), lambda: bool(x[0] > 0), lambda: int(x[1]), lambda: x.nonzero()):
        with no_host_reads(python_entry_points=False), pytest.raises(HostReadError, match="aten."):
            read()
