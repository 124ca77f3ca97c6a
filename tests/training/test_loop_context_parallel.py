"""Context parallelism through the training loop's main (what examples/pretrain_gpt.py runs).

A run at cp 2 saves layout-free checkpoints; resumed at cp 1 and at cp 4 from its step-2
checkpoint, steps 3 and 4 give the uninterrupted run's losses. The metrics file reports cp and
the cp group's bytes per step, which equal the planner's formula. A bad --cp, sequence length
or head count stops every rank with exit code 2 before any process group, the fix named once.
"""
import contextlib
import io
import json

from megalite.cli import parse_args
from megalite.plan import communication as C
from megalite.testing import run_distributed
from megalite.training.loop import main

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0",
         "--lr-warmup-iters", "1"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def test_save_at_cp2_resume_at_cp1_and_cp4_continues_the_losses(tmp_path):
    saved = tmp_path / "ckpt"
    first = MODEL + ["--cp", "2", "--save", str(saved), "--save-interval", "2", "--metrics-file", str(tmp_path / "a.jsonl")]
    assert run_distributed(main, 2, first, timeout_s=120) == [0, 0]
    uninterrupted = _records(tmp_path / "a.jsonl")
    assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4]
    cfg = parse_args(first)[0].resolved(2, 257)
    ring_bytes = sum(C.context_parallel_bytes(cfg.gpt_config(), cfg, 0).values())
    for r in uninterrupted:  # this rank's send + recv on the cp ring, as planned
        assert (r["cp"], r["cp_comm_type"], r["cp_comm_bytes"]) == (2, "p2p", ring_bytes)

    for cp in (1, 4):
        metrics = tmp_path / f"resumed_cp{cp}.jsonl"
        argv = MODEL + ["--cp", str(cp), "--load", str(saved), "--load-step", "2", "--metrics-file", str(metrics)]
        assert run_distributed(main, cp, argv, timeout_s=120) == [0] * cp
        resumed = _records(metrics)
        assert [r["step"] for r in resumed] == [3, 4] and all(r["cp"] == cp for r in resumed)
        for got, want in zip(resumed, uninterrupted[2:]):
            assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (cp, got["loss"], want["loss"])
            assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"], cp


def _main_capturing(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


BAD = [  # on 4 ranks
    (["--cp", "3"], "world size 4 != tp*cp*pp*dp = 1*3*1*1 = 3"),
    (["--cp", "2", "--seq-length", "30"], "seq_length=30 is not divisible by 2*cp = 4"),
    (["--cp", "4", "--cp-comm-type", "a2a", "--model", "tiny-llama"],
     "num_query_groups/tp = 2/1 = 2 is not divisible by cp=4; choose cp in [1, 2]"),
    (["--cp", "2", "--attention-dropout", "0.1"], "not supported by ring attention"),
    (["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-length", "12"],
     "each cp rank's 6 tokens (seq_length/cp) are not divisible by tp=4"),
]


def _every_bad_configuration():
    return [_main_capturing(argv) for argv, _ in BAD]


def test_bad_context_parallel_configuration_exits_2_on_every_rank():
    per_rank = run_distributed(_every_bad_configuration, 4, timeout_s=60)
    for rank, results in enumerate(per_rank):
        for (code, err), (argv, needle) in zip(results, BAD):
            assert code == 2 and "Traceback" not in err, argv
            if rank == 0:  # the fix named once per node (local rank 0)
                assert needle in err, (argv, err)
            else:
                assert err == "", (argv, err)


def test_dry_run_plans_the_cp_traffic(capsys):
    assert main(["--cp", "2", "--dp", "2", "--dry-run"] + MODEL) == 0
    out = capsys.readouterr().out
    assert "comm cp/send" in out and "comm dp_cp/all_reduce" in out, out
