"""Hang diagnosis: a per-rank watchdog thread that reports where every rank waits, then ends the job.

A hung collective blocks forever (NCCL's default timeout is 30 minutes), and the usual symptom
is silence. Here the training loop calls `watchdog.progress(step)` at step (or microbatch)
boundaries; when `timeout_s` passes without a call, every rank, independently:

1. writes a report to stderr and to `<report_dir>/hang_rank{R}.txt`: its recent communication
   ops from `megalite.distributed.comm`'s ring buffer with the op it still waits in named first
   ("rank 5 waits in all_reduce on group dp (seq 812, shape [4096], started 63.2 s ago)"),
   then the Python stack of every thread;
2. publishes a one-line machine-readable state through the side channel (by default the file
   `<report_dir>/hang_rank{R}.json`);
3. waits (at most `summary_wait_s`) for the other ranks' states; rank 0 writes the summary
   ("ranks 0-3, 5-7 wait in all_reduce on group dp; rank 4 is in no communication op") to
   stderr and `<report_dir>/hang_summary.txt` as soon as every rank has published, or at its
   deadline. If rank 0 never publishes (dead, or stuck holding the GIL), whichever rank first
   claims the summary after the deadline (lower ranks try first) writes it instead;
4. exits with `HANG_EXIT_CODE` via `os._exit` (the main thread is blocked in C++, so nothing
   softer would end the process). The report runs in a non-daemon thread, so a main thread
   whose collective fails when a peer exits first does not end the process before it.

The side channel is never a collective: the job is hung, so no collective can be trusted.
By default it is the file system (`FileChannel`): a temp directory shared by the ranks of one
node and unique to the job incarnation (run id, rendezvous address and restart count), so the
summary covers one node; a directory on a shared file system covers them all.
`StoreChannel` uses a key-value store with torch.distributed's Store API instead (the job's
TCPStore on a connection of its own), which reaches every node. Full reports are also on each
rank's stderr, which the launcher collects.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, TextIO

from megalite.distributed import comm
from megalite.training.hang_channels import FileChannel, write_atomic

HANG_EXIT_CODE = 86
"""Exit status of a rank the watchdog ended: a hang, not a crash (a crash gives 1, a config error 2)."""

RING_LINES = 16  # recent ops shown per rank: enough to see the step's pattern of collectives


def default_report_dir() -> str:
    """A temp directory shared by the ranks of one node, unique to this job incarnation."""
    # torchrun's run id defaults to "none": the rendezvous address tells concurrent jobs apart.
    env = os.environ.get
    key = f"{env('TORCHELASTIC_RUN_ID', 'job')}-{env('MASTER_ADDR', 'local')}-{env('MASTER_PORT', '0')}-" \
          f"r{env('TORCHELASTIC_RESTART_COUNT', '0')}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return os.path.join(tempfile.gettempdir(), f"megalite-hang-{safe}")


def _op_state(record: comm.OpRecord, now: float, on_device: bool = False) -> dict[str, Any]:
    return {"op": record.op, "group": record.group, "seq": record.seq, "shape": list(record.shape),
            "dtype": record.dtype, "nbytes": record.nbytes, "age_s": round(now - record.start, 3),
            "on_device": on_device}


def incomplete_on_device(record: comm.OpRecord) -> bool:
    """True for an op that returned to the host but has not finished on the GPU.

    NCCL collectives return once enqueued, so on GPUs the host blocks later (in a sync or
    `.item()`) and `end` is set long before the op completes. If comm attaches `done_event`
    (a CUDA event recorded on the stream right after the op), its query() tells the truth.
    """
    event = getattr(record, "done_event", None)
    if event is None or record.end is None:
        return False
    try:
        return not event.query()
    except Exception:  # noqa: BLE001 - a broken CUDA context: the op certainly did not complete
        return True


def describe_wait(rank: int, op: dict[str, Any]) -> str:
    """'rank 5 waits in all_reduce on group dp (seq 812, shape [4096], float32, started 63.2 s ago)'."""
    where = "enqueued on the GPU and not complete, " if op.get("on_device") else ""
    return (f"rank {rank} waits in {op['op']} on group {op['group']} (seq {op['seq']}, shape {op['shape']}, "
            f"{op['dtype']}, {op['nbytes']} bytes, {where}started {op['age_s']:.1f} s ago)")


def rank_state(rank: int, world_size: int, ops: list[comm.OpRecord], *, last_step: Any, idle_s: float,
               coords: str = "", main_frame: str = "") -> dict[str, Any]:
    """What one rank tells the others: the op it waits in, or None.

    That op is the oldest one not complete on the GPU (a stream runs its ops in order, so the
    later ones queue behind it), else the newest one the host has not returned from (the
    main thread blocks in the latest call; older pending ones are async handles not waited yet).
    """
    now = time.perf_counter()
    device = [r for r in ops if incomplete_on_device(r)]
    host = [r for r in ops if r.end is None]
    waiting = device[0] if device else (host[-1] if host else None)
    unfinished = {r.seq for r in device} | {r.seq for r in host}
    others = [r for r in ops if r.seq in unfinished and r is not waiting]
    done = [r for r in ops if r.seq not in unfinished]
    return {"rank": rank, "world_size": world_size, "coords": coords, "host": socket.gethostname(),
            "pid": os.getpid(), "last_step": last_step, "idle_s": round(idle_s, 3),
            "waiting": None if waiting is None else _op_state(waiting, now, on_device=bool(device)),
            "other_pending": [_op_state(r, now, on_device=r.end is not None) for r in others],
            "last_done": _op_state(done[-1], now) if done else None, "main_frame": main_frame}


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def summarize_hang(states: dict[int, dict[str, Any]], world_size: int) -> str:
    """The cross-rank picture: ranks grouped by the op they wait in, and the likely culprits.

    The culprits are the ranks *not* where most ranks wait: in another op, in no op at all
    (they skipped a collective, or are stuck in compute or I/O), or silent (no state: dead,
    or stuck without releasing the GIL).
    """
    by_wait: dict[tuple, list[int]] = {}
    idle: list[int] = []
    for rank in sorted(states):
        w = states[rank]["waiting"]
        if w is None:
            idle.append(rank)
        else:
            by_wait.setdefault((w["op"], w["group"], tuple(w["shape"]), w["dtype"]), []).append(rank)
    silent = [r for r in range(world_size) if r not in states]
    lines = [f"megalite hang summary: {len(states)} of {world_size} ranks reported"]
    ordered = sorted(by_wait.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    for (op, group, shape, dtype), ranks in ordered:
        seqs = sorted({states[r]["waiting"]["seq"] for r in ranks})
        seq_text = f"seq {seqs[0]}" if len(seqs) == 1 else f"seq {seqs[0]}..{seqs[-1]}"
        noun = "rank" if len(ranks) == 1 else "ranks"
        verb = "waits" if len(ranks) == 1 else "wait"
        lines.append(f"  {noun} {_ranks_text(ranks)} {verb} in {op} on group {group} "
                     f"({seq_text}, shape {list(shape)}, {dtype})")
    for rank in idle:
        s = states[rank]
        last = s["last_done"]
        after = f"last op {last['op']} on group {last['group']} (seq {last['seq']}) returned" if last else "no op yet"
        lines.append(f"  rank {rank} is in no communication op ({after}; main thread at {s['main_frame']})")
    if silent:
        lines.append(f"  {'rank' if len(silent) == 1 else 'ranks'} {_ranks_text(silent)} sent no report "
                     f"(dead, or stuck without releasing the GIL; see their stderr)")
    majority = ordered[0][1] if ordered else []
    suspects = sorted(set(range(world_size)) - set(majority))
    if ordered and suspects:
        op, group = ordered[0][0][:2]
        lines.append(f"likely culprit: {'rank' if len(suspects) == 1 else 'ranks'} {_ranks_text(suspects)} "
                     f"(not in the {op} on group {group} that {len(majority)} ranks wait in)")
    elif ordered:
        lines.append("every rank waits in the same op: look for a mismatch in shapes or group membership, "
                     "or a network problem")
    return "\n".join(lines)


def thread_stacks() -> str:
    """Python stack of every thread of this process, main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: (i != main, i)):
        out.append(f"--- thread {names.get(ident, '?')} (id {ident}) ---")
        out.append("".join(traceback.format_stack(frames[ident])).rstrip())
    return "\n".join(out)


