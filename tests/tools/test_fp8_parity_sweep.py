"""tools/fp8_parity_sweep.py runs (one seed, one step at tp 2) and reports its line."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_sweep_reports_each_seed(capsys):
    spec = importlib.util.spec_from_file_location("fp8_parity_sweep", ROOT / "tools" / "fp8_parity_sweep.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--layout", "tp", "--seeds", "1", "--steps", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("tp tensorwise pow2: largest relative loss difference per seed ") and "of 1 above 1e-5" in line
