"""megalite.pipeline.Pipeline: a user's own stack of plain torch blocks, split into stages, runs under
every schedule and gives the gradients and loss of the unsplit model in one process."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.pipeline import Pipeline, split_layers
from megalite.testing import assert_tensor_close, run_distributed

VOCAB, HIDDEN, SEQ, MICRO, MICROBATCHES = 16, 8, 6, 2, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):  # [s, b, h] -> [s, b, h]
        return x + torch.tanh(self.fc(self.norm(x)))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids):  # [b, s] -> [s, b, h]
        return self.table(ids).transpose(0, 1)


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), *[Block() for _ in range(4)], nn.Linear(HIDDEN, VOCAB))


def loss_fn(logits, labels):  # [s, b, V], [b, s] -> loss sum
    return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")


def _data():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (MICROBATCHES, MICRO, SEQ + 1), generator=gen)
    return [(mb[:, :-1], mb[:, 1:]) for mb in ids]


def _check_schedules():
    from megalite.distributed.mesh import init_mesh

    mesh = init_mesh(pp=2)
    data, tokens = _data(), MICROBATCHES * MICRO * SEQ
    reference = build()
    expected_loss = sum(loss_fn(reference(x), y) for x, y in data) / tokens
    expected_loss.backward()
    losses = {}
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("gpipe", 1), ("zb-h1", 1)):
        model = build()
        stages = split_layers(model, 2 * v)
        pipe = Pipeline(stages, mesh, loss_fn, num_microbatches=MICROBATCHES, activation_shape=(SEQ, MICRO, HIDDEN),
                        schedule=schedule, virtual_stages=v)
        losses[schedule] = pipe.step(data, loss_scale=1 / tokens) / tokens
        mine = {id(p) for chunk in pipe.chunks for p in chunk.parameters()}
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if id(p) in mine:
                assert_tensor_close(p.grad, q.grad, 1e-5, f"{schedule} {name}")
    return float(expected_loss), losses


def test_user_stages_match_one_process_under_every_schedule():
    results = run_distributed(_check_schedules, 2)
    expected, last_stage = results[1]
    for schedule, loss in last_stage.items():
        assert abs(loss - expected) <= 1e-5 * abs(expected), (schedule, loss, expected)
    assert all(loss == 0.0 for loss in results[0][1].values())  # the loss lives on the last stage


def test_split_layers_counts_and_refusals():
    parts = split_layers(build(), 4)
    assert [len(p) for p in parts] == [2, 2, 1, 1]
    assert [len(p) for p in split_layers(build(), 2, counts=[1, 5])] == [1, 5]
    try:
        split_layers(build(), 2, counts=[3, 2])
    except ValueError as exc:
        assert "adding up to 6" in str(exc)
    else:
        raise AssertionError("bad counts accepted")
