"""tools/bench_loss_head.py runs both variants in their own processes and they agree on the loss."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_loss_head.py"


@pytest.mark.slow  # 6 s: the benchmark's whole run
def test_fused_and_unfused_heads_report_the_same_loss():
    result = subprocess.run([sys.executable, str(TOOL), "--tokens", "64", "--hidden", "16", "--vocab", "300",
                             "--steps", "1", "--chunk-tokens", "10"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    sums = dict(re.findall(r"^\s+(fused|unfused)\s.*loss sum (\S+)$", result.stdout, re.M))
    assert set(sums) == {"fused", "unfused"}, result.stdout
    assert abs(float(sums["fused"]) - float(sums["unfused"])) <= 1e-5 * abs(float(sums["unfused"])), result.stdout
    assert "fused / unfused: time" in result.stdout
