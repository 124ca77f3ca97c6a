"""tools/bench_train.py runs on CPU for both flavours, with the compiled baseline (dynamo's eager backend:
no C++ toolchain needed), and prints its GOAL line. It times nothing that a test could assert."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_llama_with_the_compiled_baseline_prints_its_goal():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_train.py"), "--model", "tiny-llama",
                             "--seq-length", "32", "--micro-batch-size", "2", "--steps", "1", "--trials", "1",
                             "--compile-baseline", "--compile-backend", "eager", "--goal", "1.25"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model: llama flavour, 4 layers" in result.stdout
    goal = [line for line in result.stdout.splitlines() if line.startswith("GOAL bench_train tiny-llama 2x32")]
    assert len(goal) == 1 and "HF + torch.compile(eager) >= 1.25x | measured" in goal[0], result.stdout
