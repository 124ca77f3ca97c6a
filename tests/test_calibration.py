"""megalite/calibration.py: the measurements behind `tools/plan.py --calibrate`, at tiny sizes."""
import pytest
import torch

from megalite import calibration as CAL
from megalite.plan.hardware import HardwareProfile

CPU = torch.device("cpu")


def test_fit_recovers_latency_and_bus_bandwidth():
    latency, busbw, ranks = 50e-6, 2e9, 4
    times = {n: latency + n * 2 * (ranks - 1) / ranks / busbw for n in (4096, 65536, 1 << 20, 4 << 20)}
    fitted_latency, fitted_busbw = CAL.fit_latency_and_busbw(times, ranks)
    assert fitted_latency == pytest.approx(latency) and fitted_busbw == pytest.approx(busbw)


def test_measurements_at_tiny_sizes():
    gemms = CAL.measure_gemms(CPU, "fp32", (8, 32))
    assert set(gemms) == {8, 32} and all(v > 0 for v in gemms.values())
    assert CAL.measure_copy_gbs(CPU, nbytes=64 << 10) > 0 and CAL.measure_elementwise_gbs(CPU, nbytes=64 << 10) > 0
    assert 0 < CAL.measure_attention_efficiency(CPU, "fp32", peak_tflops=1.0) < 1
    # every rank must run the same number of all-reduces (a count chosen per rank would deadlock)
    times = CAL.measure_allreduce(2, CPU, (4096, 65536), repeats=1)
    assert set(times) == {4096, 65536} and all(t > 0 for t in times.values())
    slowdown = CAL.measure_rank_slowdown((1, 2), n=32, seconds=0.01)
    assert slowdown[1] == 1.0 and slowdown[2] > 0
    host = CAL.measure_host_overheads(min_seconds=0.001, repeats=1)
    assert host["block"] > 0 and host["microbatch"] >= 0 and host["step"] > 0


def test_a_profile_from_measurements_reads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(CAL, "measure_gemms", lambda device, precision, sizes, **_: {n: 0.01 * (i + 1) for i, n in
                                                                                enumerate(sizes)})
    monkeypatch.setattr(CAL, "measure_copy_gbs", lambda device: 12.5)
    monkeypatch.setattr(CAL, "measure_elementwise_gbs", lambda device: 2.5)
    monkeypatch.setattr(CAL, "measure_attention_efficiency", lambda device, precision, peak: 0.25)
    monkeypatch.setattr(CAL, "measure_allreduce", lambda ranks, device, sizes: {n: 1e-4 * (ranks - 1) + n / 1e9
                                                                                for n in sizes})
    monkeypatch.setattr(CAL, "measure_host_overheads", lambda: {"block": 1e-3, "microbatch": 2e-3, "step": 3e-3})
    monkeypatch.setattr(CAL, "measure_rank_slowdown", lambda counts: {1: 1.0, 2: 1.1, 4: 2.3})
    profile = CAL.calibrate(name="fake", precisions=("fp32",), quick=True, log=lambda line: None)
    assert profile.peak_tflops == {"fp32": 0.06} and profile.matmul_efficiency[-1] == (512.0, 1.0)
    assert profile.memory_bandwidth_gbs == 12.5 and profile.block_overhead_us == pytest.approx(1000.0)
    assert profile.elementwise_gbs == 2.5 and profile.attention_efficiency == 0.25
    assert profile.collective_latency_us == pytest.approx(100.0) and profile.host_synchronous
    assert profile.intra_node_busbw_gbs == pytest.approx(1.0) and profile.devices_per_node is None
    (two, lat2, bw2), (four, lat4, bw4) = profile.collective_ranks   # busbw = bus factor 2(n-1)/n x 1 GB/s
    assert (two, four) == (2, 4) and lat2 == pytest.approx(100.0) and lat4 == pytest.approx(300.0)
    assert bw2 == pytest.approx(1.0) and bw4 == pytest.approx(1.5)
    assert profile.collective_latency_s(4) == pytest.approx(3e-4) and profile.busbw(4, 1, None) == pytest.approx(1.5e9)
    assert profile.compute_slowdown(4) == 2.3 and profile.compute_slowdown(3) == pytest.approx(1.7)
    assert profile.compute_slowdown(8) == pytest.approx(4.6)               # proportional beyond the last point
    path = tmp_path / "p.json"
    profile.save(path)
    assert HardwareProfile.from_dict(__import__("json").loads(path.read_text())) == profile
