"""tools/cp_balance.py runs: per cp, sample 0's shares under both splits, then the mean and worst
step cost over the samples (the per-document split exactly even without a window)."""
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import cp_balance  # noqa: E402


def test_the_balance_tool_prints_both_splits():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cp_balance.main(["--seq", "256", "--mean", "16", "--cp", "2", "4", "--samples", "3"]) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("cp 2: sample 0") and lines[5].startswith("cp 4:"), lines
    assert "per-document over 3 samples: busiest x cp mean 1.000, worst 1.000" in " ".join(lines[4].split())
    assert "(busiest x cp = 1.000)" in lines[7] and "(busiest x cp = 1.000)" not in lines[6], lines
