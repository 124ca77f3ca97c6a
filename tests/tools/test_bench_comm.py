"""tools/bench_comm.py: nccl-tests bandwidth conventions, and a real run on forked gloo ranks."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from megalite.testing import run_distributed

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_comm.py"
_spec = importlib.util.spec_from_file_location("bench_comm", _PATH)
bench_comm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_comm)


def test_bus_bandwidth_factors_follow_nccl_tests():
    size, seconds = 8_000_000, 0.002
    for n in (2, 4, 8):
        algbw, busbw = bench_comm.bandwidths("all_reduce", size, seconds, n)
        assert algbw == size / seconds
        assert busbw == pytest.approx(algbw * 2 * (n - 1) / n)
        for op in ("all_gather", "reduce_scatter", "all_to_all"):
            assert bench_comm.bandwidths(op, size, seconds, n)[1] == pytest.approx(algbw * (n - 1) / n)
        assert bench_comm.bandwidths("send_recv", size, seconds, n)[1] == algbw
    # 8 ranks: ring all-reduce moves 2*7/8 of the buffer over the busiest link
    assert bench_comm.bandwidths("all_reduce", 1, 1.0, 8)[1] == pytest.approx(1.75)


def test_sizes_and_sweep():
    assert [bench_comm.parse_size(s) for s in ("64", "4K", "64M", "1G")] == [64, 4096, 64 << 20, 1 << 30]
    assert bench_comm.size_sweep(1024, 16384, 4) == [1024, 4096, 16384]
    with pytest.raises(ValueError, match="--factor >= 2"):
        bench_comm.size_sweep(1024, 4096, 1)


def _bench_rank():
    from megalite.distributed import comm

    result = bench_comm.benchmark(list(bench_comm.OPS), [4096], group_name="tp", tp=2, iters=2, warmup=1)
    ledger = {f"{g}/{op}": n for (g, op), n in comm.ledger.bytes.items() if g == "tp"}
    return result, ledger


def test_benchmark_runs_every_op_through_megalite_comm():
    result, ledger = run_distributed(_bench_rank, 4)[0]
    assert result["group_ranks"] == [0, 1] and result["backend"] == "gloo"
    assert [r["op"] for r in result["rows"]] == list(bench_comm.OPS)
    for row in result["rows"]:
        assert row["size_bytes"] == 4096
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        assert row["algbw_gbps"] == pytest.approx(algbw)
        factor = {"all_reduce": 1.0, "send_recv": 1.0}.get(row["op"], 0.5)  # n = 2
        assert row["busbw_gbps"] == pytest.approx(algbw * factor)
    # the ledger counts the same sizes (3 calls each: warmup + iters), so both conventions agree
    for op in ("all_gather", "reduce_scatter", "all_to_all", "send", "recv"):
        assert ledger[f"tp/{op}"] == 3 * 4096, op
    assert ledger["tp/all_reduce"] == 3 * 4096 + 8 * len(bench_comm.OPS)  # + one float64 max of the timings per op


@pytest.mark.parametrize("argv,needle", [
    (["--world-size", "3", "--tp", "2"], "--world-size 3 is not a multiple of tp*pp = 2"),
    (["--tp", "0"], "--tp 0: must be >= 1"),
    (["--min-bytes", "1M", "--max-bytes", "4K"], "need 1 <= --min-bytes <= --max-bytes"),
    (["--min-bytes", "lots"], "cannot read a size from 'lots'"),
])
def test_bad_arguments_are_one_line_before_any_rank_starts(argv, needle, capsys):
    try:
        code = bench_comm.main(argv)
    except SystemExit as exc:  # argparse's own mistakes
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
