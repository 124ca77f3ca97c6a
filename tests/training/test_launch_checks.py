"""What a run checks where it starts (megalite.training.launch_checks and the loop's configure):
a user's mistake ends in one line and exit 2 before any process group exists, and the layout
is checked against the memory of the device it would run on. Whatever would launch runs on a
forked rank (run_distributed), so the memory query never initialises CUDA in the test process."""
import sys

import pytest

from megalite.config import RunConfig
from megalite.errors import ConfigError
from megalite.plan import estimate
from megalite.testing import run_distributed
from megalite.training.launch_checks import memory_per_rank
from megalite.training.loop import configure, main


def _main_err(argv):
    """(exit code, stderr) of the training program, on a forked rank."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _launch(argv) -> tuple[int, str]:
    return run_distributed(_main_err, 1, argv, timeout_s=120)[0]


def test_a_model_larger_than_this_machine_is_refused_before_allocating(capsys):
    code, err = _launch(["--hidden-size", "65536", "--train-iters", "1"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not fit" in err and ("this machine's RAM" in err or "GPU 0's memory" in err), err
    assert "tools/plan.py --suggest" in err, err
    # a dry run plans the layout the flags name, for the machine it will run on: no memory check here
    assert main(["--hidden-size", "65536", "--dry-run"]) == 0, capsys.readouterr().err


def test_the_memory_check_names_the_settings_that_fit():
    cfg = RunConfig.build(model="gpt2-124m", dp=8, micro_batch_size=4, seq_length=256)
    resolved = cfg.resolved(8, 257)
    need = estimate(resolved.gpt_config(), resolved).total_bytes
    with pytest.raises(ConfigError) as error:  # 8 ranks of a node whose memory holds 80% of the estimate
        configure(cfg, 8, 257, memory=(need * 0.8, "test memory"))
    assert "(test memory)" in str(error.value) and "add --zero" in str(error.value), error.value
    assert configure(cfg, 8, 257, memory=(need * 2, "test memory")).dp == 8  # enough memory: it starts


def _memory_alone_and_shared_by_4():
    import os

    whole = memory_per_rank()
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    return whole, memory_per_rank()


def test_memory_per_rank_is_this_machines():
    (whole, what), (quarter, what4) = run_distributed(_memory_alone_and_shared_by_4, 1)[0]
    if "RAM" in what:  # a CPU: the node's ranks share its memory
        assert whole > 1e8 and quarter == whole / 4 and what4.endswith("/ 4 ranks")
    else:  # a GPU: each rank has its own
        assert whole > 1e8 and quarter == whole and "GPU" in what4


@pytest.mark.parametrize("make,argv,needle", [
    (lambda d: (d / "tok.json").write_text("hello") and d / "tok.json", "--tokenizer",
     "is not a HuggingFace tokenizer.json"),
    (lambda d: (d / "file").write_text("x") and d / "file", "--load", "is a file; --load takes the checkpoint directory"),
])
def test_files_that_are_not_what_the_flag_takes(tmp_path, make, argv, needle):
    code, err = _launch([argv, str(make(tmp_path)), "--train-iters", "1"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_load_directory_whose_every_checkpoint_is_damaged_is_one_line(tmp_path):
    small = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
             "--train-iters", "1", "--eval-iters", "0"]
    assert run_distributed(main, 1, small + ["--save", str(tmp_path)], timeout_s=120) == [0]
    shards = list(tmp_path.glob("step_*/*.bin"))
    assert shards
    for shard in shards:
        shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, wrong bytes: every checksum fails
    code, err = _launch(small + ["--load", str(tmp_path), "--train-iters", "2", "--override-opt-param-scheduler"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no intact checkpoint" in err, err
    assert "Traceback" not in err and "point --load at another directory" in err


def test_print_config_shows_the_named_layout_on_one_process(capsys):
    code = main(["--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--global-batch-size", "32", "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    assert "tp = 2" in out and "dp = 2" in out and "#   world_size = 8" in out and "#   num_microbatches = 2" in out


def test_the_configuration_does_not_import_the_planner():
    import subprocess

    code = "import sys, megalite.config, megalite.cli; print(sorted(m for m in sys.modules if 'plan' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the interpreter runs only without CUDA here")
def test_bf16_on_the_triton_interpreter_is_refused(monkeypatch):
    # numpy has no bfloat16: the interpreter's tl.dot gives attention outputs off by ~1e9 and no error
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter itself (without it: the test below)
    with pytest.raises(ConfigError, match="no bf16 matrix multiply; use --precision fp16 or fp32"):
        configure(RunConfig.build(precision="bf16"), 1, 257)
    assert configure(RunConfig.build(precision="fp16"), 1, 257).precision.precision == "fp16"
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "auto")
    assert configure(RunConfig.build(precision="bf16"), 1, 257).precision.precision == "bf16"


def test_a_kernel_backend_that_names_none_is_one_problem(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "cuda")
    with pytest.raises(ConfigError, match="MEGALITE_KERNEL_BACKEND='cuda' is not a backend; choose one of"):
        configure(RunConfig.build(), 1, 257)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU runs Triton without the interpreter")
def test_triton_on_a_cpu_without_the_interpreter_is_one_problem(monkeypatch):
    # was a ValueError traceback at the first kernel call
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="without a GPU needs Triton's CPU interpreter: set TRITON_INTERPRET=1"):
        configure(RunConfig.build(), 1, 257)


def test_recompute_num_layers_beyond_a_chunk_and_output_paths_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as error:
        configure(RunConfig.build(num_layers=2, recompute="full", recompute_num_layers=3,
                                  metrics_file=str(tmp_path), profile_steps=(1, 1), profile_dir=str(tmp_path / "file"),
                                  hang_timeout=60.0, hang_report_dir=str(tmp_path / "file" / "reports")), 1, 257)
    problems = str(error.value)
    assert "--recompute-num-layers 3 is more than the 2 blocks of each model chunk" in problems
    assert f"--metrics-file {tmp_path} is a directory; --metrics-file takes a file name" in problems
    assert f"--profile-dir {tmp_path / 'file'} is a file; --profile-dir takes a directory" in problems
    assert f"--hang-report-dir {tmp_path / 'file' / 'reports'}: {tmp_path / 'file'} is a file, not a directory" \
        in problems


def test_a_batch_that_cannot_fit_in_host_memory_is_refused_before_reading_it():
    # was neither a refusal nor training: 21 GB of RSS in 10 minutes (sample indices of a 10^12 batch)
    with pytest.raises(ConfigError, match=r"--global-batch-size 1000000000000: each rank reads 1000000000000 samples "
                                          r"of 16 tokens per step into host memory .* more than its share of this "
                                          r"machine's RAM"):
        configure(RunConfig.build(global_batch_size=10 ** 12, micro_batch_size=1, seq_length=16, train_iters=2), 1,
                  257, memory=(1e18, "GPU 0's memory"))


def test_a_memory_refusal_dominated_by_activations_points_at_the_sequence():
    with pytest.raises(ConfigError, match=r"activations \(.* GB even with the changes above\) dominate: shorten "
                                          r"--seq-length, or split each sequence over more ranks with --cp"):
        configure(RunConfig.build(model="tiny-llama", seq_length=2 ** 20, micro_batch_size=1, train_iters=1), 1, 257,
                  memory=(8e9, "GPU 0's memory"))


def test_bf16_on_a_cpu_without_native_bf16_gets_a_notice():
    from megalite.training.launch_checks import machine_notes

    bf16 = RunConfig.build(precision="bf16")
    assert "no native bf16 arithmetic" in machine_notes(bf16, False, cpu_flags={"avx2", "fma"})[0]
    assert machine_notes(bf16, False, cpu_flags={"avx512f", "avx512_bf16"}) == []
    assert machine_notes(bf16, True) == [] and machine_notes(RunConfig.build(), False, cpu_flags={"avx2"}) == []
