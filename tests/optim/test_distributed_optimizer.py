"""DistributedOptimizer (ZeRO 0/1/2, offload, tp + sequence parallel, tied embedding) vs torch.optim.AdamW at (1,1,1).

A toy GPT built from megalite's TP layers (vocab-parallel embedding tied to the output layer,
column/row-parallel MLPs, LayerNorms) trains a few steps with gradient accumulation; the
loss, the global grad norm and every parameter must match a single-process model trained
with torch.optim.AdamW + clip_grad_norm_. Memory and dp communication bytes are checked
against their formulas.
"""
import dataclasses
import math

import pytest
import torch

from megalite.parameters import params as P
from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.data_parallel import DataParallel
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.loss_scaler import DynamicLossScaler
from megalite.testing import run_distributed
from optim_helpers import GLOBAL_BATCH, SEQ, ToyGPT, toy_batch, portable

LR, WEIGHT_DECAY, CLIP, STEPS = 1e-2, 0.1, 0.5, 3


def _reference(steps=STEPS):
    torch.manual_seed(0)
    model = ToyGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        ids, targets = toy_batch(step)
        loss = model(ids, targets) / targets.numel()  # normalised by the global token count
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(m, zero_stage, microbatches, *, steps=STEPS, bucket_size=64, offload=False, sp=False, scaler=None,
           dtype=torch.float32, grad_reduce_dtype=torch.float32, overlap=False):
    """Train the toy model on this rank; return what the test compares."""
    torch.manual_seed(0)
    model = ToyGPT(m.tp_group, sp).to(dtype)
    dp = DataParallel(model, m, zero_stage=zero_stage, bucket_size=bucket_size, grad_reduce_dtype=grad_reduce_dtype,
                      overlap_param_gather=overlap, dp_reduction="sum")
    opt = DistributedOptimizer(dp, weight_decay=WEIGHT_DECAY, clip_grad=CLIP, offload_optimizer=offload,
                               loss_scaler=scaler)
    in_flight = []  # buckets whose all-gather is still running when step() returns
    left_after_forward = []  # ... and still running after the next forward (its reads wait for them)
    rows = GLOBAL_BATCH // m.dp_size
    losses, norms, results = [], [], []
    for step in range(steps):
        opt.zero_grad()
        comm.ledger.reset()
        ids, targets = toy_batch(step)
        ids, targets = ids[m.dp_rank * rows:(m.dp_rank + 1) * rows], targets[m.dp_rank * rows:(m.dp_rank + 1) * rows]
        total = torch.zeros(())
        for mb_ids, mb_targets, i in zip(ids.chunk(microbatches), targets.chunk(microbatches), range(microbatches)):
            dp.set_last_microbatch(i == microbatches - 1)
            loss = dp(mb_ids, mb_targets) / (GLOBAL_BATCH * SEQ)  # global token count: a dp SUM is right
            if i == 0 and step > 0:
                left_after_forward.append(len(dp.param_buffer.pending))
            (scaler.scale_loss(loss) if scaler else loss).backward()
            total += loss.detach().float()
        dp_bytes_during_backward = comm.ledger.total_bytes(group="dp")
        opt.step(lr=LR)
        result = dataclasses.asdict(opt.last_step)
        in_flight.append(len(dp.param_buffer.pending))
        dp_bytes = {o: n for (g, o), n in comm.ledger.bytes.items() if g == "dp"}  # one step's dp traffic
        results.append(result)
        losses.append(float(comm.all_reduce(total, m.dp_group)))
        norms.append(result["grad_norm"])
    opt.wait_for_params()  # the parameters are read below, outside a forward
    layout = dp.layout
    first = next(model.parameters())
    first_module_bucket = layout.slots[next(i for i, p in enumerate(opt.params) if p is first)].bucket
    return dict(losses=losses, norms=norms, results=results, in_flight=in_flight, left_after_forward=left_after_forward,
                gathers_first=dp.gather_order[0] == first_module_bucket,
                params={n: (P.shard_spec(p), p.detach().float().clone())
                        for n, p in model.named_parameters()},
                masters_match=bool(torch.equal(
                    torch.cat([opt.master_range(a.shard_start, a.shard_end).to(dtype) for a in opt.pieces]),
                    torch.cat([opt.params[a.param].detach().reshape(-1)[a.local_start:a.local_end] for a in opt.pieces]))),
                memory=opt.memory_report(), numel=layout.numel, shard_numel=layout.shard_numel,
                param_numel=layout.param_numel, buckets=len(layout.buckets),
                dp_bytes=dp_bytes,
                dp_bytes_during_backward=dp_bytes_during_backward,
                ranges=opt.owned_ranges(), state=opt.optimizer_state())


def _check_parity(out, ref, rank, what):
    ref_losses, ref_norms, ref_params = ref
    for a, b in zip(out["losses"], ref_losses):
        assert math.isclose(a, b, rel_tol=1e-5), f"{what} rank {rank}: losses {out['losses']} vs {ref_losses}"
    for a, b in zip(out["norms"], ref_norms):
        assert math.isclose(a, b, rel_tol=1e-5), f"{what} rank {rank}: grad norms {out['norms']} vs {ref_norms}"
    assert out["masters_match"], f"{what}: parameters are not the master weights cast to the param dtype"
    for name, (spec, value) in out["params"].items():
        expected = spec.shard(ref_params[name]) if spec is not None else ref_params[name]
        torch.testing.assert_close(torch.from_numpy(value), expected, rtol=1e-5, atol=1e-6, msg=f"{what} rank {rank} {name}")