def _main_frame() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class HangWatchdog:
    """Per-rank watchdog: no `progress()` for `timeout_s` seconds -> report, summary, exit.

    Args:
        timeout_s: seconds without progress that count as a hang (--hang-timeout). Must exceed
            the longest legitimate gap between progress calls (a step, an evaluation, a save),
            or wrap such phases in `paused()`.
        report_dir: where each rank writes hang_rank{R}.txt and the summariser hang_summary.txt
            (default: `default_report_dir()`).
        channel: how ranks exchange states and elect the summariser without collectives
            (default: FileChannel(report_dir); a StoreChannel covers every node).
        rank, world_size: default from torch.distributed (via megalite.distributed.comm) or the environment.
        mesh: optional Mesh, to print each rank's (tp, dp, pp) coordinates.
        summary_wait_s: how long ranks wait for each other's states before the summary is
            written without the missing ones (default: min(30, max(2, timeout_s))).
        exit_code, exit_fn: how the process ends after reporting (tests may pass a recorder).
        stream: where the report and summary are printed (default sys.stderr).

    Use: `wd = HangWatchdog(args.hang_timeout).start()`, then `wd.progress(step)` at every
    step boundary, `wd.stop()` at the end (or use it as a context manager).
    """

    def __init__(self, timeout_s: float, report_dir: str | None = None, *, channel=None, rank: int | None = None,
                 world_size: int | None = None, mesh=None, summary_wait_s: float | None = None,
                 exit_code: int = HANG_EXIT_CODE, exit_fn: Callable[[int], Any] = os._exit,
                 stream: TextIO | None = None):
        if not timeout_s > 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {timeout_s}; use e.g. 300 (0 is not "
                             f"'off': do not create a watchdog to turn it off)")
        self.timeout_s = float(timeout_s)
        self.report_dir = report_dir or default_report_dir()
        self.channel = channel if channel is not None else FileChannel(self.report_dir)
        self.rank = rank if rank is not None else int(os.environ.get("RANK", comm.global_rank()))
        self.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        self.coords = "" if mesh is None else f"tp {mesh.tp_rank}, dp {mesh.dp_rank}, pp {mesh.pp_rank}" + (
            f", cp {mesh.cp_rank}" if mesh.cp_size > 1 else "")
        self.summary_wait_s = summary_wait_s if summary_wait_s is not None else min(30.0, max(2.0, self.timeout_s))
        self.exit_code, self.exit_fn = exit_code, exit_fn
        self.stream = stream
        self.poll_s = min(1.0, self.timeout_s / 10)
        self._last_progress = time.monotonic()
        self._last_step: Any = None
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    # ------------------------------------------------------------------ the training loop's side

    def start(self) -> "HangWatchdog":
        os.makedirs(self.report_dir, exist_ok=True)
        # What an earlier incarnation of this rank left would be mistaken for a fresh report.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.report_dir, f"hang_rank{self.rank}.txt"))
        self.channel.reset(self.rank)
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="megalite-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def progress(self, step: Any = None) -> None:
        """Mark progress (cheap: two attribute writes). `step` is shown in the report."""
        self._last_step = step
        self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """Suspend hang detection for a phase known to be long and free of collectives (e.g. a compile)."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1
            self.progress(self._last_step)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "HangWatchdog":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ the watchdog thread

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last_progress
            if idle > self.timeout_s and not self._paused:
                self.fired = True
                # Report from a non-daemon thread: once a peer exits, this rank's blocked collective may
                # fail and the main thread unwind; the interpreter then waits for non-daemon threads
                # (threading._shutdown), so the report, the summary and the exit code still happen.
                threading.Thread(target=self._fire, args=(idle,), name="megalite-hang-report", daemon=False).start()
                return

    def _fire(self, idle_s: float) -> None:
        try:
            self._report(idle_s)
        finally:
            self._emit("")  # flush
            self.exit_fn(self.exit_code)

    def _emit(self, text: str) -> None:
        stream = self.stream or sys.stderr
        if text:
            stream.write(text if text.endswith("\n") else text + "\n")
        stream.flush()

    def report_text(self, idle_s: float, state: dict[str, Any], ops: list[comm.OpRecord]) -> str:
        """This rank's full report: where it waits, its recent ops, and every thread's stack."""
        where = f"rank {self.rank} of {self.world_size}" + (f" ({self.coords})" if self.coords else "")
        lines = [f"=== megalite hang report: {where}, host {state['host']}, pid {state['pid']} ===",
                 f"no progress for {idle_s:.1f} s (hang timeout {self.timeout_s:g} s); last progress at step "
                 f"{self._last_step}"]
        if state["waiting"] is not None:
            lines.append(describe_wait(self.rank, state["waiting"]))
        else:
            lines.append(f"rank {self.rank} is in no communication op; main thread at {state['main_frame']}")
        for op in state["other_pending"]:
            lines.append(f"  also not complete: {op['op']} on group {op['group']} (seq {op['seq']}, "
                         f"{'on the GPU, ' if op['on_device'] else ''}started {op['age_s']:.1f} s ago)")
        now = time.perf_counter()
        lines.append(f"recent communication ops, oldest first (last {min(RING_LINES, len(ops))} of the ring buffer):")
        for r in ops[-RING_LINES:]:
            mark = " [not complete on the GPU]" if incomplete_on_device(r) else ""
            mark += "   <-- waiting here" if state["waiting"] and r.seq == state["waiting"]["seq"] else ""
            lines.append(f"  {r.describe()}, started {now - r.start:.1f} s ago{mark}")
        lines.append("python stacks:")
        lines.append(thread_stacks())
        return "\n".join(lines) + "\n"

    def _report(self, idle_s: float) -> None:
        ops = comm.recent_ops()
        state = rank_state(self.rank, self.world_size, ops, last_step=self._last_step, idle_s=idle_s,
                           coords=self.coords, main_frame=_main_frame())
        text = self.report_text(idle_s, state, ops)
        self._emit(text)
        try:
            os.makedirs(self.report_dir, exist_ok=True)
            write_atomic(os.path.join(self.report_dir, f"hang_rank{self.rank}.txt"), text)
        except OSError as exc:  # a full or read-only disk must not stop the stderr report and the exit
            self._emit(f"megalite watchdog: could not write to {self.report_dir}: {exc}")
        try:
            self.channel.publish(self.rank, state)
            self._summarize_or_wait()
        except Exception as exc:  # noqa: BLE001 - an unreachable side channel must not stop the exit
            self._emit(f"megalite watchdog: no cross-rank summary ({type(exc).__name__}: {exc})")

    def _summarize_or_wait(self) -> None:
        """Rank 0 summarises when all ranks published (or at the deadline); the others wait for that
        summary so the launcher does not kill rank 0 mid-summary; if none comes, one of them writes it."""
        channel = self.channel
        deadline = time.monotonic() + self.summary_wait_s
        while time.monotonic() < deadline:
            if channel.has_summary():
                return
            if self.rank == 0 and len(channel.states(self.world_size)) == self.world_size:
                break
            time.sleep(0.05)
        if self.rank != 0:
            time.sleep(0.05 * min(self.rank, 20))  # let rank 0 (or a lower rank) win the race when it can
            if channel.has_summary():
                return
        if not channel.claim_summary():  # exactly one rank writes the summary
            return
        text = summarize_hang(channel.states(self.world_size), self.world_size)
        text += f"\n(per-rank reports: {os.path.join(self.report_dir, 'hang_rank<R>.txt')} on each rank's host; " \
                f"written by rank {self.rank}; exiting with code {self.exit_code})\n"
        self._emit(text)
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.report_dir, "hang_summary.txt"), text)
        channel.post_summary(text)
