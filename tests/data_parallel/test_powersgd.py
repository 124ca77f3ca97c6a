"""PowerSGD inside GradBuffers at dp = 4, ZeRO 0/1/2: every step against a hand computation.

Each parameter's gradient is data we choose (loss = sum(p * x)), so the test knows every rank's
gradient exactly and recomputes the algorithm in the parent process: the decompressed sums,
every rank's residual share and Q after every step. Also: the bytes on the dp group equal
r(n + m) per compressed matrix plus numel per other gradient, in two all-reduces; the residual
is conserved exactly (what was applied plus what the ranks hold equals every gradient ever
given); warm-up steps reduce plainly; accumulation compresses once; a non-finite gradient on one
rank, or a step the caller skips, leaves the state bit for bit as it was; a loss scale is
divided out of the residual.
"""
import torch
from torch import nn

from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.data_parallel.grad_buffers import GradBuffers
from megalite.data_parallel.powersgd import PowerSGDConfig, first_q, orthonormal
from megalite.plan.compression import compresses, effective_rank, matrix_view, reduction_elements
from megalite.testing import run_distributed

DP, RANK, SEED = 4, 2, 5
# compressed at rank 2 (min compression 2): [12, 8], [8, 20], [16, 3, 2] viewed as [16, 6]; not: [6], [3, 4]
SHAPES = [(12, 8), (6,), (8, 20), (3, 4), (16, 3, 2)]
CONFIG = PowerSGDConfig(rank=RANK, warmup_steps=1, min_compression=2.0, seed=SEED)
# step -> how it runs: the plain warm-up step, compressed steps (one with two microbatches),
# a non-finite gradient on rank 1, a step the caller skips, a loss-scaled step, a last plain one.
STEPS = ["warmup", "plain", "accumulate", "nonfinite", "skip", "scaled", "plain"]
SCALE = 256.0


def _grad(step, rank, index, micro=0):
    """The gradient rank `rank` gives parameter `index` in `step` (microbatch `micro`)."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + 10 * index + micro)
    return torch.randn(SHAPES[index], generator=g)


def _step_grads(step, rank):
    kind = STEPS[step]
    grads = [_grad(step, rank, i) for i in range(len(SHAPES))]
    if kind == "accumulate":
        grads = [g + _grad(step, rank, i, micro=1) for i, g in enumerate(grads)]
    if kind == "nonfinite" and rank == 1:
        grads[2][1, 3] = float("inf")
    return grads


class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in SHAPES)

    def backward(self, xs, scale=1.0):
        (scale * sum((p * x).sum() for p, x in zip(self.ps, xs))).backward()  # grad of p = scale * x


def _worlds():
    m = mesh_lib.init_mesh()
    return {zero_stage: _world(m, zero_stage) for zero_stage in (0, 1, 2)}


def _world(m, zero_stage):
    model = Params()
    engine = GradBuffers(list(model.ps), m.dp_group, bucket_size=100, zero_stage=zero_stage, compression=CONFIG,
                         skip_group=comm.world_group())
    position = {id(p): i for i, p in enumerate(model.ps)}
    order = [position[id(p)] for p in engine.params]  # engine order -> SHAPES index
    compressor = engine.compressor
    out = []
    for step, kind in enumerate(STEPS):
        engine.zero_grad()
        comm.ledger.reset()
        scale = SCALE if kind == "scaled" else 1.0
        if kind == "accumulate":
            with engine.no_sync():
                model.backward([_grad(step, m.dp_rank, i) for i in range(len(SHAPES))])
            dp_calls_in_accumulation = sum(n for (g, _), n in comm.ledger.calls.items() if g == "dp")
            model.backward([_grad(step, m.dp_rank, i, micro=1) for i in range(len(SHAPES))])
        else:
            dp_calls_in_accumulation = 0
            model.backward(_step_grads(step, m.dp_rank), scale)
        engine.finish_reduction(grad_scale=scale, skip=kind == "skip")
        record = {"dp_bytes": {op: n for (g, op), n in comm.ledger.bytes.items() if g == "dp"},
                  "dp_calls": {op: n for (g, op), n in comm.ledger.calls.items() if g == "dp"},
                  "world_bytes": comm.ledger.total_bytes(group="world"), "accumulation_calls": dp_calls_in_accumulation,
                  "sent": engine.last_reduction_bytes, "layout_numel": engine.layout.numel,
                  "errors": {order[i]: compressor.error_of(i).clone() for i in compressor.matrices},
                  "qs": {order[i]: compressor.q_of(i).clone() for i in compressor.matrices}}
        if zero_stage == 0:
            record["reduced"] = [(order[i], 0, p.numel(), engine.main_grad(i).reshape(-1).clone())
                                 for i, p in enumerate(engine.params)]
        else:
            record["reduced"] = [(order[x.param], x.local_start, x.local_end,
                                  engine.grad_shard[x.shard_start:x.shard_end].clone())
                                 for x in engine.layout.owned_pieces(engine.shard_rank)]
        out.append(record)
    return out


def _reference():
    """The algorithm by hand: per step, every parameter's reduced gradient (None: NaN, skipped
    or not reduced), every rank's residual share and the Q of each compressed parameter."""
    compressed = [i for i, s in enumerate(SHAPES) if compresses(s, RANK, CONFIG.min_compression)]
    views = {i: matrix_view(SHAPES[i]) for i in compressed}
    ranks = {i: effective_rank(*views[i], RANK) for i in compressed}
    errors = {(w, i): torch.zeros(views[i]) for w in range(DP) for i in compressed}
    qs = {i: first_q(views[i][1], ranks[i], SEED) for i in compressed}
    steps = []
    for step, kind in enumerate(STEPS):
        grads = [_step_grads(step, w) for w in range(DP)]
        if kind in ("warmup", "nonfinite", "skip"):
            reduced = [sum(g[i] for g in grads) for i in range(len(SHAPES))] if kind == "warmup" else None
        else:
            reduced = [sum(g[i] for g in grads) for i in range(len(SHAPES))]
            for i in compressed:
                ms = [grads[w][i].reshape(views[i]) + errors[(w, i)] for w in range(DP)]
                p_hat = orthonormal(sum(mw @ orthonormal(qs[i]) for mw in ms))
                q_ws = [mw.t() @ p_hat for mw in ms]
                qs[i] = sum(q_ws)
                reduced[i] = (p_hat @ qs[i].t()).reshape(SHAPES[i])
                for w in range(DP):
                    errors[(w, i)] = ms[w] - p_hat @ q_ws[w].t()
        steps.append({"reduced": reduced, "errors": {k: v.clone() for k, v in errors.items()},
                      "qs": {k: v.clone() for k, v in qs.items()}})
    return compressed, steps


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()), msg=what)


