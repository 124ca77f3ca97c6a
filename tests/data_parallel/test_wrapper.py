"""DataParallel over plain torch modules: at ZeRO 0 any torch optimizer steps on the reduced grads;
at ZeRO 1/2/3 megalite's optimizer updates the shard the wrapper hands it (ZeRO-3: the default
units of a plain module, or units given as a list of submodules). All equal one process
training the whole batch with torch.optim.AdamW: with the loss divided by the global batch's
tokens and dp_reduction="sum" (megalite's convention), and with a model returning the mean loss
of its own rank's batch, as torch DDP users write, under the default dp_reduction="mean"."""
import math

import torch
from torch import nn

from megalite.distributed import mesh as mesh_lib
from megalite.data_parallel import DataParallel
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.testing import assert_tensor_close, run_distributed

VOCAB, WIDTH, ROWS, SEQ, STEPS, LR = 50, 24, 8, 6, 3, 1e-2


class PlainLM(nn.Module):
    """Nothing from megalite: its gradients reach the wrapper through post-accumulate hooks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids) + self.mlp(self.embed(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _batch(step):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _grad_norm(params) -> float:
    return float(torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt())


def _reference(with_grad_norms=False):
    torch.manual_seed(0)
    model = PlainLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        ids, labels = _batch(step)
        (model(ids, labels) / ids.numel()).backward()
        norms.append(_grad_norm(model.parameters()))
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (params, norms) if with_grad_norms else params


def _train(m, zero_stage, torch_optimizer, units=None):
    torch.manual_seed(0)
    module = PlainLM()
    model = DataParallel(module, m, zero_stage=zero_stage, bucket_size=500, units=units and units(module),
                         dp_reduction="sum")
    if torch_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    else:
        opt = DistributedOptimizer(model, weight_decay=0.0)
    rows = ROWS // m.dp_size
    for step in range(STEPS):
        model.zero_grad()
        ids, labels = _batch(step)
        ids, labels = ids[m.dp_rank * rows:(m.dp_rank + 1) * rows], labels[m.dp_rank * rows:(m.dp_rank + 1) * rows]
        for i, (mb_ids, mb_labels) in enumerate(zip(ids.chunk(2), labels.chunk(2))):  # accumulation 2
            model.set_last_microbatch(i == 1)
            (model(mb_ids, mb_labels) / (ROWS * SEQ)).backward()
        if torch_optimizer:
            model.finish_grad_sync()  # every param.grad is now the dp-summed gradient
            opt.step()
        else:
            opt.step(lr=LR)
    with model.gathered():  # ZeRO-3: the full values exist only while gathered
        return {n: p.detach().clone() for n, p in model.chunks[0].named_parameters()}


def _train_ddp_style(m, zero_stage):
    """What a torch DDP user writes: the mean loss of this rank's batch, the wrapper's defaults.
    Returns (parameters, gradient norm per step): Adam hides a gradient's scale, the norm does not."""
    torch.manual_seed(0)
    model = DataParallel(PlainLM(), m, zero_stage=zero_stage)  # dp_reduction="mean"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0) if zero_stage == 0 else \
        DistributedOptimizer(model, weight_decay=0.0)
    rows, norms = ROWS // m.dp_size, []
    for step in range(STEPS):
        model.zero_grad()
        ids, labels = (t[m.dp_rank * rows:(m.dp_rank + 1) * rows] for t in _batch(step))
        (model(ids, labels) / ids.numel()).backward()  # a mean over this rank's tokens
        if zero_stage == 0:
            model.finish_grad_sync()
            norms.append(_grad_norm(model.parameters()))
            opt.step()
        else:
            opt.step(lr=LR)
            norms.append(opt.last_step.grad_norm)
    with model.gathered():
        return {n: p.detach().clone() for n, p in model.chunks[0].named_parameters()}, norms


def _world():
    m = mesh_lib.init_mesh()
    runs = {"zero0 + torch AdamW": _train(m, 0, True), "zero1": _train(m, 1, False), "zero2": _train(m, 2, False),
            "zero3 default units": _train(m, 3, False),
            "zero3 given units": _train(m, 3, False, units=lambda lm: [lm.embed, lm.mlp[1], lm.mlp[3]]),
            "mean loss, zero0 + torch AdamW": _train_ddp_style(m, 0), "mean loss, zero3": _train_ddp_style(m, 3)}
    return runs


def test_plain_torch_model_under_the_wrapper_matches_one_process():
    reference, reference_norms = _reference(with_grad_norms=True)
    for rank, runs in enumerate(run_distributed(_world, 2)):
        for what, params in runs.items():
            if what.startswith("mean loss"):
                params, norms = params
                assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(norms, reference_norms)), \
                    (what, norms, reference_norms)
            for name, value in params.items():
                assert_tensor_close(value, reference[name], rtol=1e-5, what=f"rank {rank} {what} {name}")
