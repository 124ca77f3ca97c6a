"""Hardware profiles and the step-time model: the arithmetic by hand on synthetic profiles."""
import dataclasses
import json

import pytest

from megalite import plan as P
from megalite.config import RunConfig
from megalite.config.model import GPTConfig, preset
from megalite.plan import communication as C
from megalite.plan.hardware import (BUILTIN, HardwareProfile, HardwareProfileError, builtin_for_device,
                                    latency_bound_curve, load_profile)
from megalite.plan.timing import MEGALITE, Kernels, predict_step_time

# a device doing exactly 1e12 FLOP/s in every GEMM, with free memory traffic and no host cost
IDEAL = HardwareProfile(name="ideal", peak_tflops={"fp32": 1.0}, matmul_efficiency=((1, 1.0),),
                        memory_bandwidth_gbs=1e12, intra_node_busbw_gbs=10.0, inter_node_busbw_gbs=1.0,
                        devices_per_node=8, collective_latency_us=0.0)


def tiny(**overrides) -> GPTConfig:
    kwargs = dict(flavour="gpt2", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=60, seq_length=16)
    return GPTConfig(**{**kwargs, **overrides})


def run(**settings) -> RunConfig:
    settings.setdefault("micro_batch_size", 2)
    world = settings.get("tp", 1) * settings.get("pp", 1) * settings.get("dp", 1)
    return RunConfig.build(**settings).resolved(world, 60)


def test_builtin_profiles_and_profile_files(tmp_path):
    assert set(BUILTIN) == {"A100-80GB", "H100-SXM", "H200"}
    assert load_profile("a100-80gb") is BUILTIN["A100-80GB"] and load_profile(None).name == "H100-SXM"
    h100, h200 = BUILTIN["H100-SXM"], BUILTIN["H200"]
    assert h200.memory_bandwidth_gbs > h100.memory_bandwidth_gbs and h200.peak_tflops == h100.peak_tflops
    path = tmp_path / "profile.json"
    BUILTIN["A100-80GB"].save(path)
    assert load_profile(str(path)) == BUILTIN["A100-80GB"]
    data = json.loads(path.read_text())
    for change, message in (({"bogus": 1}, "unknown field"), ({"matmul_efficiency": [[512, 0.5], [256, 0.4]]}, "increasing"),
                            ({"memory_bandwidth_gbs": 0}, "positive")):
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(HardwareProfileError, match=message):
            load_profile(str(path))
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "peak_tflops"}))
    with pytest.raises(HardwareProfileError, match="missing field.*peak_tflops"):
        load_profile(str(path))
    with pytest.raises(HardwareProfileError, match="--calibrate"):
        load_profile("B200")


def test_the_builtin_profile_of_a_cuda_device_name():
    names = {"NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA H200": "H200", "NVIDIA A100-SXM4-80GB": "A100-80GB",
             "NVIDIA L4": None}
    assert {name: builtin_for_device(name) for name in names} == names


def test_gemm_efficiency_curve_and_roofline():
    hw = HardwareProfile(name="t", peak_tflops={"fp32": 1.0}, matmul_efficiency=((10, 0.1), (1000, 0.5)),
                         memory_bandwidth_gbs=1000.0, intra_node_busbw_gbs=1.0, inter_node_busbw_gbs=1.0)
    assert hw.matmul_efficiency_at(10) == 0.1 and hw.matmul_efficiency_at(1) == 0.1
    assert hw.matmul_efficiency_at(1000) == 0.5 and hw.matmul_efficiency_at(1e6) == 0.5
    assert hw.matmul_efficiency_at(100) == pytest.approx(0.3)                 # log-linear between points
    assert hw.matmul_seconds(100, 100, 100, "fp32") == pytest.approx(2e6 / (1e12 * 0.3))
    assert hw.matmul_seconds(25, 40, 1000, "fp32") == pytest.approx(2e6 / (1e12 * 0.3))   # read at (m n k)^(1/3)
    slow_memory = dataclasses.replace(hw, memory_bandwidth_gbs=0.001)
    assert slow_memory.matmul_seconds(100, 100, 100, "fp32") == pytest.approx(4 * 3e4 / 1e6)  # bound by traffic
    with pytest.raises(HardwareProfileError, match="no peak for bf16"):
        hw.peak_flops("bf16")
    # the GPU curves' two-number form reproduces XLA's measured H100 bf16 GEMMs (2048^3: 64%, 4096^3: 79%)
    curve = dict(latency_bound_curve(0.80, 989.0, 6.0))
    assert curve[2048] == pytest.approx(0.64, abs=0.02) and curve[4096] == pytest.approx(0.79, abs=0.02)


