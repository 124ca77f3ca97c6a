"""Honest accounting of packed documents and sliding windows: the FLOPs (and MFU) count attention over
the real document lengths and windows, measured on the step's microbatches; the planner takes a mean
document length and a window, and its step time (which --simulate replays) drops with them."""
import pytest
import torch

from megalite.config import RunConfig
from megalite.model import preset
from megalite.plan import estimate
from megalite.plan.timing import predict_step_time
from megalite.training.metrics import ThroughputMeter, measured_attention_span

LENGTHS = ([16], [1, 15], [5, 3, 1, 7], [8, 8])


def _microbatches():
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in LENGTHS])
    ids = torch.zeros(4, 16, dtype=torch.long)
    return [{"input_ids": ids[:2], "labels": ids[:2], "position_ids": positions[:2]},
            {"input_ids": ids[2:], "labels": ids[2:], "position_ids": positions[2:]}]


def test_the_measured_span_is_the_sum_of_squared_document_lengths_per_token():
    squares = sum(n * n for lengths in LENGTHS for n in lengths)
    assert measured_attention_span(_microbatches(), None) == pytest.approx(squares / 64)
    plain = [{"input_ids": torch.zeros(2, 16, dtype=torch.long)}]
    assert measured_attention_span(plain, None) is None
    # a window of 4 without documents: min(i + 1, 4) keys per token, 58 pairs per 16 tokens
    assert measured_attention_span(plain, 4) == pytest.approx(2 * 58 / 16 - 1)


def test_the_meter_counts_only_the_attention_computed():
    model = preset("llama-7b")
    meter = ThroughputMeter(model, 4096, micro_batch_size=1, dp=1, num_microbatches=1, world_size=1,
                            peak_tflops_per_gpu=1000.0)
    whole, packed = meter.step(1, 1.0), meter.step(2, 1.0, attention_span=512.0)
    attention = 12 * model.num_layers * model.hidden_size * (4096 - 512) * 4096  # FLOPs of the skipped keys
    assert (whole["tflops_per_rank"] - packed["tflops_per_rank"]) * 1e12 == pytest.approx(attention)
    assert packed["mfu"] < whole["mfu"]


def test_the_planner_takes_a_mean_document_length_and_a_window():
    settings = dict(model="llama-7b", micro_batch_size=1, global_batch_size=8)
    plain = RunConfig.build(**settings)
    documents = RunConfig.build(**settings, reset_position_ids=True, reset_attention_mask=True,
                                mean_document_length=512)
    windowed = RunConfig.build(**settings, window_size=1024)
    model = plain.gpt_config()
    tokens = 8 * 4096
    saved = estimate(model, plain).flops_per_step - estimate(model, documents).flops_per_step
    assert saved == pytest.approx(12 * model.num_layers * model.hidden_size * (4096 - 512) * tokens)
    assert estimate(windowed.gpt_config(), windowed).flops_per_step < estimate(model, plain).flops_per_step
    # the mean length counts only under --reset-attention-mask (else documents attend to each other)
    ignored = RunConfig.build(**settings, mean_document_length=512)
    assert estimate(model, ignored).flops_per_step == estimate(model, plain).flops_per_step
    times = [predict_step_time(cfg.gpt_config(), cfg, "H100-SXM").compute for cfg in (plain, documents)]
    assert times[1] < times[0]
