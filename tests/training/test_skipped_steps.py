"""A run that trains nothing does not end as if it had (issue 49): loss scales are bounded by what the
loss's dtype (float32) holds, and --max-skipped-steps updates skipped in a row stop the run in one line."""
import contextlib
import io

import pytest

from megalite.distributed import mesh
from megalite.cli import parse_args
from megalite.errors import ConfigError
from megalite.optim import DynamicLossScaler
from megalite.training import loop
from megalite.training.guards import NONFINITE_EXIT_CODE, NonFiniteError, NonFiniteGuard
from megalite.training.step_result import StepResult

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0", "--log-interval", "1"]


def _result(skipped: bool, loss: float = 2.0, scale: float = 1024.0) -> StepResult:
    return StepResult(loss=loss, grad_norm=float("inf") if skipped else 1.0, skipped=skipped, loss_scale=scale,
                      tokens=0, loss_finite=True, lr=0.0, exposed_dp_comm_s=0.0, exposed_grad_reduce_s=0.0,
                      exposed_param_gather_s=0.0, exposed_token_count_s=0.0)


@pytest.mark.parametrize("value", ["1e300", "1e39", "inf", "nan"])
def test_a_loss_scale_float32_cannot_hold_is_refused(value):
    with pytest.raises(ConfigError, match=r"--initial-loss-scale must be a finite number > 0 and <= "
                                          r"3.4028234663852886e\+38"):
        parse_args(["--fp16", "--initial-loss-scale", value])
    assert parse_args(["--fp16", "--initial-loss-scale", str(2.0 ** 32)])[0].precision.initial_loss_scale == 2.0 ** 32
    with pytest.raises(ValueError, match="float32's largest"):
        DynamicLossScaler(initial_scale=float(value))


def test_skipped_updates_in_a_row_stop_the_run_and_a_clean_step_resets_the_count():
    guard = NonFiniteGuard(mesh.single_process_mesh("cpu"), "skip", loss_scaling=True, log=lambda s: None,
                           max_skipped=3)
    for step in (1, 2):
        assert guard.check(step, _result(True), [[0]]) is None  # fp16 overflows: routine, not yet a stop
    assert guard.check(3, _result(False), [[0]]) is None
    guard.check(4, _result(True), [[0]])
    guard.check(5, _result(True), [[0]])
    with pytest.raises(NonFiniteError) as caught:
        guard.check(6, _result(True, scale=0.5), [[0]])
    message = str(caught.value)
    assert message.startswith("steps 4..6: 3 updates in a row skipped (nothing trained)") and "\n" not in message
    assert "loss scale down to 0.5" in message and "--max-skipped-steps 3" in message
    unlimited = NonFiniteGuard(None, "skip", loss_scaling=True, max_skipped=0)
    for step in range(1, 200):
        unlimited.check(step, _result(True), [[0]])


@pytest.mark.slow  # a 4-step training run in this process (~4 s with its imports)
def test_a_run_whose_every_step_overflows_exits_3_in_one_line():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = loop.main(SMALL + ["--fp16", "--initial-loss-scale", "1e38", "--train-iters", "20",
                                  "--max-skipped-steps", "4"])
    assert code == NONFINITE_EXIT_CODE, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "steps 1..4: 4 updates in a row skipped" in lines[0], lines
    assert parse_args([])[0].fault_tolerance.max_skipped_steps == 50  # on by default