def test_bus_bandwidth_by_where_the_group_sits():
    a100 = BUILTIN["A100-80GB"]
    assert a100.busbw(8, 1, None) == 230e9                                   # tp=8: one node, NVLink
    assert a100.busbw(4, 8, None) == pytest.approx(23.75e9)                  # one rank per node: one NIC
    assert a100.busbw(32, 1, None) == pytest.approx(8 * 23.75e9)             # 8 ranks per node drive 8 NICs
    cpu = dataclasses.replace(IDEAL, devices_per_node=None)
    assert cpu.busbw(64, 8, None) == 10e9                                    # every rank on one machine
    assert dataclasses.replace(IDEAL, cores=2).compute_slowdown(4) == 2.0 and IDEAL.compute_slowdown(4) == 1.0


def test_collectives_measured_per_group_size():
    """A CPU profile's per-size table: linear between sizes, the first below, ring hops beyond."""
    cpu = dataclasses.replace(IDEAL, devices_per_node=None, collective_ranks=((2, 1000.0, 2.0), (4, 4000.0, 1.0)))
    assert cpu.collective_latency_s(2) == pytest.approx(1e-3) and cpu.collective_latency_s(3) == pytest.approx(2.5e-3)
    assert cpu.collective_latency_s(8) == pytest.approx(4e-3 * 7 / 3) and cpu.busbw(8, 1, None) == pytest.approx(1e9)
    assert cpu.busbw(3, 1, None) == pytest.approx(1.5e9) and IDEAL.collective_latency_s(4) == 0.0
    with pytest.raises(HardwareProfileError, match="collective_ranks"):
        dataclasses.replace(IDEAL, collective_ranks=((4, 1.0, 1.0), (2, 1.0, 1.0)))


def test_scalar_collectives_of_a_step_by_hand():
    """Token count over dp x cp, finiteness and mean loss over the world, the gradient norm over
    tp x pp (the world under ZeRO), each at its group's fixed cost; none on one rank."""
    assert C.step_scalar_collectives(run()) == {}
    assert C.step_scalar_collectives(run(dp=4)) == {"dp": (4, 1), "world": (4, 2)}
    assert C.step_scalar_collectives(run(tp=2, pp=2, global_batch_size=4)) == {"world": (4, 2), "mp": (4, 1)}
    assert C.step_scalar_collectives(run(tp=2, dp=2, zero=1)) == {"dp": (2, 1), "world": (4, 3)}
    cpu = dataclasses.replace(IDEAL, devices_per_node=None, host_synchronous=True,
                              collective_ranks=((2, 1000.0, 2.0), (4, 4000.0, 1.0)))
    assert predict_step_time(tiny(), run(dp=4), cpu).sync == pytest.approx(3 * 4e-3)
    assert predict_step_time(tiny(), run(tp=2, dp=2, zero=1), cpu).sync == pytest.approx(1e-3 + 3 * 4e-3)
    assert predict_step_time(tiny(), run(), cpu).sync == 0.0


def test_compute_by_hand_on_an_ideal_device():
    """GEMM FLOPs only: each block's four linears forward once and backward twice, flash attention's
    two causal (half) products forward once and backward 2.5 times, the output layer 3 times."""
    model, cfg = tiny(), run()
    tokens, h, s, b, d = 32, 64, 16, 2, 16
    linears = 2 * tokens * (3 * h * h + h * h + 4 * h * h + 4 * h * h)
    attention = 2 * (2 * b * 4 * s * (s / 2) * d)
    head = 2 * tokens * model.padded_vocab_size(1) * h
    expected = (4 * (3 * linears + 3.5 * attention) + 3 * head) / 1e12
    parts = predict_step_time(model, cfg, IDEAL)
    assert parts.compute == pytest.approx(expected, rel=1e-6)
    assert parts.tp == parts.pp == parts.dp == parts.bubble == 0.0 and parts.total == pytest.approx(expected, rel=1e-6)
    selective = predict_step_time(model, cfg.replace(recompute="selective"), IDEAL).compute
    assert selective == pytest.approx(expected + 4 * attention / 1e12, rel=1e-6)       # attention forward again
    full = predict_step_time(model, cfg.replace(recompute="full"), IDEAL).compute
    assert full == pytest.approx(expected + 4 * (linears + attention) / 1e12, rel=1e-6)  # every block forward again
    overheads = dataclasses.replace(IDEAL, block_overhead_us=100.0, microbatch_overhead_us=50.0, host_synchronous=True)
    two = run(global_batch_size=4)
    assert predict_step_time(model, two, overheads).compute == pytest.approx(
        predict_step_time(model, two, IDEAL).compute + 2 * (4 * 100e-6 + 50e-6), rel=1e-6)
    assert predict_step_time(model, two, dataclasses.replace(overheads, host_synchronous=False)).compute == \
        pytest.approx(2 * (4 * 100e-6 + 50e-6), rel=1e-6)                            # a GPU: launches overlap


