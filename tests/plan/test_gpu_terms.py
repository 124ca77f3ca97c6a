"""The step-time model's measured GPU terms (plan/kernel_rates.py, plan/launches.py): attention from the
measured dispatch table, memory-bound kernels at their measured fraction of copy, host launches."""
import ast
import dataclasses
from pathlib import Path

import pytest

from megalite.config import RunConfig
from megalite.plan import kernel_rates as R
from megalite.plan import launches as L
from megalite.plan.hardware import BUILTIN, H200_MEASURED_ATTENTION_MS
from megalite.plan.timing import Kernels, block_pass, predict_step_time

H200 = BUILTIN["H200"]


def run(model: str, micro: int, seq: int, **settings) -> RunConfig:
    cfg = RunConfig.build(model=model, micro_batch_size=micro, global_batch_size=micro, seq_length=seq,
                          vocab_size=257, precision="bf16", **settings)
    return cfg.resolved(1, 257)


def test_h200_attention_rows_are_the_dispatch_table():
    # read kernels/attention_dispatch.py's table as a literal: importing it would import torch and triton
    source = (Path(__file__).resolve().parents[2] / "kernels" / "attention_dispatch.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.AnnAssign) and
                getattr(n.target, "id", "") == "MEASURED_MS")
    MEASURED_MS = ast.literal_eval(node.value)
    assert {(d, p, c): rows for (arch, d, p, c), rows in MEASURED_MS.items() if arch == "sm_90"} == \
        H200_MEASURED_ATTENTION_MS


def test_attention_term_reads_the_measured_table():
    cfg = run("gpt2-124m", 8, 1024)                       # d 64, 12 heads, MHA, no dropout: Triton is fastest
    model = cfg.gpt_config()
    work = 8 * 1024 * 12 * 64 / (R.ATTENTION_TABLE_TOKENS * R.ATTENTION_TABLE_WIDTH)
    assert block_pass(model, cfg, H200).attention_forward == pytest.approx(2.0917e-3 * work * 2 / 7)
    table = {1024: {"triton": 2.0, "sdpa": 3.0, "sdpa_gqa": 1.0}, 4096: {"triton": 4.0, "sdpa": 6.0}}
    assert R.choose_attention(table, 1024, grouped=False, dropout=False) == "triton"
    assert R.choose_attention(table, 1500, grouped=True, dropout=False) == "sdpa_gqa"   # nearest row: 1024
    assert R.choose_attention(table, 1024, grouped=True, dropout=True) == "triton"     # megalite's mask
    assert R.choose_attention(table, 1024, grouped=False, dropout=False, backend="sdpa") == "sdpa"
    # between measured lengths the rate is log2-interpolated: at 2048 halfway between 1024 and 4096
    rate = R._work_per_ms(table, "triton", 2048)
    unit = R.ATTENTION_TABLE_TOKENS * R.ATTENTION_TABLE_WIDTH
    assert rate == pytest.approx(unit * (1024 / 2.0 + 4096 / 4.0) / 2)
    # unmeasured: a head dim the table lacks, or a GPU without a table, keeps the efficiency model
    odd = run("gpt2-124m", 8, 1024, num_attention_heads=8)   # d 96
    assert R.attention_seconds(H200, 96, "bf16", True, 1024, 8192, 8, False, False) is None
    efficiency = 2 * 8 * 8 * 1024 * 1024 * 0.5 * 96 / (989e12 * H200.attention_efficiency)
    assert block_pass(odd.gpt_config(), odd, H200).attention_forward == pytest.approx(2 * efficiency)
    h100 = BUILTIN["H100-SXM"]
    assert not h100.attention_ms and R.attention_seconds(h100, 64, "bf16", True, 1024, 8192, 12, False, False) is None


