"""tools/bench_ring_documents.py runs: two forked cp ranks print their times and the ring's blocks
computed of the causal ones (fewer with short documents than the 2 cp - 1 + 2 of plain causal)."""
import contextlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_ring_documents  # noqa: E402


@pytest.mark.slow  # a benchmark's smoke run; the ring's parity with documents is tests/context_parallel's
def test_the_ring_benchmark_prints_each_rank():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_ring_documents.main(["--seq", "64", "--mean", "4", "--heads", "2", "--head-dim", "8",
                                          "--repeats", "1"]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("fp32, cp 2 (gloo, CPU)") and len(lines) == 3, lines
    for rank, line in enumerate(lines[1:]):
        assert line.strip().startswith(f"cp rank {rank}: documents") and "of 5" in line, line
        assert "blocks computed 5 of 5" not in line, line  # documents of ~4 tokens in chunks of 16
