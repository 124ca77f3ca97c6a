"""DualPipeV as data: its V placement, the verifier over a grid, its bubble against the published formula,
and the executor on a toy model against one process (training at pp 2 and 4: tests/training/
test_train_step_dualpipev.py)."""
import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.pipeline import PipelineSpec, run_pipeline
from megalite.pipeline.instructions import BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, SEND_ACT, Instr
from megalite.pipeline.overlap import dualpipev_idle
from megalite.pipeline.partition import ChunkPlacement, chunk_location, model_chunk_id, stage_layers
from megalite.pipeline.placement import ideal_timeline
from megalite.pipeline.schedules import _dualpipev, build_schedule, check_schedule_args, verified_schedule
from megalite.pipeline.verifier import ScheduleError, peak_live_microbatches, verify_schedule
from megalite.testing import run_distributed
from pipeline_helpers import ToyChunk, ToyModel
from test_executor import HIDDEN, LAYERS, MICRO, SEQ, VOCAB, make_microbatches, oracle, rel_err

V = ChunkPlacement.V


def test_v_placement_holds_chunks_r_and_2pp_minus_1_minus_r():
    for pp in range(1, 9):
        for placement in ChunkPlacement:
            for k in range(2 * pp):
                assert model_chunk_id(pp, *chunk_location(pp, k, placement), placement) == k
        assert [model_chunk_id(pp, r, c, V) for r in range(pp) for c in (0, 1)] == \
            [k for r in range(pp) for k in (r, 2 * pp - 1 - r)]
    # the model's blocks over 2*pp chunks in model order: rank 0 holds the first and the last
    assert stage_layers(8, 2, 2, 0, placement=V) == [range(0, 2), range(6, 8)]
    assert stage_layers(8, 2, 2, 1, placement=V) == [range(2, 4), range(4, 6)]
    assert stage_layers(8, 2, 2, 0, layout="1,3,3,1", placement=V) == [range(0, 1), range(7, 8)]
    assert stage_layers(8, 2, 2, 1, first=1, last=1, placement=V) == [range(1, 4), range(4, 7)]
    with pytest.raises(ValueError, match="set --virtual-stages 2"):
        stage_layers(8, 2, 1, 0, placement=V)


def test_dualpipev_verifies_over_the_grid():
    for pp in range(2, 9):
        for m in range(2 * pp, 2 * pp + 5):
            schedule = build_schedule("dualpipev", pp, m, 2)
            verify_schedule(schedule, pp, 2, m, placement=V)  # no deadlock, F before B, sends match receives
            verify_schedule(build_schedule("dualpipev", pp, m, 2, forward_only=True), pp, 2, m, forward_only=True,
                            placement=V)
            for r, ops in enumerate(schedule):
                compute = [op for op in ops if not op.is_transfer]
                # every chunk's forward, input-gradient and weight pass of every microbatch, once; no whole BWD
                assert sorted((op.kind, op.chunk, op.microbatch) for op in compute) == sorted(
                    (kind, c, mb) for kind in (FWD, BWD_INPUT, BWD_WEIGHT) for c in (0, 1) for mb in range(m))
                assert not any(op.kind == BWD for op in compute)
                # the published activation memory: PP+1 chunk-microbatches for PP = 2pp stages, on every rank
                assert peak_live_microbatches(ops) == 2 * pp + 1, (pp, m, r)
            # the turn of the V is in memory: rank pp-1 sends nothing between its own chunks
            assert not any(op.is_transfer and (op.kind in (SEND_ACT,) and op.chunk == 0 or
                                               op.kind == RECV_ACT and op.chunk == 1) for op in schedule[pp - 1])
        # the same instructions under Megatron's placement are another pipeline: the verifier says so
        with pytest.raises(ScheduleError):
            verify_schedule(build_schedule("dualpipev", pp, 2 * pp, 2), pp, 2, 2 * pp)


@pytest.mark.parametrize("pp, m, v, match", [
    (4, 7, 2, r"at least 2\*pp = 8 microbatches, got 7; raise --global-batch-size"),
    (2, 4, 1, "set --virtual-stages 2"), (2, 4, 3, "set --virtual-stages 2"), (1, 4, 2, "need pp >= 2"),
])
def test_dualpipev_refuses_in_one_line(pp, m, v, match):
    with pytest.raises(ValueError, match=match) as error:
        check_schedule_args("dualpipev", pp, m, v)
    assert "\n" not in str(error.value)


