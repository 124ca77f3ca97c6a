import pytest

from megalite.pipeline.instructions import FWD, Instr, split_steps
from megalite.pipeline.schedules import (SCHEDULES, _interleaved, _with_transfers, build_schedule, check_schedule_args,
                                         chunk_placement)
from megalite.pipeline.verifier import ScheduleError, peak_live_microbatches, verify_schedule

KINDS = {"F": "FWD", "B": "BWD", "b": "BWD_INPUT", "w": "BWD_WEIGHT",
         ">a": "SEND_ACT", "<a": "RECV_ACT", ">g": "SEND_GRAD", "<g": "RECV_GRAD"}


def parse(text: str) -> list[Instr]:
    """'F0.0 >a0.0 <g0.0 B0.0' -> instructions (kind, chunk.microbatch), as format_schedule prints."""
    ops = []
    for token in text.split():
        kind = token[:2] if token[0] in "<>" else token[0]
        chunk, mb = token[len(kind):].split(".")
        ops.append(Instr(KINDS[kind], int(chunk), int(mb)))
    return ops


def valid(name, pp, v, m) -> bool:
    try:
        check_schedule_args(name, pp, m, v)
        return True
    except ValueError:
        return False


def test_every_schedule_verifies_over_the_grid():
    checked = {name: 0 for name in SCHEDULES}
    for name in SCHEDULES:
        for pp in range(1, 9):
            for v in range(1, 5):
                for m in range(1, 17):
                    if not valid(name, pp, v, m):
                        with pytest.raises(ValueError):
                            build_schedule(name, pp, m, v)
                        continue
                    schedule = build_schedule(name, pp, m, v)
                    verify_schedule(schedule, pp, v, m, placement=chunk_placement(name))
                    if name in ("1f1b", "interleaved"):  # the evaluation schedule depends on (pp, m, v) only
                        verify_schedule(build_schedule(name, pp, m, v, forward_only=True), pp, v, m, forward_only=True)
                    checked[name] += 1
                    computes = sum(op.kind == FWD for ops in schedule for op in ops)
                    assert computes == pp * v * m
    # The domains: gpipe everywhere at v=1 and at v>1 (pp>1) when pp | m; 1f1b / zb-h1 at v=1;
    # interleaved at v>=2, pp>=2, pp | m; dualpipev at v=2, pp>=2, m >= 2pp.
    multiples = sum(m % pp == 0 for pp in range(2, 9) for m in range(1, 17))
    v_shaped = sum(m >= 2 * pp for pp in range(2, 9) for m in range(1, 17))
    assert checked == {"gpipe": 128 + 3 * multiples, "1f1b": 128, "zb-h1": 128, "interleaved": 3 * multiples,
                       "dualpipev": v_shaped}


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 3), (8, 16), (2, 1)])
def test_static_peak_live_activations(pp, m):
    for r in range(pp):
        assert peak_live_microbatches(build_schedule("1f1b", pp, m)[r]) == min(pp - r, m)
        # ZB-H1: at most pp - r microbatches between F and B (1F1B's), and W lags F by pp - 1
        # on every stage, so activations (held until W) peak at pp everywhere.
        assert peak_live_microbatches(build_schedule("zb-h1", pp, m)[r]) == min(pp, m)
        assert peak_live_microbatches(build_schedule("gpipe", pp, m)[r]) == m


def test_1f1b_batches_send_with_next_receive():
    # Megatron's send_forward_recv_backward: stage 1 of 4 sends activation 2 and receives grad 0 together.
    steps = [set(step) for step in split_steps(build_schedule("1f1b", 4, 6)[1])]
    assert set(parse(">a0.2 <g0.0")) in steps and set(parse(">g0.0 <a0.3")) in steps
    # and the pipeline's first receive is posted just before its forward, not earlier
    assert build_schedule("1f1b", 4, 6)[3][:2] == parse("<a0.0 F0.0")


def test_zb_h1_splits_every_backward_and_keeps_1f1b_pairing():
    pp, m = 4, 8
    for r, ops in enumerate(build_schedule("zb-h1", pp, m)):
        kinds = [op.kind for op in ops]
        assert "BWD" not in kinds and kinds.count("BWD_INPUT") == m and kinds.count("BWD_WEIGHT") == m
        # steady state: (F x, B x-(pp-1-r), W x-(pp-1)) in this order
        compute = [(op.kind, op.microbatch) for op in ops if not op.is_transfer]
        x = pp  # a steady-state index
        i = compute.index(("FWD", x))
        assert compute[i:i + 3] == [("FWD", x), ("BWD_INPUT", x - (pp - 1 - r)), ("BWD_WEIGHT", x - (pp - 1))]