def _check_memory_and_bytes(out, zero_stage, dp, param_bytes_per_elem, what):
    numel, shard_numel = out["numel"], out["shard_numel"]
    psi = out["param_numel"]
    shards = dp if zero_stage else 1
    assert shard_numel * shards == numel and numel >= psi
    assert numel - psi < out["buckets"] * shards, f"{what}: padding is at most dp-1 per bucket"
    # fp32 on the device: the parameters are the master (two moments, 8 bytes); offloaded: fp32 master + moments
    state_bytes = 12 if ("offload" in what or param_bytes_per_elem != 4) else 8
    assert out["memory"]["optimizer_state_bytes"] == state_bytes * numel // shards, what
    assert out["memory"]["param_bytes"] == param_bytes_per_elem * numel
    expected_grad = {0: 4 * numel, 1: 4 * numel + 4 * numel // dp, 2: 4 * numel // dp}[zero_stage]
    assert out["memory"]["grad_bytes"] == expected_grad, (what, out["memory"], expected_grad)
    assert out["dp_bytes_during_backward"] > 0, f"{what}: no dp reduction started during backward"
    if zero_stage == 0:  # one all-reduce of the fp32 grad buffer
        assert out["dp_bytes"] == {"all_reduce": 4 * numel}, (what, out["dp_bytes"])
    else:  # reduce-scatter of the fp32 grads + all-gather of the params: 2Ψ elements in ring terms
        assert out["dp_bytes"] == {"reduce_scatter": 4 * numel, "all_gather": param_bytes_per_elem * numel}, \
            (what, out["dp_bytes"])


def _dp4_world():
    m = mesh_lib.init_mesh(tp=1, pp=1)
    runs = {f"zero{z}": _train(m, z, microbatches=2) for z in (0, 1, 2)}
    runs["zero1_offload"] = _train(m, 1, microbatches=1, offload=True)
    runs["zero2_offload"] = _train(m, 2, microbatches=2, offload=True)
    runs["zero2_one_bucket"] = _train(m, 2, microbatches=2, bucket_size=10 ** 9)
    runs["zero1_scaled"] = _train(m, 1, microbatches=2, scaler=DynamicLossScaler(2.0 ** 10, growth_interval=100))
    runs["zero1_overlap"] = _train(m, 1, microbatches=2, overlap=True)
    runs["zero2_overlap"] = _train(m, 2, microbatches=2, overlap=True)
    return portable(runs)


def _tp2_dp2_world():
    m = mesh_lib.init_mesh(tp=2, pp=1)
    return portable({f"zero{z}": _train(m, z, microbatches=2, sp=True) for z in (0, 1, 2)})


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_zero_stages_at_dp4_match_adamw(reference):
    per_rank = run_distributed(_dp4_world, 4)
    for rank, runs in enumerate(per_rank):
        for what, out in runs.items():
            zero = int(what[4])
            _check_parity(out, reference, rank, what)
            _check_memory_and_bytes(out, zero, 4, 4, what)
            assert not any(r["skipped"] for r in out["results"])
    one_bucket = per_rank[0]["zero2_one_bucket"]
    assert one_bucket["buckets"] == 1
    assert one_bucket["numel"] == 4 * math.ceil(one_bucket["param_numel"] / 4)
    assert per_rank[0]["zero1_scaled"]["results"][-1]["loss_scale"] == 2.0 ** 10
    # --overlap-param-gather: the same numbers (checked above), with the gathers really left in
    # flight by step() for the next forward, started in forward order, and all waited for by the
    # forward's reads (the toy model reads every parameter).
    for rank, runs in enumerate(per_rank):
        for what, out in runs.items():
            overlapping = what.endswith("_overlap")
            assert (min(out["in_flight"]) > 0) == overlapping, (what, out["in_flight"])
            assert out["left_after_forward"] == [0] * (STEPS - 1), (what, out["left_after_forward"])
            assert out["gathers_first"], what
    # The layout-free state: over dp, every parameter's owned ranges tile its local tensor exactly once.
    for what in ("zero1", "zero2"):
        for name, (spec, value) in per_rank[0][what]["params"].items():
            ranges = sorted(r[what]["ranges"][name] for r in per_rank if name in r[what]["ranges"])
            assert ranges[0][0] == 0 and ranges[-1][1] == value.size, (what, name, ranges)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (what, name, ranges)


def test_zero_stages_with_tp2_sequence_parallel_dp2_match_adamw(reference):
    per_rank = run_distributed(_tp2_dp2_world, 4)
    for rank, runs in enumerate(per_rank):
        for what, out in runs.items():
            _check_parity(out, reference, rank, f"tp2 dp2 {what}")
            _check_memory_and_bytes(out, int(what[4]), 2, 4, what)
