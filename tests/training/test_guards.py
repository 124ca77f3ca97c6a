"""Numerical guards on a real tp=2 x dp=2 training world: NaN loss/gradients and a drifted replica.

One forked gloo world runs every distributed check in order (steps of a tiny GPT through
megalite's real train_step and DistributedOptimizer); the pure pieces are checked in-process.
"""
import math

import pytest
import torch

from megalite.parameters import params as P
from megalite.distributed import mesh
from megalite.model import preset
from megalite.testing import run_distributed
from megalite.config import RunConfig
from megalite.training.guards import (NonFiniteError, NonFiniteGuard, ReplicaMismatchError, check_replicas,
                                      describe_mismatch, parameter_checksums, tensor_checksum)
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step
from megalite.training.step_result import StepResult

MICRO, GLOBAL, SEQ = 2, 8, 8


def _batch(vocab, dp_rank, step):
    """This dp rank's 2 microbatches and their (made-up) global sample indices."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)[dp_rank * 4:(dp_rank + 1) * 4]
    mbs = [{"input_ids": i, "labels": t} for i, t in zip(ids[:, :-1].split(MICRO), ids[:, 1:].split(MICRO))]
    first = 100 * step + 4 * dp_rank
    return mbs, [[first, first + 1], [first + 2, first + 3]]


def _params(chunks):
    return [(n, p) for chunk in chunks for n, p in chunk.logical_parameters()]


def _replica_error(named, m, step):
    """check_replicas' error message, or None when the replicas agree."""
    try:
        check_replicas(named, m, step=step)
    except ReplicaMismatchError as exc:
        return str(exc)
    return None


def _guard_world():
    m = mesh.init_mesh(tp=2, pp=1, dp=2)
    model = preset("tiny", num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=SEQ)
    cfg = RunConfig.build(tp=2, pp=1, dp=2, micro_batch_size=MICRO, global_batch_size=GLOBAL, zero=1, clip_grad=1.0)
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    logged = []
    skip = NonFiniteGuard(m, "skip", log=logged.append)
    stop = NonFiniteGuard(m, "stop", log=logged.append)
    named = _params(chunks)
    out = {}

    # 1. A healthy step: no event, no extra collective; replicas agree.
    mbs, indices = _batch(model.vocab_size, m.dp_rank, 1)
    result = train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3)
    assert skip.check(1, result, indices) is None and not logged
    check_replicas(named, m, step=1)

    # 2. A NaN gradient on one rank only (rank 3: tp 1, dp 1): every rank skips, nothing changes.
    before = [p.detach().clone() for _, p in named]
    handle = named[-1][1].register_hook(lambda g: g * float("nan")) if m.rank == 3 else None
    mbs, indices = _batch(model.vocab_size, m.dp_rank, 2)
    result = train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3)
    if handle is not None:
        handle.remove()
    event = skip.check(2, result, indices)
    assert event is not None and event.bad_grads and not event.bad_loss and not event.update_applied
    assert all(torch.equal(b, p) for b, (_, p) in zip(before, named)), "a skipped step changed parameters"
    out["skip_event"] = (event.sample_indices, event.action, logged[-1])

    # 3. The pre-step loss agreement: one rank's NaN is everyone's verdict.
    out["loss_verdicts"] = (skip.loss_is_finite(float("nan") if m.rank == 1 else 2.5), skip.loss_is_finite(2.5))

    # 4. A NaN weight on rank 0 makes the loss and the gradients non-finite: 'stop' raises everywhere.
    word = dict(named)["word_embeddings.weight"]
    saved = word.detach().clone()
    if m.rank == 0:
        with torch.no_grad():
            word[5].fill_(float("nan"))
    mbs, indices = _batch(model.vocab_size, m.dp_rank, 3)
    mbs[0]["input_ids"][0, 0] = 5  # every rank's batch reads the poisoned row (tp rank 0 holds it)
    result = train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3)
    with torch.no_grad():
        word.copy_(saved)
    try:
        stop.check(3, result, indices)
        out["stop"] = None
    except NonFiniteError as exc:
        out["stop"] = (str(exc), stop.events[-1].bad_loss, stop.events[-1].bad_grads, math.isnan(result.loss))

    # 5. Replicas still agree after the skipped steps; then rank 3 drifts by one ulp in one
    #    element of a tp-sharded parameter: only its dp group {1, 3} can see it.
    check_replicas(named, m, step=4)
    name, victim = next((n, p) for n, p in named if P.shard_spec(p).is_tp_sharded)
    saved = victim.detach().clone()
    if m.rank == 3:
        with torch.no_grad():
            flat = victim.view(-1)
            flat[1] = torch.nextafter(flat[1], torch.tensor(float("inf")))
    out["replicas"], out["victim"] = _replica_error(named, m, 5), name
    with torch.no_grad():
        victim.copy_(saved)

    # 6. tp rank 1 (ranks 1 and 3) drifts in a tp-replicated parameter, the same way on both dp
    #    replicas: dp groups agree, only the tp groups {0, 1} and {2, 3} can see it.
    check_replicas(named, m, step=6)
    name, victim = next((n, p) for n, p in named if not P.shard_spec(p).is_tp_sharded)
    if m.tp_rank == 1:
        with torch.no_grad():
            victim.view(-1)[0] += 1e-3
    out["tp_replicas"], out["tp_victim"] = _replica_error(named, m, 7), name
    return out