def test_local_hop_rules():
    schedule = [list(ops) for ops in build_schedule("dualpipev", 2, 4, 2)]
    bad = [list(schedule[0]), [Instr(SEND_ACT, 0, 0) if op == Instr(FWD, 1, 0) else op for op in schedule[1]]]
    bad[1].insert(bad[1].index(Instr(SEND_ACT, 0, 0)) + 1, Instr(FWD, 1, 0))
    with pytest.raises(ScheduleError, match="successor is a local chunk of this stage: nothing is sent"):
        verify_schedule(bad, 2, 2, 4, placement=V)
    swapped = [list(schedule[0]), list(schedule[1])]
    i, j = swapped[1].index(Instr(FWD, 0, 0)), swapped[1].index(Instr(FWD, 1, 0))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match=r"needs FWD\(chunk 0, mb 0\) before it"):
        verify_schedule(swapped, 2, 2, 4, placement=V)


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 9), (4, 8), (4, 13), (8, 16), (8, 24)])
def test_bubble_against_the_published_formula(pp, m):
    # DeepSeek-V3 report, Table 2 (DualPipe README): bubble (PP/2 - 1)(F&B + B - 3W) for PP stages, i.e.
    # (pp - 1)(F&B + B - 3W) on pp ranks; F, B (a whole backward), W per chunk. At F = B_input = W = 1:
    unit = {FWD: 1.0, BWD: 2.0, BWD_INPUT: 1.0, BWD_WEIGHT: 1.0}
    published = (pp - 1) * ((unit[FWD] + unit[BWD]) + unit[BWD] - 3 * unit[BWD_WEIGHT])
    # the F&B pairs run as one unit of F + B: the published clock exactly, the same idle time on every rank
    assert dualpipev_idle(pp, m, unit, pair_cost=unit[FWD] + unit[BWD]) == published
    # megalite runs each pair's F, then B, then W: an F whose input is ready need not wait for its B's
    # gradient, and every rank idles (pp - 1) F, half the published bubble
    assert dualpipev_idle(pp, m, unit) == (pp - 1) * unit[FWD] == published / 2
    times = ideal_timeline(_dualpipev(pp, m), pp, 2, V)  # the placement's clock agrees
    makespan = max(end for stage in times for _, end in stage)
    assert makespan == 6 * m + (pp - 1)
    assert all(makespan - sum(end - start for start, end in stage) == pp - 1 for stage in times)


def _toy_world(pp, m):
    mesh = mesh_lib.init_mesh(tp=1, pp=pp, dp=1, replace=True)
    microbatches, loss_scale = make_microbatches(m), 1.0 / (m * MICRO * SEQ)
    ref_loss, ref_grads = oracle(False, microbatches, loss_scale)
    full = ToyModel(VOCAB, HIDDEN, LAYERS, tied=False)
    chunks = [ToyChunk(full, ids, pre_process=mesh.pp_rank == 0 and c == 0, post_process=mesh.pp_rank == 0 and c == 1)
              for c, ids in enumerate(stage_layers(LAYERS, pp, 2, mesh.pp_rank, placement=V))]
    spec, stats = PipelineSpec("dualpipev", m, (SEQ, MICRO, HIDDEN), torch.float32, 2), {}
    loss = run_pipeline(spec, chunks, microbatches, mesh, loss_scale, stats=stats)
    grad_err = max(rel_err(p.grad, ref_grads[chunk.oracle_names()[name]])
                   for chunk in chunks for name, p in chunk.named_parameters())
    eval_loss = run_pipeline(spec, chunks, microbatches, mesh, loss_scale, forward_only=True)
    static_peak = peak_live_microbatches(list(verified_schedule("dualpipev", pp, m, 2)[mesh.pp_rank]))
    return dict(stage=mesh.pp_rank, loss=loss, eval_loss=eval_loss, ref_loss=ref_loss, grad_err=grad_err,
                peak=stats["peak_live_microbatches"], static_peak=static_peak,
                deferred=stats["deferred_weight_grads"])


@pytest.mark.parametrize("pp, m", [(2, 5), pytest.param(4, 8, marks=pytest.mark.slow)])  # a 4-rank world: slow
def test_executor_matches_one_process_model(pp, m):
    for r in run_distributed(_toy_world, pp, pp, m, timeout_s=120):
        on_loss_stage = r["stage"] == 0  # the last model chunk is rank 0's second
        for key in ("loss", "eval_loss"):
            assert r[key] == pytest.approx(r["ref_loss"], rel=1e-5) if on_loss_stage else r[key] == 0.0, r
        assert r["grad_err"] < 1e-5, r
        assert r["peak"] == r["static_peak"] == 2 * pp + 1, r
        assert r["deferred"] == 2 * m * (LAYERS // (2 * pp)), r  # every linear's weight pass really deferred
