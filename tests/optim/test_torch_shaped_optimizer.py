"""DistributedOptimizer as a torch.optim.Optimizer: param groups, LR schedulers, state_dict.

The oracle is torch.optim.AdamW with the same groups, driven by the same torch scheduler, on a
single-process copy of the model; the state dict is taken at one layout and loaded at another.
"""
import copy

import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.optim import LRSchedule, OptimizerStep, ScheduledLR
from megalite.testing import run_distributed
from optim_helpers import GLOBAL_BATCH, ToyGPT, portable, sharded_adamw, toy_batch

STEPS = 3


def _groups(model):
    """Three groups with their own lr, weight decay and betas: the embedding, the blocks' matrices, the rest."""
    named = dict(model.named_parameters())
    blocks = [p for n, p in named.items() if n.startswith("blocks.") and p.dim() >= 2]
    rest = [p for n, p in named.items() if not n.startswith("blocks.") or p.dim() < 2]
    rest = [p for p in rest if p is not named["embedding.weight"]]
    return [{"params": [named["embedding.weight"]], "lr": 3e-2, "weight_decay": 0.0},
            {"params": blocks, "weight_decay": 0.1, "betas": (0.8, 0.95)},
            {"params": rest, "weight_decay": 0.0, "eps": 1e-6}]


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _reference():
    torch.manual_seed(0)
    model = ToyGPT()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    scheduler = _scheduler(opt)
    for step in range(STEPS):
        opt.zero_grad()
        ids, targets = toy_batch(step)
        (model(ids, targets) / targets.numel()).backward()
        opt.step()
        scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_groups(zero_stage):
    m = mesh_lib.init_mesh(dp=2)
    torch.manual_seed(0)
    model = ToyGPT()
    groups = _groups(model)
    opt = sharded_adamw(model, m, zero_stage=zero_stage, params=groups, lr=1e-2)
    assert [g["lr"] for g in opt.param_groups] == [3e-2, 1e-2, 1e-2]
    scheduler = _scheduler(opt)
    rows = GLOBAL_BATCH // m.dp_size
    for step in range(STEPS):
        opt.zero_grad()
        ids, targets = toy_batch(step)
        ids, targets = ids[m.dp_rank * rows:(m.dp_rank + 1) * rows], targets[m.dp_rank * rows:(m.dp_rank + 1) * rows]
        (opt.model(ids, targets) / (GLOBAL_BATCH * targets.shape[1])).backward()
        opt.step()
        scheduler.step()
    with opt.model.gathered():
        return portable({n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_param_groups_and_torch_scheduler_match_adamw(zero_stage):
    expected = _reference()
    for got in run_distributed(_train_groups, 2, zero_stage, timeout_s=120):
        for name, value in expected.items():
            torch.testing.assert_close(torch.from_numpy(got[name]), value, rtol=1e-5, atol=1e-6, msg=name)


def _train_then_state(zero_stage, steps):
    """Train `steps` steps at dp 2; return the parameters and the optimizer's state dict."""
    m = mesh_lib.init_mesh(dp=2)
    torch.manual_seed(0)
    model = ToyGPT()
    opt = sharded_adamw(model, m, zero_stage=zero_stage, lr=1e-2, weight_decay=0.1)
    rows = GLOBAL_BATCH // m.dp_size
    for step in range(steps):
        opt.zero_grad()
        ids, targets = toy_batch(step)
        sl = slice(m.dp_rank * rows, (m.dp_rank + 1) * rows)
        (opt.model(ids[sl], targets[sl]) / (GLOBAL_BATCH * targets.shape[1])).backward()
        opt.step()
    opt.wait_for_params()
    return portable({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                     "state": opt.state_dict()})


def _as_torch(obj):
    if isinstance(obj, dict):
        return {k: _as_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_torch(v) for v in obj]
    return torch.from_numpy(obj) if hasattr(obj, "dtype") and hasattr(obj, "shape") else obj


def test_state_dict_taken_at_zero1_loads_at_zero3_and_continues_as_uninterrupted():
    """Two steps at (dp 2, ZeRO 1), state dict; a fresh (dp 2, ZeRO 3) optimizer loads it and takes a third
    step: the parameters equal three uninterrupted steps' (and the state dict is torch's shape)."""
    saved = run_distributed(_train_then_state, 2, 1, 2, timeout_s=120)[0]
    state = _as_torch(saved["state"])
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0]
    assert set(state["state"]) == set(saved["params"]) and int(state["state"]["embedding.weight"]["step"]) == 2
    assert tuple(state["state"]["embedding.weight"]["exp_avg"].shape) == saved["params"]["embedding.weight"].shape
    expected = run_distributed(_train_then_state, 2, 1, 3, timeout_s=120)[0]["params"]
    results = run_distributed(_load_and_step, 2, saved["params"], state, timeout_s=120)
    for got in results:
        for name, value in expected.items():
            torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(value), rtol=1e-6, atol=1e-7,
                                       msg=name)


def _load_and_step(params, state):
    m = mesh_lib.init_mesh(dp=2)
    torch.manual_seed(1)  # other initial weights: everything must come from the loaded state
    model = ToyGPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    opt = sharded_adamw(model, m, zero_stage=3, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(state)
    assert opt.step_count == 2
    rows = GLOBAL_BATCH // m.dp_size
    ids, targets = toy_batch(2)
    sl = slice(m.dp_rank * rows, (m.dp_rank + 1) * rows)
    opt.zero_grad()
    (opt.model(ids[sl], targets[sl]) / (GLOBAL_BATCH * targets.shape[1])).backward()
    opt.step()
    opt.wait_for_params()
    with opt.model.gathered():
        return portable({n: p.detach().clone() for n, p in model.named_parameters()})


def test_scheduled_lr_is_the_schedule_and_jumps_on_resume():
    """ScheduledLR gives each optimizer step the LRSchedule's value exactly; a group with its own lr is scaled."""
    w = torch.nn.Parameter(torch.zeros(2))
    v = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [v], "lr": 0.5}], lr=1.0)
    schedule = LRSchedule(1.0, 0.1, warmup_iters=2, decay_iters=6)
    scheduler = ScheduledLR(opt, schedule)
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        scheduler.step()
    assert [a for a, _ in seen] == [schedule(k) for k in range(6)]
    assert [b for _, b in seen] == pytest.approx([0.5 * schedule(k) for k in range(6)], rel=1e-12)
    scheduler.jump_to(4)
    assert opt.param_groups[0]["lr"] == schedule(4)


def test_step_returns_the_closures_loss_and_reports_in_last_step():
    """torch.optim's contract: step(closure) returns what the closure returned (None without one); the
    step's own facts are `last_step`, its grad norm that of the gradients the closure made."""
    torch.manual_seed(0)
    model = ToyGPT()
    reference = copy.deepcopy(model)
    opt = sharded_adamw(model, mesh_lib.single_process_mesh("cpu"), zero_stage=0, lr=1e-2, clip_grad=0.0)
    ids, targets = toy_batch(0)

    def closure():
        opt.zero_grad()
        loss = opt.model(ids, targets) / targets.numel()
        loss.backward()
        return loss

    assert opt.last_step is None
    loss = opt.step(closure)
    (reference(ids, targets) / targets.numel()).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None  # the closure's own tensor, graph and all
    assert opt.last_step == OptimizerStep(grad_norm=pytest.approx(norm, rel=1e-5), skipped=False, loss_scale=1.0)
    assert opt.last_step.grad_norm > 0
    opt.zero_grad()
    (opt.model(ids, targets) / targets.numel()).backward()
    assert opt.step() is None and not opt.last_step.skipped
