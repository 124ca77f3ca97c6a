"""--memory-snapshot (torchtitan's habit, issue 49 item 13): on CUDA the allocator's history written per rank
after the chosen step or when the run ends before it; refused in one line on a CPU, before the run starts."""
import pickle

import torch

from megalite.training.profiling import StepProfiler


def test_refused_on_a_cpu_in_one_line(tmp_path, capsys):
    from megalite.training.loop import main

    code = main(["--train-iters", "1", "--memory-snapshot", str(tmp_path / "snap")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--memory-snapshot" in err[0] and "no CUDA GPU" in err[0], err
    assert not (tmp_path / "snap").exists()


def _fake_cuda_memory(monkeypatch) -> list:
    """torch.cuda.memory's recorder, faked so the profiler's wiring runs on a CPU (the real one: GPU run)."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kwargs: calls.append(("record", enabled)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: (calls.append(("dump", path)), open(path, "wb").write(pickle.dumps({}))))
    return calls


def test_written_after_the_step_and_at_an_early_exit(tmp_path, monkeypatch):
    calls = _fake_cuda_memory(monkeypatch)
    cuda = torch.device("cuda", 0)
    profiler = StepProfiler(None, str(tmp_path / "p"), 3, cuda, log=lambda *_: None,
                            memory_snapshot=(str(tmp_path / "snap"), 2))
    for step in (1, 2, 3):
        profiler.before_step(step)
        profiler.after_step(step)
    profiler.close()
    assert [c[0] for c in calls] == ["record", "dump", "record"] and calls[2][1] is None  # recording stopped
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == ["memory_snapshot_rank00003_step2.pickle"]
    calls.clear()
    early = StepProfiler(None, str(tmp_path / "p"), 0, cuda, memory_snapshot=(str(tmp_path / "oom"), 5),
                         log=lambda *_: None)
    early.before_step(1)  # an out-of-memory error in step 1: the loop's exit closes the profiler
    early.close()
    assert [p.name for p in (tmp_path / "oom").iterdir()] == ["memory_snapshot_rank00000_exit.pickle"]
    assert StepProfiler(None, "p", 0, torch.device("cpu"), memory_snapshot=("snap", 2)).snapshot is None
