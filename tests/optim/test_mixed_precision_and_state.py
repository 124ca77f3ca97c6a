"""dp=2: fp16 with the dynamic loss scaler (an overflow on one rank skips the step everywhere),
bf16 params with fp32 master weights, and the layout-free optimizer state loaded into another
zero stage / bucket layout."""
import dataclasses
import math

import torch

from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.optim.loss_scaler import DynamicLossScaler
from megalite.testing import run_distributed
from optim_helpers import GLOBAL_BATCH, SEQ, ToyGPT, portable, sharded_adamw, toy_batch

LR = 1e-2


def _step(m, model, opt, step, poison=False, scaler=None):
    rows = GLOBAL_BATCH // m.dp_size
    ids, targets = toy_batch(step)
    sl = slice(m.dp_rank * rows, (m.dp_rank + 1) * rows)
    opt.zero_grad()
    loss = model(ids[sl], targets[sl]) / (GLOBAL_BATCH * SEQ)
    if poison:
        loss = loss * float("inf")
    (scaler.scale_loss(loss) if scaler else loss).backward()
    opt.step(lr=LR)
    result = dataclasses.asdict(opt.last_step)
    result["dp_bytes"] = {o: n for (g, o), n in comm.ledger.bytes.items() if g == "dp"}  # before the loss's own
    total = comm.all_reduce(loss.detach().float().clone(), m.dp_group)
    return float(total), result


def _snapshot(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _fp16_overflow(m):
    torch.manual_seed(0)
    model = ToyGPT().half()
    scaler = DynamicLossScaler(initial_scale=2.0 ** 8, growth_interval=2)
    opt = sharded_adamw(model, m, zero_stage=1, clip_grad=1.0, loss_scaler=scaler)
    out = {"loss0": _step(m, model, opt, 0, scaler=scaler)[0], "scales": [scaler.scale]}
    before = _snapshot(model)
    _, result = _step(m, model, opt, 1, poison=m.dp_rank == 1, scaler=scaler)  # overflow on rank 1 only
    out["skipped"] = result["skipped"]
    out["unchanged"] = all(torch.equal(before[n], v) for n, v in _snapshot(model).items())
    out["scales"].append(scaler.scale)
    for step in (2, 3):
        _, result = _step(m, model, opt, step, scaler=scaler)
        out["scales"].append(scaler.scale)
        assert not result["skipped"]
    out["dtype"] = str(next(model.parameters()).dtype)
    return out


def _bf16(m):
    torch.manual_seed(0)
    model = ToyGPT().to(torch.bfloat16)
    opt = sharded_adamw(model, m, zero_stage=2)
    comm.ledger.reset()
    loss0, result = _step(m, model, opt, 0)
    gathered = result["dp_bytes"]
    numel = opt.model.layout.numel
    pieces_match = all(torch.equal(opt.master[x.shard_start:x.shard_end].to(torch.bfloat16),
                                   opt.params[x.param].detach().reshape(-1)[x.local_start:x.local_end])
                       for x in opt.pieces)
    return dict(loss0=loss0, dp_bytes=gathered, numel=numel, memory=opt.memory_report(),
                master_dtype=str(opt.master.dtype), pieces_match=pieces_match)


def _merge_states(states):
    """Every dp rank's owned pieces -> one whole local tensor per parameter (start=0, end=numel)."""
    merged = {}
    for state in states:
        for name, e in state["params"].items():
            whole = merged.setdefault(name, {"start": 0, "end": e["numel"], "numel": e["numel"],
                                             **{k: torch.full((e["numel"],), float("nan"))
                                                for k in ("master", "exp_avg", "exp_avg_sq")}})
            for key in ("master", "exp_avg", "exp_avg_sq"):
                whole[key][e["start"]:e["end"]] = e[key]
    assert all(not torch.isnan(w[k]).any() for w in merged.values() for k in ("master", "exp_avg", "exp_avg_sq"))
    return {"step": states[0]["step"], "loss_scaler": None, "params": merged}


def _state_round_trip(m):
    torch.manual_seed(0)
    model_a = ToyGPT()
    opt_a = sharded_adamw(model_a, m, zero_stage=1, weight_decay=0.1)
    for step in range(2):
        _step(m, model_a, opt_a, step)
    states = comm.all_gather_object(opt_a.optimizer_state(), m.dp_group)

    torch.manual_seed(1)  # different init: everything must come from the loaded state
    model_b = ToyGPT()
    opt_b = sharded_adamw(model_b, m, zero_stage=2, weight_decay=0.1, bucket_size=10 ** 9)
    opt_b.load_optimizer_state(_merge_states(states))
    loaded_equal = all(torch.equal(a, _snapshot(model_b)[n]) for n, a in _snapshot(model_a).items())
    loaded_step = opt_b.step_count
    loss_a, _ = _step(m, model_a, opt_a, 2)
    loss_b, _ = _step(m, model_b, opt_b, 2)
    after_a, after_b = _snapshot(model_a), _snapshot(model_b)
    max_diff = max(float((after_a[n] - after_b[n]).abs().max()) for n in after_a)
    return dict(loaded_equal=loaded_equal, loss_a=loss_a, loss_b=loss_b, max_diff=max_diff, step=loaded_step)


def _world():
    m = mesh_lib.init_mesh()
    return portable({"fp16": _fp16_overflow(m), "bf16": _bf16(m), "state": _state_round_trip(m)})


def _reference_loss0():
    torch.manual_seed(0)
    ids, targets = toy_batch(0)
    return float(ToyGPT()(ids, targets).detach()) / (GLOBAL_BATCH * SEQ)


def test_mixed_precision_and_layout_free_state():
    ref_loss0 = _reference_loss0()
    for rank, out in enumerate(run_distributed(_world, 2)):
        fp16, bf16, state = out["fp16"], out["bf16"], out["state"]
        assert fp16["dtype"] == "torch.float16"
        assert math.isclose(fp16["loss0"], ref_loss0, rel_tol=1e-2), (fp16["loss0"], ref_loss0)
        assert fp16["skipped"], f"rank {rank}: an overflow on rank 1 must skip the step on every rank"
        assert fp16["unchanged"], "a skipped step leaves the parameters untouched"
        # 256 -> clean (1 of 2) -> overflow: backoff to 128 -> clean -> clean: growth to 256
        assert fp16["scales"] == [256.0, 128.0, 128.0, 256.0], fp16["scales"]

        assert math.isclose(bf16["loss0"], ref_loss0, rel_tol=2e-2), (bf16["loss0"], ref_loss0)
        assert bf16["master_dtype"] == "torch.float32" and bf16["pieces_match"]
        numel = bf16["numel"]
        assert bf16["dp_bytes"] == {"reduce_scatter": 4 * numel, "all_gather": 2 * numel}, bf16["dp_bytes"]
        assert bf16["memory"] == {"param_bytes": 2 * numel, "grad_bytes": 4 * numel // 2,
                                  "optimizer_state_bytes": 12 * numel // 2}

        assert state["loaded_equal"], "loading the state sets the parameters from the master weights"
        assert state["step"] == 2
        assert state["loss_a"] == state["loss_b"]
        assert state["max_diff"] <= 1e-6, state["max_diff"]