def test_powersgd_steps_equal_the_hand_computation():
    results = run_distributed(_worlds, DP)
    compressed, reference = _reference()
    for zero_stage in (0, 1, 2):
        _check(zero_stage, [r[zero_stage] for r in results], compressed, reference)


def _check(zero_stage, per_rank, compressed, reference):
    factors = reduction_elements(SHAPES, RANK, CONFIG.min_compression)
    assert factors == sum(ranks * (n + m) for n, m, ranks in [(12, 8, 2), (8, 20, 2), (16, 6, 2)]) + 6 + 12
    applied = {i: torch.zeros(SHAPES[i]) for i in compressed}
    for step, kind in enumerate(STEPS):
        ref = reference[step]
        for rank, records in enumerate(per_rank):
            record, what = records[step], f"zero {zero_stage} step {step} ({kind}) rank {rank}"
            plain_op = "all_reduce" if zero_stage == 0 else "reduce_scatter"
            numel = record["layout_numel"]
            if kind == "warmup":
                assert record["dp_bytes"] == {plain_op: 4 * numel}, what
                assert record["sent"] == (4 * numel, 4 * numel), what
            elif kind in ("nonfinite", "skip"):  # nothing sent on dp; the state unchanged bit for bit
                assert record["dp_bytes"] == {} and record["sent"] == (0, 0), what
                assert record["world_bytes"] == (4 if kind == "nonfinite" else 0), what
            else:  # P's + uncompressed, then Q's: r(n + m) per matrix instead of n*m
                assert record["dp_bytes"] == {"all_reduce": 4 * factors}, what
                assert record["dp_calls"] == {"all_reduce": 2}, what
                assert record["world_bytes"] == 4, what  # the one-flag finiteness check
                assert record["sent"] == (4 * factors, 4 * numel), what
            assert record["accumulation_calls"] == 0, what
            for i in compressed:
                if kind in ("nonfinite", "skip"):
                    assert torch.equal(record["errors"][i], per_rank[rank][step - 1]["errors"][i]), what
                    assert torch.equal(record["qs"][i], per_rank[rank][step - 1]["qs"][i]), what
                _close(record["errors"][i], ref["errors"][(rank, i)], f"{what}: error of {i}")
                _close(record["qs"][i], ref["qs"][i], f"{what}: Q of {i}")
            for i, start, end, values in record["reduced"]:
                if ref["reduced"] is None:
                    if kind == "nonfinite":
                        assert torch.isnan(values).all(), what
                    continue
                expected = ref["reduced"][i].reshape(-1)[start:end] * (SCALE if kind == "scaled" else 1.0)
                _close(values, expected, f"{what}: reduced gradient of {i}")
        if ref["reduced"] is not None and kind != "warmup":
            for i in compressed:
                applied[i] += ref["reduced"][i]
    # The residual is conserved: applied + held by the ranks = every gradient given while compressing.
    given = {i: sum(_step_grads(s, w)[i] for s, k in enumerate(STEPS) if k in ("plain", "accumulate", "scaled")
                    for w in range(DP)) for i in compressed}
    for i in compressed:
        held = sum(per_rank[w][-1]["errors"][i] for w in range(DP)).reshape(SHAPES[i])
        _close(applied[i] + held, given[i], f"conservation of {i}")
        assert held.abs().max() > 1e-3 * given[i].abs().max()  # rank 2 of these matrices misses something


def test_compression_refuses_zero3_and_is_off_for_one_replica():
    import pytest

    from megalite.data_parallel import DataParallel
    from megalite.distributed.mesh import single_process_mesh

    with pytest.raises(ValueError, match="zero_stage 0, 1 or 2, not 3"):
        DataParallel(Params(), single_process_mesh("cpu"), zero_stage=3, grad_compression=CONFIG)
    model = DataParallel(Params(), single_process_mesh("cpu"), grad_compression=CONFIG)
    assert model.compression is None and model.compression_stats() == {}  # dp = 1: nothing is reduced