def test_memory_bound_families_at_their_measured_fraction():
    cfg = run("llama-1b", 1, 256, num_layers=1)
    model = cfg.gpt_config()
    at_copy = dataclasses.replace(H200, memory_fractions={})
    slower = dataclasses.replace(H200, memory_fractions={"rms_norm": (0.5, 0.25)})
    tokens, h = 256, model.hidden_size
    norm_forward = 2 * 2 * 2 * tokens * h / (H200.memory_bandwidth_gbs * 1e9)     # two norms: x -> y, bf16
    assert block_pass(model, cfg, slower).forward - block_pass(model, cfg, at_copy).forward == \
        pytest.approx(norm_forward)                                                 # at 1/2: twice the time
    assert block_pass(model, cfg, slower).backward - block_pass(model, cfg, at_copy).backward == \
        pytest.approx(3 * 1.5 * norm_forward)                                       # x, dy -> dx at 1/4
    with pytest.raises(ValueError, match="memory_fractions"):
        dataclasses.replace(H200, memory_fractions={"rope": (0.0, 1.0)})


def test_launches_counted_from_the_model_match_the_h200_traces():
    gpt2, llama = run("gpt2-124m", 8, 1024), run("llama-1b", 4, 2048)
    assert L.block_launches(gpt2.gpt_config()) == L.Launches(15, 49)     # gpt2_trace.json.gz: 52, less 3 q/k/v copies
    per_step = lambda cfg: sum(dataclasses.astuple(L.stage_launches(cfg.gpt_config(), cfg, 0))) + \
        L.optimizer_launches(cfg.gpt_config(), cfg, 0)
    assert per_step(gpt2) == 925                                                    # the trace's 961, less 12 x 3
    assert per_step(llama) == 1477                                                  # its profile: 1448 (1499 before)
    # since the Triton kernels write attention's output in [s, b, h] (issue 26): no copy of it or its
    # gradient, 24 launches fewer per gpt2 step (tools/bench_host_overhead.py counts the same 24)
    assert L.block_launches(gpt2.gpt_config(), output_in_place=True) == L.Launches(14, 48)
    assert R.attention_implementation(gpt2.gpt_config(), gpt2, H200) == "triton"    # the H200 table's choice
    assert sum(dataclasses.astuple(L.stage_launches(gpt2.gpt_config(), gpt2, 0, "triton"))) + \
        L.optimizer_launches(gpt2.gpt_config(), gpt2, 0) == 925 - 24
    assert L.queued_seconds([(1.0, 3.0), (5.0, 1.0)]) == 6.0     # GPU-bound, then the host holds it back
    assert L.queued_seconds([(1.0, 3.0), (1.0, 4.0)]) == 7.0     # the GPU never waits after the first


def test_host_time_bounds_a_tiny_model_and_cuda_graphs_remove_it():
    cfg = run("gpt2-124m", 1, 128, num_layers=2, hidden_size=128, num_attention_heads=2)
    model = cfg.gpt_config()
    launches = L.stage_launches(model, cfg, 0, R.attention_implementation(model, cfg, H200))
    eager = predict_step_time(model, cfg, H200)
    assert eager.compute == pytest.approx(L.host_seconds(H200, launches.forward + launches.backward))
    graphed = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training))
    object.__setattr__(graphed.training, "cuda_graph", True)   # the --cuda-graph setting (issue 26) if absent
    assert L.uses_cuda_graph(graphed) and not L.uses_cuda_graph(cfg)
    replayed = predict_step_time(model, graphed, H200)
    device = block_pass(model, cfg, H200)
    assert replayed.compute < eager.compute / 10 and replayed.compute >= 2 * (device.forward + device.backward)
    # a GPU-bound model: the host queues ahead and the GPU's time is the step's
    big = run("llama-1b", 4, 2048)
    parts = predict_step_time(big.gpt_config(), big, H200)
    device_only = predict_step_time(big.gpt_config(), big, dataclasses.replace(H200, launch_host_us=1e-9))
    assert parts.compute == pytest.approx(device_only.compute)
    assert predict_step_time(big.gpt_config(), big, H200, kernels=Kernels(attention_backend="triton")).compute > \
        parts.compute                                                               # auto runs SDPA (GQA)
