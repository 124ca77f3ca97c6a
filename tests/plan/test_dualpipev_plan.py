"""The planner under DualPipeV: its V placement (stage 0 holds the embedding and the head), the
activations the schedule holds at its peak, its traffic and its bubble (against the real step on a
fake world: tests/simulate/test_simulate.py::test_dualpipev_world_matches_the_planner)."""
import pytest

from megalite.config import RunConfig
from megalite.config.model import GPTConfig
from megalite.pipeline.instructions import BWD_WEIGHT, FWD
from megalite.pipeline.schedules import verified_schedule
from megalite.pipeline.verifier import peak_live_microbatches
from megalite.plan import activations as A
from megalite.plan import communication as C
from megalite.plan import params as PARAMS
from megalite.plan import per_rank as E
from megalite.plan.layout import head_stage, stage_layers


def _run(pp, m, **settings):
    return RunConfig.build(pp=pp, virtual_stages=2, pipeline_schedule="dualpipev", micro_batch_size=1,
                           global_batch_size=m, untie_embeddings_and_output_weights=True, **settings)


def _model(num_layers=8):
    return GPTConfig(flavour="llama", num_layers=num_layers, hidden_size=64, num_attention_heads=4, vocab_size=60,
                     seq_length=16, tie_embeddings=False)


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 7), (4, 8), (4, 11), (8, 16)])
def test_activations_held_are_the_schedules_peak(pp, m):
    cfg = _run(pp, m)
    for stage, ops in enumerate(verified_schedule("dualpipev", pp, m, 2)):
        # the executor's own count on the verified schedule: every stage peaks at 2pp + 1 chunk-microbatches
        assert A.inflight_microbatches(cfg, stage) == peak_live_microbatches(list(ops)) == 2 * pp + 1
        live, peak, at_peak = {0: 0, 1: 0}, 0, None
        for op in ops:  # a microbatch's activations live from its FWD to its W
            if op.kind in (FWD, BWD_WEIGHT):
                live[op.chunk] += 1 if op.kind == FWD else -1
                if sum(live.values()) > peak:
                    peak, at_peak = sum(live.values()), dict(live)
        if stage == 0:  # the embedding is chunk 0's, the head chunk 1's: both on stage 0
            assert A.embedding_inflight_microbatches(cfg, 0) == at_peak[0]
            assert A.head_inflight_microbatches(cfg) == at_peak[1]


def test_stage_0_holds_the_embedding_and_the_head():
    model, cfg = _model(), _run(4, 8)
    assert head_stage(cfg) == 0 and head_stage(_run(4, 8).replace(pipeline_schedule="interleaved")) == 3
    assert stage_layers(model, cfg) == [2, 2, 2, 2]
    uneven = cfg.replace(decoder_first_stage_layers=1, decoder_last_stage_layers=1)  # model chunks 0 and 7: stage 0
    assert stage_layers(model, uneven) == [2, 2, 2, 2] and stage_layers(_model(14), uneven) == [2, 4, 4, 4]
    table = model.padded_vocab_size(1) * model.hidden_size
    assert PARAMS.stage_params(model, cfg, 0) - PARAMS.stage_params(model, cfg, 1) == 2 * table + model.hidden_size
    assert PARAMS.stage_params(model, cfg, 3) == PARAMS.stage_params(model, cfg, 1)
    per_microbatch = A.activation_bytes(model, cfg, 1) // (2 * 4 + 1)
    assert A.activation_bytes(model, cfg, 3) == A.activation_bytes(model, cfg, 1) == 9 * per_microbatch
    assert A.activation_bytes(model, cfg, 0) == 9 * per_microbatch + \
        A.embedding_inflight_microbatches(cfg, 0) * A.embedding_activation_bytes(model, cfg) + \
        A.head_inflight_microbatches(cfg) * A.head_activation_bytes(model, cfg)


def test_pipeline_traffic_and_bubble():
    model, cfg = _model(), _run(4, 8)
    chunk = 4 * model.seq_length * model.hidden_size  # one [s, b, h] fp32 activation or gradient
    # the ends of the V (stage 0 starts and ends it, stage 3 turns it in memory) send and receive m each way
    assert [C.communication_bytes(model, cfg, s)["pp/send"] for s in range(4)] == [2 * 8 * chunk, 4 * 8 * chunk,
                                                                                   4 * 8 * chunk, 2 * 8 * chunk]
    assert E.estimate(model, cfg).bubble_fraction == pytest.approx(3 / (6 * 8 + 3))