def test_pipeline_bubble_and_a_shared_cpu():
    """pp = 2, m = 4: the last stage (two blocks and the output layer) sets the pace; the bubble is
    (p - 1) / m of the average stage's busy time (the first stage has no output layer)."""
    model, cfg = tiny(), run(pp=2, global_batch_size=8)
    tokens, h, s, b, d = 32, 64, 16, 2, 16
    block = 3 * 2 * tokens * 12 * h * h + 3.5 * 2 * (2 * b * 4 * s * (s / 2) * d)
    head = 3 * 2 * tokens * model.padded_vocab_size(1) * h
    fast_links = dataclasses.replace(IDEAL, intra_node_busbw_gbs=1e12)
    parts = predict_step_time(model, cfg, fast_links)
    assert parts.compute == pytest.approx(4 * (2 * block + head) / 1e12, rel=1e-6)
    assert parts.bubble == pytest.approx(4 * (2 * block + head / 2) / 1e12 / 4, rel=1e-6)
    one = predict_step_time(model, run(), IDEAL)
    two_cores = dataclasses.replace(IDEAL, cores=2, devices_per_node=None)
    assert predict_step_time(model, run(dp=4), two_cores).compute == pytest.approx(2 * one.compute)
    assert predict_step_time(model, run(dp=2), two_cores).compute == pytest.approx(one.compute)
    assert predict_step_time(model, run(dp=4), IDEAL).compute == pytest.approx(one.compute)


def test_exposed_communication_by_hand():
    model = tiny()
    tp = run(tp=2)
    nbytes = C.communication_bytes(model, tp, 0)["tp/all_reduce"]
    assert predict_step_time(model, tp, IDEAL).tp == pytest.approx(nbytes * 1.0 / 10e9)   # bus factor 1 at n = 2
    dp = run(dp=4)
    reduce = C.communication_bytes(model, dp, 0)["dp/all_reduce"] * 1.5 / 10e9
    hidden = predict_step_time(model, dp, IDEAL).dp
    exposed = predict_step_time(model, dp, IDEAL, kernels=Kernels(grad_reduce_overlap=False)).dp
    assert exposed == pytest.approx(reduce) and 0.0 <= hidden < exposed
    zero = run(dp=4, zero=1)
    gather = C.communication_bytes(model, zero, 0)["dp/all_gather"] * 0.75 / 10e9
    assert predict_step_time(model, zero, IDEAL).dp >= gather
    overlapped = predict_step_time(model, zero.replace(overlap_param_gather=True), IDEAL)
    forward = 4 * (2 * 32 * 12 * 64 * 64 + 2 * (2 * 2 * 4 * 16 * 8 * 16)) + 2 * 32 * 128 * 64   # blocks + output layer
    assert predict_step_time(model, zero, IDEAL).dp - overlapped.dp == pytest.approx(forward / 1e12, rel=1e-6)
    cpu = dataclasses.replace(IDEAL, host_synchronous=True, devices_per_node=None)   # gloo's reduction uses the cores
    assert predict_step_time(model, dp, cpu).dp == pytest.approx(reduce)
    across = dataclasses.replace(IDEAL, devices_per_node=2)                 # dp neighbours on other nodes
    assert predict_step_time(model, dp, across, kernels=Kernels(grad_reduce_overlap=False)).dp == pytest.approx(
        C.communication_bytes(model, dp, 0)["dp/all_reduce"] * 1.5 / (2 * 1e9))


def test_ranking_step_time_delegates_to_the_model():
    model = preset("gpt2-350m")
    cfg = RunConfig.build(tp=2, dp=4, precision="bf16", global_batch_size=32, micro_batch_size=2).resolved(8, 50257)
    parts = P.step_time(model, cfg, None, 8, "A100-80GB")
    assert parts == predict_step_time(model, cfg, "A100-80GB", ranks_per_node=8).breakdown()
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    # the H200 profile's measured host time per launch makes this small-microbatch layout host-bound
    # (plan/launches.py; the A100 profile has no such measurement); its device alone is the faster
    device_only = dataclasses.replace(BUILTIN["H200"], launch_host_us=0.0)
    assert P.step_time(model, cfg, None, 8, device_only)["total"] < parts["total"]
    assert MEGALITE == Kernels()


