"""The training log's goodput so far (megalite/training/goodput.py): productive step time over wall time
across restarts, each lost interval named by cause; the ledger a restarted run reads from --save."""
import json

import pytest

from megalite.testing import RankFailed, run_distributed
from megalite.training.goodput import GoodputLedger
from megalite.training.loop import main


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_a_restart_names_restart_reload_replay_and_save(tmp_path):
    clock = Clock()
    first = GoodputLedger(str(tmp_path), write=True, clock=clock)
    for step in range(1, 7):  # 6 steps of 2 s; a 1 s save after step 4
        clock.t += 2
        first.step_done(step, 2.0)
        if step == 4:
            clock.t += 1
            first.add_lost("save", 1.0)
        first.persist()
    assert first.fields()["goodput"] == 12 / 13
    clock.t += 50  # the run dies after step 6; 50 s until the new run's ledger starts
    second = GoodputLedger(str(tmp_path), write=True, clock=clock)
    clock.t += 3
    second.add_lost("reload", 3.0)
    second.resumed_at(4)  # the checkpoint of step 4: steps 5 and 6 are trained again
    fields = second.fields()
    assert fields["lost_restart_s"] == 50 and fields["lost_reload_s"] == 3 and fields["lost_replay_s"] == 4
    assert fields["lost_save_s"] == 1 and fields["goodput_wall_s"] == 13 + 50 + 3
    assert fields["goodput"] == 8 / 66
    assert "goodput 12.1% (lost: restart 50 s, reload 3 s, replay 4 s, save 1 s)" in second.describe()


def _run(argv):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.mark.slow
def test_the_training_log_reports_goodput_and_a_restart_continues_the_ledger(tmp_path):
    """Run 1 saves at step 2 and dies at the start of step 4 (MEGALITE_FAULT_AT_STEP); run 2 loads step 2,
    trains step 3 again (replay) and step 4: the ledger names the restart, the reload and the replay."""
    argv = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
            "--eval-iters", "0", "--log-interval", "1", "--save", str(tmp_path), "--save-interval", "2",
            "--train-iters", "4"]
    with pytest.raises(RankFailed):
        run_distributed(_run, 1, argv, timeout_s=120, env={"MEGALITE_FAULT_AT_STEP": "4"})
    ledger = json.loads((tmp_path / "goodput.json").read_text())
    assert ledger["steps"] == 3 and ledger["last_step"] == 3 and ledger["lost_s"]["save"] > 0
    code, out = run_distributed(_run, 1, argv + ["--load", str(tmp_path)], timeout_s=120,
                                env={"TORCHELASTIC_RESTART_COUNT": "1"})[0]
    ledger = json.loads((tmp_path / "goodput.json").read_text())
    # the console names the lost causes only past a share of the wall time, which depends on the machine's
    # speed; the ledger below holds them whatever it is
    assert code == 0 and "| goodput " in out, out
    lost = ledger["lost_s"]
    assert ledger["steps"] == 4 and lost["restart"] > 0 and lost["reload"] > 0 and lost["replay"] > 0
