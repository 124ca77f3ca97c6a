"""megalite.progress: a bar with rate and ETA on a terminal, quiet whole lines in a log; and the
checkpoint conversion's reading loops drawing it (tools/convert_checkpoint.py)."""
import io
import sys

import pytest

from megalite.progress import ProgressBar, clock


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_whole_quiet_lines_and_a_terminal_the_redrawn_bar():
    log = io.StringIO()
    bar = ProgressBar(total=4_000_000, stream=log)  # not a tty: a line every 10 s, so none here...
    bar.update(1_000_000, 10)
    bar.update(3_000_000, 30, final=True)  # ...but the last
    assert log.getvalue().count("\n") == 1 and "\r" not in log.getvalue() and "#" * 30 in log.getvalue()

    terminal = FakeTerminal()
    bar = ProgressBar(total=4_000_000, stream=terminal, count_name="tensors", label="reading")
    bar.interval = 0.0  # (redrawn 4 times a second: every update here)
    bar.update(1_000_000, 1)
    bar.update(3_000_000, 3, final=True)
    first, last = terminal.getvalue().split("\r")[1:]
    assert first.startswith("reading: [" + "#" * 7 + "." * 23 + "]  25.0%") and " eta " in first
    assert "MB/s" in first and not first.endswith("\n")  # the same line, overwritten
    assert last.startswith("reading: [" + "#" * 30 + "] 100.0%") and "4 tensors" in last and "eta" not in last
    assert last.endswith("\n")


def test_an_unknown_total_draws_no_bar_and_the_clock_reads_naturally():
    log = io.StringIO()
    ProgressBar(None, stream=log).update(2_000_000, 5, final=True)
    assert "[" not in log.getvalue() and "2.0 MB" in log.getvalue() and "5 docs" in log.getvalue()
    assert (clock(187), clock(7500)) == ("3m07s", "2h05m")


def test_conversion_reads_with_a_bar_on_a_terminal(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    sys.path.insert(0, "tests/checkpoint")
    from ckpt_helpers import full_params, load_convert_tool
    from megalite.checkpoint import write_full_state
    from megalite.config import RunConfig
    from megalite.config.model import GPTConfig
    from megalite.distributed.mesh import single_process_mesh
    from megalite.training.step import build_model_chunks

    convert = load_convert_tool()
    config = GPTConfig("gpt2", num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8)
    chunks = build_model_chunks(config, RunConfig.build(micro_batch_size=1), single_process_mesh("cpu"))
    write_full_state(tmp_path / "ckpt", config, full_params(chunks))
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "back")]) == 0
    assert convert.main(["--to", "safetensors", "--load", str(tmp_path / "ckpt"), "--output",
                         str(tmp_path / "w.safetensors")]) == 0  # torch's formats read the same way
    lines = [line for line in terminal.getvalue().split("\r") if "100.0%" in line]
    tensors = f"{len(full_params(chunks))} tensors"
    assert len(lines) == 3 and tensors in lines[0] and "1 files" in lines[1] and tensors in lines[2]
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf2")]) == 0
    assert "\r" not in log.getvalue() and log.getvalue().count("100.0%") == 1  # a log: the one final line
    log.truncate(0)
    assert convert.main(["export", "--no-progress", "--load", str(tmp_path / "ckpt"), "--output",
                         str(tmp_path / "hf3")]) == 0
    assert log.getvalue() == ""
