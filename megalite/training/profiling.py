"""--profile-steps A B: a torch.profiler trace of training steps A..B on every rank.

Each rank writes `trace_rank{R:05d}_steps{A}-{B}.json` (Chrome trace format: open it in
Perfetto or chrome://tracing) into --profile-dir, with CPU and, on a GPU, CUDA activity,
tensor shapes and memory events; the training loop's phases (data, forward, backward,
optimizer, pipeline) appear as named ranges because `TimeBreakdown.phase` opens a
`record_function` for each. Rank 0 also prints the ten ops with the most self time.

Beside each trace, `ops_rank{R:05d}_steps{A}-{B}.json` sums the window by op and input shapes:
{"device", "steps", "ops": [{"name", "input_shapes", "count", "time_us"}]}, time_us being the
op's total time on the device that ran it (its kernels on a GPU, the op itself on a CPU).
`tools/gemm_in_step.py` reads it to compare the GEMMs a real step ran with a hardware profile.
Profiling starts at the beginning of step A (after earlier steps' warm-up) and stops at the
end of step B; steps outside the window run with the profiler off.

--memory-snapshot DIR (torchtitan's memory snapshot, CUDA only: refused on a CPU before the run starts)
records the CUDA caching allocator's history from the first step and writes
`memory_snapshot_rank{R:05d}_step{S}.pickle` after --memory-snapshot-step S, or
`..._exit.pickle` when the run ends before it (an out-of-memory error): drop it on pytorch.org/memory_viz.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class MemorySnapshot:
    """The CUDA allocator's history, recorded from the first step; written once (see the module docstring)."""

    MAX_ENTRIES = 100_000  # allocation events kept (torchtitan's default): bounded host memory

    def __init__(self, out_dir: str, step: int, rank: int, log=print):
        self.out_dir, self.step, self.rank, self.log = Path(out_dir), step, rank, log
        self.recording = False
        self.path: Path | None = None

    def before_step(self, step: int) -> None:
        if not self.recording and self.path is None:  # the first step this process runs (a resume's too)
            torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES)
            self.recording = True

    def after_step(self, step: int) -> None:
        if self.recording and step >= self.step:
            self._write(f"step{step}")

    def close(self) -> None:
        if self.recording:  # the run ended before the step: what led there (an OOM) is the interesting part
            self._write("exit")

    def _write(self, tag: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"memory_snapshot_rank{self.rank:05d}_{tag}.pickle"
        tmp = self.path.with_suffix(".pickle.tmp")
        torch.cuda.memory._dump_snapshot(str(tmp))
        os.replace(tmp, self.path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        if self.rank == 0:
            self.log(f"memory snapshot: {self.out_dir}/memory_snapshot_rank*_{tag}.pickle (pytorch.org/memory_viz)")


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, out_dir: str, rank: int, device: torch.device, log=print, *,
                 memory_snapshot: tuple[str, int] | None = None):
        self.first, self.last = steps if steps else (0, -1)
        self.out_dir, self.rank, self.device, self.log = Path(out_dir), rank, device, log
        self._profile = None
        self.trace_path: Path | None = None
        # (DIR, step) of --memory-snapshot; a CPU run was refused at launch (launch_checks.machine_problems)
        self.snapshot = (MemorySnapshot(memory_snapshot[0], memory_snapshot[1], rank, log)
                         if memory_snapshot and memory_snapshot[0] and device.type == "cuda" else None)

    def before_step(self, step: int) -> None:
        if self.snapshot is not None:
            self.snapshot.before_step(step)
        if step != self.first:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profile = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profile.__enter__()

    def after_step(self, step: int) -> None:
        if self.snapshot is not None:
            self.snapshot.after_step(step)
        if self._profile is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"trace_rank{self.rank:05d}_steps{self.first}-{self.last}.json"
        tmp = self.trace_path.with_suffix(".json.tmp")
        self._profile.export_chrome_trace(str(tmp))
        os.replace(tmp, self.trace_path)  # a reader never sees half a trace
        self._write_op_summary()
        if self.rank == 0:
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = self._profile.key_averages().table(sort_by=sort, row_limit=10)
            self.log(f"profile of steps {self.first}-{self.last}: traces in {self.out_dir}/ "
                     f"(trace_rank*_steps{self.first}-{self.last}.json)\n{table}")
        self._profile = None

    def _write_op_summary(self) -> None:
        """ops_rank*.json: the window's ops grouped by name and input shapes, with device time."""
        cuda = self.device.type == "cuda"
        ops = [{"name": e.key, "input_shapes": e.input_shapes, "count": e.count,
                "time_us": e.device_time_total if cuda else e.cpu_time_total}
               for e in self._profile.key_averages(group_by_input_shape=True)]
        summary = {"device": torch.cuda.get_device_name(self.device) if cuda else "cpu",
                   "steps": self.last - self.first + 1, "ops": ops}
        path = self.out_dir / f"ops_rank{self.rank:05d}_steps{self.first}-{self.last}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, path)

    def close(self) -> None:
        """The run ended inside the window (a signal, an error): stop without writing the trace (the
        memory snapshot, still recording, is written: it shows what led there)."""
        if self.snapshot is not None:
            self.snapshot.close()
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