def test_megatron_2021_layout_passes_and_fp32_cross_entropy_by_hand():
    """Megatron-LM 2021's extra memory passes: the QKV bias add and the context copy per block
    (backward 1.5x), and cross entropy over fp32 logits (38 bytes per logit forward, 14 backward)."""
    from megalite.plan.timing import block_pass, head_pass
    model, cfg = tiny(), run(precision="bf16")
    slow_memory = dataclasses.replace(IDEAL, peak_tflops={"bf16": 1.0}, memory_bandwidth_gbs=1.0)   # 1e9 B/s
    tokens, h = 32, 64
    plain, copies = (block_pass(model, cfg, slow_memory, Kernels(layout_copies=c)) for c in (False, True))
    extra = (2 * 2 * tokens * 3 * h + 2 * 2 * tokens * h) / 1e9
    assert copies.forward - plain.forward == pytest.approx(extra)
    assert copies.backward - plain.backward == pytest.approx(1.5 * extra)
    head16, head32 = (head_pass(model, cfg, slow_memory, Kernels(fp32_cross_entropy=c)) for c in (False, True))
    logits = tokens * model.padded_vocab_size(1)
    assert head32.forward - head16.forward == pytest.approx((38 - 4) * logits / 1e9)
    assert head32.backward - head16.backward == pytest.approx((14 - 4) * logits / 1e9)


def test_zero3_and_powersgd_dp_time_by_hand():
    """ZeRO-3: the step's gathers and reduce-scatters hide behind compute, except the gather of each
    forward's and backward's first unit. PowerSGD: its compressed all-reduces (P, then Q) and its
    arithmetic follow the whole backward, so nothing hides them."""
    from megalite.plan import compression as Z
    from megalite.plan.zero3 import stage_units
    model = tiny()
    zero3 = run(dp=4, zero=3, global_batch_size=16)                  # m = 2 microbatches
    sent = C.communication_bytes(model, zero3, 0)
    moved = (sent["dp/all_gather"] + sent["dp/reduce_scatter"]) * 0.75 / 10e9
    first = 2 * 2 * max(stage_units(model, zero3, 0)) * 4 * 0.75 / 10e9
    fast = dataclasses.replace(IDEAL, peak_tflops={"fp32": 1e9})       # nothing to hide behind
    assert predict_step_time(model, zero3, fast).dp == pytest.approx(moved + first, rel=1e-3)
    slow = dataclasses.replace(IDEAL, peak_tflops={"fp32": 1e-3})      # compute hides all but the first units
    assert predict_step_time(model, zero3, slow).dp == pytest.approx(first)
    compressed = run(dp=4, grad_compression="powersgd", powersgd_rank=2)
    reduce = C.communication_bytes(model, compressed, 0)["dp/all_reduce"] * 1.5 / 10e9
    assert reduce < C.communication_bytes(model, run(dp=4), 0)["dp/all_reduce"] * 1.5 / 10e9
    flops = 0
    for shape in Z.stage_param_shapes(model, compressed, 0):
        if Z.compresses(shape, 2, compressed.parallel.powersgd_min_compression):
            n, m = Z.matrix_view(shape)
            flops += 3 * 2 * n * m * Z.effective_rank(n, m, 2)             # M Q, M^T P, P Q^T
    assert flops > 0
    assert predict_step_time(model, compressed, slow).dp == pytest.approx(reduce + flops / 1e9)


def test_reentrant_recompute_runs_the_mlp_reduction_again():
    """Full recompute under Megatron-LM's reentrant checkpoint re-runs each block's whole forward: 6
    tensor-parallel all-reduces per block per microbatch (megalite's non-reentrant one stops after
    the last saved tensor: 5); under sequence parallelism one more reduce-scatter likewise."""
    model = tiny()
    u = 4 * 16 * 2 * 64                                               # one [s, b, h] fp32 activation
    for sp, op in ((False, "tp/all_reduce"), (True, "tp/reduce_scatter")):
        cfg = run(tp=2, recompute="full", sequence_parallel=sp)
        plain, whole = (C.communication_bytes(model, cfg, 0, rerun)[op] for rerun in (False, True))
        assert whole - plain == 4 * u                                  # 4 blocks, 1 microbatch
        seconds = predict_step_time(model, cfg, IDEAL, kernels=Kernels(reentrant_recompute=True)).tp
        factor = C.bus_factor(op.split("/")[1], 2)
        assert seconds - predict_step_time(model, cfg, IDEAL).tp == pytest.approx(4 * u * factor / 10e9)
    cfg = run(tp=2)
    assert cfg.parallel.recompute == "none"
    assert C.communication_bytes(model, cfg, 0, True) == C.communication_bytes(model, cfg, 0)  # no recompute: none
