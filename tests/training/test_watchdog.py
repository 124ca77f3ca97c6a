"""Hang watchdog: a gloo world where ranks skip a collective is reported and ended within the timeout.

The distributed test forks its own ranks (not run_distributed) because it needs every rank's
real exit status: run_distributed kills the remaining ranks 0.5 s after the first one exits.
"""
import io
import json
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.testing import free_port
from megalite.training.hang_channels import StoreChannel
from megalite.training.watchdog import (HANG_EXIT_CODE, HangWatchdog, describe_wait, rank_state,
                                        summarize_hang)

WORLD, TIMEOUT_S = 4, 1.5


def _stuck_in_compute():
    time.sleep(60)  # a rank that skipped the collective and never comes back (a long host-side stall)


def _rank(rank, port, report_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    m = mesh.init_mesh(tp=1, pp=1)  # dp = 4: the dp group holds the same ranks as the world, but is another group
    watchdog = HangWatchdog(TIMEOUT_S, report_dir, mesh=m, summary_wait_s=10).start()
    x = torch.ones(4, 2)
    for step in range(2):
        watchdog.progress(step)
        if step == 1 and rank == 2:
            comm.all_reduce(torch.ones(3), m.dp_group)  # skipped the world all-reduce: waits in another op
        elif step == 1 and rank == 3:
            _stuck_in_compute()  # skipped it and is in no collective at all
        else:
            comm.all_reduce(x, comm.world_group())
    os._exit(0)  # never reached: the watchdog ends every rank


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_skipped_collective_is_reported_by_every_rank_and_summarised(tmp_path, capfd):
    ctx, port = mp.get_context("fork"), free_port()
    started = time.monotonic()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path)), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    elapsed = time.monotonic() - started
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [HANG_EXIT_CODE] * WORLD
    assert elapsed < 30, f"the watchdog took {elapsed:.1f} s to end a hang with a {TIMEOUT_S} s timeout"

    states = {r: json.loads((tmp_path / f"hang_rank{r}.json").read_text()) for r in range(WORLD)}
    for r in (0, 1):
        assert states[r]["waiting"]["op"] == "all_reduce" and states[r]["waiting"]["group"] == "world"
        assert states[r]["waiting"]["shape"] == [4, 2]
        assert states[r]["idle_s"] >= TIMEOUT_S and states[r]["last_step"] == 1
    assert states[0]["waiting"]["seq"] == states[1]["waiting"]["seq"]
    assert (states[2]["waiting"]["group"], states[2]["waiting"]["shape"]) == ("dp", [3])
    assert states[3]["waiting"] is None and "_stuck_in_compute" in states[3]["main_frame"]
    assert states[3]["last_done"]["group"] == "world"

    report0 = (tmp_path / "hang_rank0.txt").read_text()
    assert f"rank 0 waits in all_reduce on group world (seq {states[0]['waiting']['seq']}, shape [4, 2]" in report0
    assert "<-- waiting here" in report0 and "--- thread MainThread" in report0
    assert "(tp 0, dp 0, pp 0)" in report0
    report3 = (tmp_path / "hang_rank3.txt").read_text()
    assert "rank 3 is in no communication op" in report3 and "_stuck_in_compute" in report3

    summary = (tmp_path / "hang_summary.txt").read_text()
    assert "4 of 4 ranks reported" in summary
    assert "ranks 0-1 wait in all_reduce on group world" in summary
    assert "rank 2 waits in all_reduce on group dp" in summary
    assert "rank 3 is in no communication op" in summary
    assert "likely culprit: ranks 2-3 (not in the all_reduce on group world that 2 ranks wait in)" in summary
    assert "written by rank 0" in summary  # rank 0 was alive, so it wrote the summary

    err = capfd.readouterr().err  # every rank's report and the summary also reach stderr
    for r in range(WORLD):
        assert f"=== megalite hang report: rank {r} of {WORLD}" in err
    assert err.count("megalite hang summary") == 1


def test_progress_keeps_it_quiet_then_silence_fires_with_the_pending_op(tmp_path, monkeypatch):
    now = time.perf_counter()
    ops = [comm.OpRecord(7, "all_gather", "tp", (8,), "float32", 64, now - 3.0, now - 2.9),
           comm.OpRecord(8, "reduce_scatter", "dp", (4, 8), "bfloat16", 64, now - 2.5),  # async, not waited yet
           comm.OpRecord(9, "all_reduce", "dp", (4, 8), "float32", 128, now - 2.0)]
    monkeypatch.setattr(comm, "recent_ops", lambda: ops)
    fired, out = threading.Event(), io.StringIO()
    codes = []

    def record_exit(code):
        codes.append(code)
        fired.set()

    watchdog = HangWatchdog(0.6, str(tmp_path), rank=0, world_size=1, exit_fn=record_exit, stream=out)
    with watchdog:
        for step in range(8):  # 0.8 s of steady progress: more than the timeout, never a gap that long
            watchdog.progress(step)
            time.sleep(0.1)
        assert not fired.is_set()
        with watchdog.paused():  # a known-long phase does not count
            time.sleep(0.8)
        assert not fired.is_set()
        assert fired.wait(10)
    assert codes == [HANG_EXIT_CODE]
    text = out.getvalue()
    assert "no progress for" in text and "last progress at step 7" in text
    assert "rank 0 waits in all_reduce on group dp (seq 9, shape [4, 8], float32, 128 bytes, started" in text
    assert "also not complete: reduce_scatter on group dp (seq 8" in text
    assert "#7 all_gather group=tp shape=[8] float32 (done in 100.00 ms)" in text
    assert "test_progress_keeps_it_quiet_then_silence_fires_with_the_pending_op" in text  # the main stack
    assert (tmp_path / "hang_rank0.txt").read_text() in text
    assert "1 of 1 ranks reported" in (tmp_path / "hang_summary.txt").read_text()


