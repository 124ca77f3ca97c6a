"""A layout the torchrun world does not match: the one line reaches the user every time (issue 40).

A rank that printed nothing used to exit at once; torchrun then stopped the others, and could kill
rank 0 before it printed. Here rank 0 is made slow to print (3 s, deterministically), so on the old
code torchrun kills it first and the line is lost; now the silent rank waits for it."""
import subprocess
import sys
from pathlib import Path

import pytest

SLOW_RANK_0 = """
import os, sys, time
from megalite.training import loop
report = loop.report_usage_error
def slow(exc, rank):
    if rank == 0:
        time.sleep(3)
    return report(exc, rank)
loop.report_usage_error = slow
sys.exit(loop.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_mismatch_line_reaches_the_user_when_rank_0_is_slow(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SLOW_RANK_0)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--monitor-interval", "0.1", str(script), "--tp", "3"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode != 0
    assert "megalite: configuration error:" in done.stderr and "world size 2 != tp*pp*dp = 3*1*1 = 3" in done.stderr, \
        done.stderr[-3000:]