def test_guards_in_a_tp2_dp2_world():
    results = run_distributed(_guard_world, 4, timeout_s=120)
    for rank, out in enumerate(results):
        samples, action, line = out["skip_event"]
        assert samples == {0: [[200, 201], [202, 203]], 1: [[204, 205], [206, 207]]}  # both dp ranks' samples
        assert action == "skip"
        assert "non-finite gradients" in line and "skipped on every rank" in line and "dp rank 1: [[204, 205]" in line
        assert out["loss_verdicts"] == (False, True)
        text, bad_loss, bad_grads, loss_nan = out["stop"]
        assert bad_loss and bad_grads and loss_nan
        assert "non-finite loss and gradients" in text and "stopping (--on-nonfinite stop)" in text
        assert "dp rank 0: [[300, 301], [302, 303]]; dp rank 1: [[304, 305], [306, 307]]" in text
    victim = results[0]["victim"]
    for rank in (1, 3):  # the dp group {1, 3} holds the drifted copy and names it
        assert results[rank]["replicas"] == (
            f"parameter {victim!r} differs across data-parallel replicas at step 5: dp rank 0 (global 1) holds one "
            f"value; dp rank 1 (global 3) holds one value (no majority)")
    for rank in (0, 2):  # the healthy dp group stops too, pointing at the reporter
        assert "disagree elsewhere in the mesh (see rank 1's error)" in results[rank]["replicas"]
    victim = results[0]["tp_victim"]
    for rank in range(4):  # every rank is in a disagreeing tp group and names it
        tp_group = (0, 1) if rank < 2 else (2, 3)
        assert results[rank]["tp_replicas"] == (
            f"parameter {victim!r} differs across tensor-parallel ranks at step 7: tp rank 0 (global {tp_group[0]}) "
            f"holds one value; tp rank 1 (global {tp_group[1]}) holds one value (no majority)"), results[rank]


def test_checksum_is_bit_exact_and_order_sensitive():
    x = torch.randn(1000)
    assert torch.equal(tensor_checksum(x), tensor_checksum(x.clone()))
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(float("inf")))
    assert not torch.equal(tensor_checksum(x)[0], tensor_checksum(y)[0])  # one ulp in one element
    z = x.clone()
    z[3], z[4] = x[4], x[3]
    assert torch.equal(tensor_checksum(x)[0], tensor_checksum(z)[0]) and not torch.equal(tensor_checksum(x),
                                                                                      tensor_checksum(z))
    assert not torch.equal(tensor_checksum(torch.zeros(3)), tensor_checksum(-torch.zeros(3)))
    assert torch.equal(tensor_checksum(x.bfloat16()), tensor_checksum(x.bfloat16().clone()))
    names, table = parameter_checksums([("a", x), ("b", y)])
    assert names == ["a", "b"] and table.shape == (3, 2) and table[0, 1] == 2


def test_mismatch_names_the_minority_when_there_is_a_majority():
    text = describe_mismatch("layers.0.mlp.fc1.weight", [(1, 2), (1, 2), (9, 9), (1, 2)], [0, 2, 4, 6], step=40)
    assert text == ("parameter 'layers.0.mlp.fc1.weight' differs across data-parallel replicas at step 40: "
                    "dp rank 2 (global 4) disagrees with the majority, dp ranks 0, 1, 3 (global 0, 2, 6)")


def _result(loss: float, grad_norm: float, skipped: bool = False, loss_finite: bool = True) -> StepResult:
    """A step's result with the numbers the guard reads; the rest zero."""
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=skipped, loss_scale=1.0, tokens=0, loss_finite=loss_finite,
                      lr=0.0, exposed_dp_comm_s=0.0, exposed_grad_reduce_s=0.0, exposed_param_gather_s=0.0,
                      exposed_token_count_s=0.0)


def test_single_process_and_bad_policy():
    m = mesh.single_process_mesh("cpu")
    check_replicas([("w", torch.ones(2))], m, step=1)  # dp=1: nothing to compare, no error
    guard = NonFiniteGuard(m, "skip", loss_scaling=True, log=lambda s: None)
    assert guard.check(1, _result(2.0, float("inf"), skipped=True), [[0]]) is None  # fp16 overflow
    event = guard.check(2, _result(float("nan"), 1.0), [[7, 8]])
    assert event.update_applied and event.sample_indices == {0: [[7, 8]]}
    assert "the optimizer update WAS applied" in event.describe()
    assert guard.check(3, _result(2.0, 1.0, loss_finite=False), [[9]]).bad_loss
    with pytest.raises(ValueError, match="--on-nonfinite must be one of"):
        NonFiniteGuard(m, "ignore")


def _cp_replica_world():
    """tp 2 x cp 2 x dp 1: the replicas of a parameter are the cp ranks (same weights, other tokens)."""
    m = mesh.init_mesh(tp=2, cp=2)
    named = [("a", torch.ones(4)), ("b", torch.arange(3.0))]
    healthy = _replica_error(named, m, step=1)
    if m.rank == 3:  # tp rank 1, cp rank 1
        named[1][1][0] += 1.0
    return healthy, _replica_error(named, m, step=2)


def test_replica_check_covers_context_parallel_ranks():
    results = run_distributed(_cp_replica_world, 4)
    assert all(healthy is None for healthy, _ in results)
    for _, message in results:
        assert message is not None
    # rank 3's group is dp x cp {1, 3}: it names the parameter, the kind of replica and the global ranks
    assert "'b' differs across data- and context-parallel replicas at step 2" in results[3][1], results[3][1]
    assert "dp x cp rank 0 (global 1) holds one value; dp x cp rank 1 (global 3)" in results[3][1], results[3][1]
