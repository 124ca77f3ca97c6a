"""Changing the optimizer on resume (AdamW's moments are not Muon's momentum) is refused in one line unless
the state is left behind (--no-load-optim) or the change accepted (--override-opt-param-scheduler)."""

import pytest

from ckpt_helpers import SMALL_RUN, run_in_process

SMALL, _main = SMALL_RUN, run_in_process


@pytest.mark.slow
def test_resuming_a_muon_run_with_adamw_is_refused_unless_overridden(tmp_path):
    run = SMALL + ["--save", str(tmp_path), "--load", str(tmp_path), "--train-iters", "2"]
    assert _main(run + ["--optimizer", "muon"])[0] == 0
    code, _, err = _main(run + ["--optimizer", "adamw", "--train-iters", "3"])
    assert code == 2 and "Traceback" not in err, err
    assert "--optimizer muon -> adamw changes the optimizer its saved state belongs to" in err, err
    # weights only: the run starts at step 0 and writes over step 2, which it must be told it may
    code, out, err = _main(run + ["--optimizer", "adamw", "--train-iters", "3", "--no-load-optim",
                                  "--overwrite-checkpoints"])
    assert code == 0 and "step 3/3" in out, err
