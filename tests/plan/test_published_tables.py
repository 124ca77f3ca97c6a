"""The planner against published tables: the papers' formulas are the assertions, not their measurements.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Table 2 /
Eqs. 1-6: activation bytes per layer for six techniques, at the paper's four models (its Table 3).
Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"), Table 1 with the layouts of Megatron-LM's examples/sc21/run_table_1.sh: parameters
(Eq. 2), FLOPs per iteration with full recompute (Eq. 3), the pipeline bubble (p - 1) / (v m).
"""
import pytest

from megalite.config import RunConfig
from megalite.config.model import GPTConfig
from megalite.pipeline.instructions import BWD, FWD
from megalite.pipeline.schedules import build_schedule
from megalite.plan import activations as A
from megalite.plan import per_rank as E

S, VOCAB = 2048, 51200

# Korthikanti et al. Table 3: (name, heads a, hidden h, layers, tp t, micro batch b)
KORTHIKANTI_MODELS = [("22B", 64, 6144, 48, 8, 4), ("175B", 96, 12288, 96, 8, 1), ("530B", 128, 20480, 105, 8, 1),
                      ("1T", 160, 25600, 128, 8, 1)]
# Table 2's techniques: (tensor parallel, sequence parallel, recompute)
TECHNIQUES = [(False, False, "none"), (True, False, "none"), (True, True, "none"), (True, False, "selective"),
              (True, True, "selective"), (False, False, "full")]


def korthikanti_formula(s, b, h, a, t, tensor_parallel, sequence_parallel, recompute) -> float:
    """Table 2, as printed (2-byte activations, 1-byte dropout masks, attention scores kept)."""
    sbh, t = s * b * h, (t if tensor_parallel else 1)
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        return sbh * 34 / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t)) if t > 1 else sbh * (34 + 5 * a * s / h)


@pytest.mark.parametrize("name, heads, hidden, layers, tp, batch", KORTHIKANTI_MODELS)
def test_activation_bytes_per_layer_at_most_korthikanti_table_2(name, heads, hidden, layers, tp, batch):
    model = GPTConfig("gpt2", num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                      seq_length=S, hidden_dropout=0.1, attention_dropout=0.1)
    for tensor_parallel, sequence_parallel, recompute in TECHNIQUES:
        cfg = RunConfig.build(tp=tp if tensor_parallel else 1, sequence_parallel=sequence_parallel, recompute=recompute,
                              micro_batch_size=batch, precision="bf16")
        planned = A.layer_activation_bytes(model, cfg)
        formula = korthikanti_formula(S, batch, hidden, heads, tp, tensor_parallel, sequence_parallel, recompute)
        case = (name, tensor_parallel, sequence_parallel, recompute, planned / (S * batch * hidden))
        assert planned <= formula, case
        if recompute == "full":
            assert planned == formula, case  # Eq. 6: the layer input, nothing else


# Narayanan et al. Table 1 with run_table_1.sh's layouts:
# (billions printed, heads, hidden, layers, tp, pp, GPUs, global batch, micro batch, virtual stages)
NARAYANAN_ROWS = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1),
                  (7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1),
                  (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3),
                  (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2),
                  (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1)]


def narayanan_run(row) -> tuple[GPTConfig, RunConfig]:
    _, heads, hidden, layers, tp, pp, gpus, batch, micro, v = row
    model = GPTConfig("gpt2", num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                      seq_length=S)
    cfg = RunConfig.build(tp=tp, pp=pp, dp=gpus // (tp * pp), virtual_stages=v, global_batch_size=batch,
                          micro_batch_size=micro, precision="fp16", recompute="full").resolved(gpus, VOCAB)
    return model, cfg


@pytest.mark.parametrize("row", NARAYANAN_ROWS, ids=[f"{r[0]}B" for r in NARAYANAN_ROWS])
def test_narayanan_table_1_parameters_flops_and_bubble(row):
    billions, _, h, l, _, pp, gpus, batch, micro, v = row
    model, cfg = narayanan_run(row)
    # Eq. 2: P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)); megalite also counts the final LayerNorm (2h)
    eq2 = 12 * l * h * h + 13 * l * h + (VOCAB + S) * h
    assert model.num_params() == eq2 + 2 * h
    assert round(eq2 / 1e9, 1) == billions
    # Eq. 3: F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h)) with full recompute; the planner's executed
    # FLOPs add the biases' and norms' 6N + 2N terms (8 (13 l h + 2h) per token) that Eq. 3 leaves out
    est = E.estimate(model, cfg)
    eq3 = 96 * batch * S * l * h * h + 16 * batch * S * l * h * S + 6 * batch * S * VOCAB * h
    assert est.hardware_flops_per_step == pytest.approx(eq3 + batch * S * 8 * (13 * l * h + 2 * h), rel=1e-12)
    # the bubble: (p - 1) / (v m) of the ideal time, i.e. (p - 1) / (v m + p - 1) of the step
    m = batch // (micro * gpus // (cfg.parallel.tp * pp))
    assert cfg.num_microbatches == m
    assert est.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), rel=1e-12)


def test_interleaved_first_stage_counts_chunk_0s_embeddings(monkeypatch):
    """530B row (pp 35, v 3, m 280): stage 0 peaks with 2*34 + 2*35 + 1 = 139 chunk-microbatches in
    flight, but the embedding belongs to model chunk 0: Megatron's warm-up runs chunk 0 for
    microbatches 0..34, chunks 1 and 2 for 0..34, then chunk 0 for 35..68, so 2 pp - 1 = 69 of
    them hold embedding activations."""
    model, cfg = narayanan_run(NARAYANAN_ROWS[8])
    assert A.inflight_microbatches(cfg, 0) == 139
    assert A.embedding_inflight_microbatches(cfg, 0) == 2 * 35 - 1
    small = RunConfig.build(pp=4, virtual_stages=2, micro_batch_size=1, global_batch_size=8).resolved(4, 64)
    assert (A.inflight_microbatches(small, 0), A.embedding_inflight_microbatches(small, 0)) == (11, 7)
    one_chunk = small.replace(virtual_stages=1)
    assert A.embedding_inflight_microbatches(one_chunk, 0) == A.inflight_microbatches(one_chunk, 0) == 4
    for pp, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 3), (3, 9, 2)):  # chunk 0's count at the schedule's peak
        layout = RunConfig.build(pp=pp, virtual_stages=v, micro_batch_size=1, global_batch_size=m).resolved(pp, 64)
        for stage, ops in enumerate(build_schedule("interleaved", pp, m, v)):
            live, peak, chunk_0 = [0] * v, 0, 0
            for op in (op for op in ops if op.kind in (FWD, BWD)):
                live[op.chunk] += 1 if op.kind == FWD else -1
                peak, chunk_0 = (sum(live), live[0]) if sum(live) > peak else (peak, chunk_0)
            assert A.embedding_inflight_microbatches(layout, stage) == chunk_0, (pp, m, v, stage)
    fixed = A.activation_bytes(model, cfg, 0)
    monkeypatch.setattr(A, "embedding_inflight_microbatches", A.inflight_microbatches)  # every chunk-microbatch
    assert A.activation_bytes(model, cfg, 0) - fixed == (139 - 69) * A.embedding_activation_bytes(model, cfg)
