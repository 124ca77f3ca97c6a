"""tools/tune_norms.py on CPU (interpreter, wall clock): every candidate is checked against the
default config's results before it is timed, and one that computes something else is WRONG."""
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from megalite.kernels import HAVE_TRITON
from megalite.kernels.dispatch import interpreter_ready

TOOL = Path(__file__).resolve().parents[2] / "tools" / "tune_norms.py"
pytestmark = [pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"),
              pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")]


def _load_tool(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")  # main() sets it; monkeypatch restores it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("tune_norms", TOOL)
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tune_norms", tool)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_sweep_times_candidates_marks_a_wrong_one_and_prints_paste_lines(monkeypatch, capsys, tmp_path):
    tool = _load_tool(monkeypatch)
    monkeypatch.setattr(tool, "SMOKE_NORM_SHAPES", [(12, 40)])
    monkeypatch.setattr(tool, "SMOKE_ROPE_SHAPE", (3, 2, 2, 8))
    monkeypatch.setattr(tool, "FORWARD_CANDIDATES", {"narrow": [(4, 1)]})
    monkeypatch.setattr(tool, "BACKWARD_CANDIDATES", {"narrow": [(4, 1, 1), (2, 1, 1)]})
    monkeypatch.setattr(tool, "ROPE_WARPS", [2])
    # a launch that leaves rows undone: with 2 rows per tile, the last program is never started
    rms_norm_module = importlib.import_module("megalite.kernels.rms_norm")
    honest = rms_norm_module.backward_programs

    def drops_last_program(config, n_rows, device):
        programs, rows_per_program = honest(config, n_rows, device)
        return (programs - 1 if config.rows == 2 else programs), rows_per_program
    monkeypatch.setattr(rms_norm_module, "backward_programs", drops_last_program)
    monkeypatch.setenv("MEGALITE_KERNEL_POISON", "1")  # undone rows stay NaN

    tables = tmp_path / "norms.json"
    assert tool.main(["--smoke", "--kernels", "rms_norm", "rope", "--json", str(tables)]) == 1  # WRONG fails the run
    out = capsys.readouterr().out
    rows = re.findall(r"^  ((?:NormConfig\(.*?\))|num_warps=\d+)\s+(\S+) ms\s+(\S+) GB/s\s+(\S+)% of copy *(.*)$", out,
                      re.MULTILINE)
    assert len(rows) == 2 + 3 + 2 + 2, out  # rms fwd: default + 1; rms bwd: default + 2; rope fwd, fwd+bwd: 2 each
    verdicts = {(name, rest.startswith("WRONG")) for name, _, _, _, rest in rows}
    assert ("NormConfig(rows=2, num_warps=1, programs_per_sm=1)", True) in verdicts, out
    assert sum(wrong for _, wrong in verdicts) == 1, out
    timed = [float(ms) for name, ms, _, _, rest in rows if not rest.startswith("WRONG")]
    assert len(timed) == 8 and all(ms > 0 for ms in timed), out
    assert re.search(r"kernels/rms_norm.py: BACKWARD_CONFIGS: dict\[int, NormConfig\] = \{64: NormConfig\(", out), out
    assert re.search(r"kernels/rope.py: NUM_WARPS: dict\[tuple\[int, int\], int\] = \{\(2, 4\): [24]\}", out), out
    assert "ceiling: copy" in out and "<- best" in out

    # the JSON the run wrote puts the same tables in effect (tools/bench_kernels.py --tables)
    rope_module = importlib.import_module("megalite.kernels.rope")
    monkeypatch.setattr(rms_norm_module, "BACKWARD_CONFIGS", {})
    monkeypatch.setattr(rope_module, "NUM_WARPS", {})
    tool.load_tables(str(tables))
    assert set(rms_norm_module.BACKWARD_CONFIGS) == {64} and set(rope_module.NUM_WARPS) == {(2, 4)}
    assert isinstance(rms_norm_module.BACKWARD_CONFIGS[64], tool.NormConfig)
    assert rms_norm_module.BACKWARD_CONFIGS[64].rows != 2  # the WRONG candidate is never written
