"""tools/cp_balance.py runs: per cp, sample 0's shares under both splits, then the mean and worst
step cost over the samples (the per-document split exactly even without a window on lengths padded
to multiples of 2cp, and more even than zigzag on the unpadded ones the training path splits)."""
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import cp_balance  # noqa: E402


def _run(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cp_balance.main(["--seq", "256", "--mean", "16", "--cp", "2", "4", "--samples", "3", *extra]) == 0
    return out.getvalue().splitlines()


def _mean_and_worst(line: str) -> tuple[float, float]:
    words = line.replace(",", "").split()
    return float(words[words.index("mean") + 1]), float(words[words.index("worst") + 1])


def test_the_balance_tool_prints_both_splits():
    lines = _run("--pad")
    assert len(lines) == 10 and lines[0].startswith("cp 2: sample 0") and lines[5].startswith("cp 4:"), lines
    assert "per-document over 3 samples: busiest x cp mean 1.000, worst 1.000" in " ".join(lines[4].split())
    assert "(busiest x cp = 1.000)" in lines[7] and "(busiest x cp = 1.000)" not in lines[6], lines


def test_unpadded_lengths_split_more_evenly_than_zigzag():
    lines = _run()
    assert len(lines) == 10 and "after padding" not in lines[0], lines
    for zigzag, split in ((lines[3], lines[4]), (lines[8], lines[9])):
        assert _mean_and_worst(split)[1] < _mean_and_worst(zigzag)[1], (zigzag, split)
