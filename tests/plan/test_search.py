"""suggest()'s pruned search (plan/search.py) prints what the exhaustive search prints.

The oracle is `suggest(..., exhaustive=True)`: every valid candidate's full estimate, and the step
time of every one that fits. Rows are small enough for the exhaustive search to run in the quick
tier, and chosen so that each bound is exercised: many layouts fit (the step-time cut-off stops
early), a deep pipeline with uneven stages, a last stage over the memory its first stage fits in
(the stage-by-stage memory check: a check of stage 0 alone fails the last row), context parallelism
(long sequences), experts (ep, etp), the ZeRO near-best preference, the optimizer offload (nothing
fits without it) and nothing fitting at all.
"""
import pytest

from megalite.config import RunConfig
from megalite.config.model import preset
from megalite.plan import search as search_module
from megalite.plan.layout import recomputed_stage_layers, stage_layers
from megalite.plan.per_rank import estimate
from megalite.plan.ranking import _candidates, suggest
from megalite.plan.search import fits


def _described(found) -> list:
    return [(s.cfg.to_dict(), s.step_time_s, s.reason, s.estimate.to_dict()) for s in found]


ROWS = [  # (model, suggest's keywords)
    (preset("gpt2-350m"), dict(gpus=16, gpu_memory=24e9, nodes=2, top_k=5)),
    (preset("llama-7b").replace(seq_length=1024), dict(gpus=16, gpu_memory=40e9, nodes=2, top_k=10,
                                                        global_batch_size=64, precision="bf16")),
    (preset("llama-1b").replace(seq_length=32768), dict(gpus=8, gpu_memory=80e9, top_k=8, global_batch_size=8)),
    (preset("mixtral-8x7b").replace(seq_length=1024, num_layers=8), dict(gpus=8, gpu_memory=80e9, top_k=4,
                                                            global_batch_size=32, hardware="A100-80GB")),
    (preset("gpt2-124m"), dict(gpus=8, gpu_memory=80e9, top_k=3)),
    (preset("llama-13b"), dict(gpus=2, gpu_memory=80e9, top_k=5, global_batch_size=8)),
    (preset("llama-70b"), dict(gpus=1, gpu_memory=80e9)),
    # stages that differ where it matters: two (tp 4, pp 2) layouts fit on stage 0 (21.5 GB) but not on
    # the last (22.3 GB: the 256k-vocabulary output layer and its logits), and would rank in the
    # top 5; a fit check that read stage 0 alone would print them
    (preset("llama3-8b").replace(vocab_size=256000, seq_length=4096),
     dict(gpus=8, gpu_memory=24e9, top_k=5, global_batch_size=32, precision="bf16")),
]


IDS = [f"{m.num_layers}x{m.hidden_size}{'-moe' if m.moe else ''}@{k['gpus']}" for m, k in ROWS]


@pytest.mark.parametrize("model,keywords", ROWS, ids=IDS)
def test_pruned_search_prints_what_the_exhaustive_search_prints(model, keywords):
    pruned = suggest(model, **keywords)
    assert _described(pruned) == _described(suggest(model, exhaustive=True, **keywords))


def test_the_cut_off_skips_predictions(monkeypatch):
    """The equality above is not vacuous: the pruned search predicts fewer layouts than fit."""
    calls = []
    real = search_module.predict_step_time
    monkeypatch.setattr(search_module, "predict_step_time", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, keywords = ROWS[0]
    suggest(model, exhaustive=True, **keywords)
    exhaustive, calls[:] = len(calls), []
    suggest(model, **keywords)
    assert 0 < len(calls) < exhaustive / 2, (len(calls), exhaustive)


def test_the_stage_by_stage_fit_check_agrees_with_the_estimate():
    model = preset("llama-7b").replace(seq_length=1024)
    base = RunConfig.build(global_batch_size=64, precision="bf16", **{k: getattr(model, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
        "vocab_size")})
    answers = set()
    for cfg in _candidates(model, base, 16, 8, offload=False):
        try:
            truth = estimate(model, cfg).fits(40e9)
        except ValueError:
            continue
        assert fits(model, cfg, 40e9) == truth, cfg.parallel
        answers.add(truth)
    assert answers == {True, False}


@pytest.mark.parametrize("settings", [dict(pp=4, virtual_stages=2), dict(pp=4, decoder_first_stage_layers=3),
                                      dict(pp=3, pipeline_layout="1,5,6,5,6,1", virtual_stages=2),
                                      dict(pp=4, virtual_stages=2, decoder_last_stage_layers=3)])
def test_blocks_per_stage_match_the_partition(settings):
    """layout.stage_layers (summed once, cached) against the pipeline's own partition, rank by rank."""
    from megalite.pipeline.partition import stage_layers as partition

    model = preset("tiny").replace(num_layers=24)
    for recompute_num_layers in (None, 2):
        cfg = RunConfig.build(recompute="full", recompute_num_layers=recompute_num_layers, **settings)
        p = cfg.parallel
        ranges = [partition(24, p.pp, p.virtual_stages, r, p.decoder_first_stage_layers, p.decoder_last_stage_layers,
                            p.pipeline_layout) for r in range(p.pp)]
        assert stage_layers(model, cfg) == [sum(len(c) for c in chunks) for chunks in ranges]
        cap = recompute_num_layers or 24
        assert recomputed_stage_layers(model, cfg) == [sum(min(cap, len(c)) for c in chunks) for chunks in ranges]


@pytest.mark.parametrize("hardware", ["A100-80GB", "H100-SXM"])
def test_the_lower_bound_is_never_above_the_prediction(hardware):
    """The cut-off's premise, on every valid candidate of a small search (both pipeline schedules,
    ZeRO 0/1/3, recompute, cp for long sequences): step_time_lower_bound <= predict_step_time."""
    from megalite.plan.timing import predict_step_time, step_time_lower_bound
    from megalite.plan.validity import preflight

    model = preset("llama-1b").replace(seq_length=16384, num_layers=8)
    base = RunConfig.build(global_batch_size=16, precision="bf16", **{k: getattr(model, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
        "vocab_size")})
    checked = 0
    for cfg in _candidates(model, base, 8, 4, offload=False):
        if preflight(model, cfg, 8):
            continue
        bound = step_time_lower_bound(model, cfg, hardware, 4)
        assert 0 < bound <= predict_step_time(model, cfg, hardware, ranks_per_node=4).total, cfg.parallel
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3), (3, 9, 2), (8, 16, 2)])
def test_the_last_stage_compute_order_is_the_built_schedules(pp, m, v):
    """activations counts the head's microbatches on interleaved_compute (one stage, no transfers):
    the placed, verified schedule runs the same forwards and backwards in the same order."""
    from megalite.pipeline.instructions import BWD, FWD
    from megalite.pipeline.schedules import build_schedule, interleaved_compute

    built = build_schedule("interleaved", pp, m, v)
    for r in range(pp):
        assert interleaved_compute(pp, m, v, r) == [op for op in built[r] if op.kind in (FWD, BWD)]