@pytest.mark.parametrize("name, pp, m, v, match", [
    ("interleaved", 4, 6, 2, "multiple of pp"),
    ("interleaved", 4, 8, 1, "virtual-stages >= 2"),
    ("1f1b", 4, 8, 2, "use 'interleaved'"),
    ("zb-h1", 2, 4, 3, "use 'interleaved'"),
    ("gpipe", 1, 4, 2, "need pp >= 2"),
    ("pipedream", 2, 4, 1, "choose from"),
    ("1f1b", 2, 0, 1, "num_microbatches must be a positive integer"),
])
def test_bad_schedule_arguments(name, pp, m, v, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(name, pp, m, v)


def test_deadlock_is_rejected_naming_the_waits():
    # Stage 0 waits for gradient 0 before it sends activation 1; stage 1 waits for activation 1
    # before it runs backward 0 and sends that gradient: a cycle of waits.
    broken = [parse("F0.0 >a0.0 F0.1 <g0.0 B0.0 >a0.1 <g0.1 B0.1"),
              parse("<a0.0 F0.0 <a0.1 F0.1 B0.0 >g0.0 B0.1 >g0.1")]
    with pytest.raises(ScheduleError) as error:
        verify_schedule(broken, 2, 1, 2)
    message = str(error.value)
    assert "deadlock" in message
    assert "stage 0 waits to receive from stage 1 the gradient of model chunk 1 mb 0 (instruction #3)" in message
    assert "stage 1 waits to receive from stage 0 the activation of model chunk 0 mb 1 (instruction #2)" in message
    assert "wait chain: stage 0 -> 1 -> 0" in message


def test_send_send_deadlock_in_naive_interleaved_placement_is_caught_and_repaired():
    # Placing every receive right before its consumer deadlocks interleaved 1F1B: both stages
    # block sending a gradient the other has not posted a receive for yet.
    naive = _with_transfers(_interleaved(2, 4, 2), 2, 2)
    with pytest.raises(ScheduleError, match="deadlock: stage 0 waits to send to stage 1 the gradient.*"
                                            "stage 1 waits to send to stage 0 the gradient"):
        verify_schedule(naive, 2, 2, 4)
    verify_schedule(build_schedule("interleaved", 2, 4, 2), 2, 2, 4)  # receives hoisted: fine


def test_message_order_mismatch_is_rejected():
    # Stage 1 receives microbatch 1 first: it would silently read microbatch 0's activation.
    broken = [parse("F0.0 >a0.0 F0.1 >a0.1 <g0.0 B0.0 <g0.1 B0.1"),
              parse("<a0.1 <a0.0 F0.0 F0.1 B0.0 >g0.0 B0.1 >g0.1")]
    with pytest.raises(ScheduleError, match="message order mismatch between stage 0 and stage 1: stage 0's send #0 "
                                            ".*activation of model chunk 0 mb 0.*expects the activation of model "
                                            "chunk 0 mb 1"):
        verify_schedule(broken, 2, 1, 2)


@pytest.mark.parametrize("stage0, match", [
    ("F0.0 >a0.0 <g0.0 B0.0", "never runs FWD\\(chunk 0, mb 1\\)"),
    ("F0.0 >a0.0 F0.1 >a0.1 B0.0 <g0.0 <g0.1 B0.1", "needs RECV_GRAD\\(chunk 0, mb 0\\) before it"),
    ("F0.0 F0.1 >a0.1 <g0.0 B0.0 >a0.0 <g0.1 B0.1", "must come before the backward"),
    ("F0.0 >a0.0 F0.1 >a0.1 <g0.0 b0.0 <g0.1 B0.1 w0.1", "needs BWD_INPUT\\(chunk 0, mb 1\\)"),
    ("F0.0 >a0.0 F0.1 >a0.1 <g0.0 B0.0 <g0.1 B0.1 <a0.0", "first model chunk has no predecessor"),
])
def test_local_dataflow_errors(stage0, match):
    stage1 = parse("<a0.0 F0.0 B0.0 >g0.0 <a0.1 F0.1 B0.1 >g0.1")
    with pytest.raises(ScheduleError, match=match):
        verify_schedule([parse(stage0), stage1], 2, 1, 2)


@pytest.mark.parametrize("pp, m, v", [(4, 8, 2), (8, 16, 2), (4, 8, 4), (2, 6, 3), (3, 9, 2)])
def test_ideal_bubble_matches_the_formulas(pp, m, v):
    # On the ideal clock (F = 1, B = W = 1, BWD = 2 per chunk, free transfers) each generator's
    # compute order achieves exactly its textbook bubble.
    from megalite.pipeline.placement import ideal_timeline
    from megalite.pipeline.schedules import _gpipe, _one_f_one_b, _zb_h1

    def bubble(compute, chunks):
        makespan = max(end for stage in ideal_timeline(compute, pp, chunks) for _, end in stage)
        return 1 - 3 * m * chunks / makespan

    assert bubble(_gpipe(pp, m, 1), 1) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble(_one_f_one_b(pp, m), 1) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble(_interleaved(pp, m, v), v) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert bubble(_zb_h1(pp, m), 1) == pytest.approx((pp - 1) / (3 * m + pp - 1))


def test_forward_only_schedule_has_no_backward():
    schedule = build_schedule("1f1b", 3, 3, forward_only=True)
    assert schedule[1] == parse("<a0.0 F0.0 <a0.1 >a0.0 F0.1 <a0.2 >a0.1 F0.2 >a0.2")
    with pytest.raises(ScheduleError, match="forward-only schedule runs no backward"):
        verify_schedule(build_schedule("1f1b", 3, 3), 3, 1, 3, forward_only=True)
    with pytest.raises(ScheduleError, match="never runs RECV_GRAD"):
        verify_schedule(schedule, 3, 1, 3)