def test_summary_names_silent_ranks_and_ranges():
    def waiting(seq):
        return {"op": "all_reduce", "group": "dp", "seq": seq, "shape": [16], "dtype": "float32", "nbytes": 64,
                "age_s": 5.0}

    states = {r: {"waiting": waiting(40 + r % 2), "last_done": None, "main_frame": "x"} for r in (0, 1, 2, 5, 6, 7)}
    text = summarize_hang(states, 8)
    assert "6 of 8 ranks reported" in text
    assert "ranks 0-2, 5-7 wait in all_reduce on group dp (seq 40..41, shape [16], float32)" in text
    assert "ranks 3-4 sent no report" in text
    assert "likely culprit: ranks 3-4" in text
    same = summarize_hang({r: {"waiting": waiting(3), "last_done": None, "main_frame": "x"} for r in range(2)}, 2)
    assert "every rank waits in the same op" in same


def test_bad_timeout_is_refused_with_the_fix():
    try:
        HangWatchdog(0)
    except ValueError as exc:
        assert "--hang-timeout must be > 0" in str(exc)
    else:
        raise AssertionError("a zero timeout was accepted")


class _FakeCudaEvent:
    def __init__(self, complete):
        self.complete = complete

    def query(self):
        return self.complete


def test_gpu_ops_that_returned_but_did_not_complete_are_where_the_rank_waits():
    now = time.perf_counter()
    ops = [comm.OpRecord(1, "all_reduce", "tp", (8,), "bfloat16", 16, now - 9, now - 9),
           comm.OpRecord(2, "all_reduce", "dp", (64,), "float32", 256, now - 8, now - 8),
           comm.OpRecord(3, "all_gather", "dp", (128,), "float32", 512, now - 7, now - 7),
           comm.OpRecord(4, "send", "pp", (2, 4), "float32", 32, now - 6)]  # host-pending async send
    ops[0].done_event, ops[1].done_event, ops[2].done_event = (_FakeCudaEvent(True), _FakeCudaEvent(False),
                                                               _FakeCudaEvent(False))
    state = rank_state(5, 8, ops, last_step=3, idle_s=10.0)
    assert state["waiting"]["seq"] == 2 and state["waiting"]["on_device"]  # the oldest op the stream has not finished
    assert [(o["seq"], o["on_device"]) for o in state["other_pending"]] == [(3, True), (4, False)]
    assert state["last_done"]["seq"] == 1
    assert describe_wait(5, state["waiting"]).startswith(
        "rank 5 waits in all_reduce on group dp (seq 2, shape [64], float32, 256 bytes, enqueued on the GPU and "
        "not complete, started 8.0 s ago")


class _DictStore:
    """The part of torch.distributed's Store API the channel uses, in memory (one process, many threads)."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self.lock:
            return self.data[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key, amount):
        with self.lock:
            self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
            return int(self.data[key])


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_store_channel_and_a_silent_rank_0_another_rank_summarises(tmp_path, monkeypatch):
    now = time.perf_counter()
    monkeypatch.setattr(comm, "recent_ops", lambda: [comm.OpRecord(4, "broadcast", "dp", (2,), "int64", 16, now)])
    store, done = _DictStore(), threading.Barrier(3)
    codes = {}

    def exit_fn_for(rank):
        def record(code):
            codes[rank] = code
            done.wait(10)
        return record

    # Ranks 1 and 2 of a world of 3 hang; rank 0 never reports (dead, or stuck holding the GIL).
    watchdogs = [HangWatchdog(0.2, str(tmp_path / f"node{r}"), channel=StoreChannel(store, "job/"), rank=r,
                              world_size=3, summary_wait_s=1.5, exit_fn=exit_fn_for(r), stream=io.StringIO())
                 for r in (1, 2)]
    for w in watchdogs:
        w.start()
    done.wait(20)
    assert codes == {1: HANG_EXIT_CODE, 2: HANG_EXIT_CODE}
    summary = store.get("job/summary").decode()
    assert "2 of 3 ranks reported" in summary and "ranks 1-2 wait in broadcast on group dp" in summary
    assert "rank 0 sent no report" in summary and "likely culprit: rank 0" in summary
    # Exactly one live rank claimed and wrote it (rank 1 usually: higher ranks wait a little longer).
    writers = [r for r in (1, 2) if (tmp_path / f"node{r}" / "hang_summary.txt").exists()]
    assert len(writers) == 1 and f"written by rank {writers[0]}" in summary
    assert (tmp_path / f"node{writers[0]}" / "hang_summary.txt").read_text() == summary
    assert json.loads(store.get("job/state/2"))["waiting"]["seq"] == 4
