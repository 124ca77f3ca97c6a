"""Saves that go wrong on 2 ranks: a rank SIGKILLed during the background write, a full disk
(ENOSPC injected mid-file), an unwritable directory, and a publish that fails after the rename.
Every time: `latest` still names the last good checkpoint, nothing partial is loadable or left
behind, and (when the processes live) every rank raises the same one-line CheckpointWriteError
with the bytes needed and free."""
import errno
import json
import os
import re
import signal

import pytest

from megalite.distributed import mesh
from megalite.checkpoint import CheckpointWriteError, Checkpointer, load_checkpoint, storage
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import RankFailed, run_distributed

from ckpt_helpers import GLOBAL, build, model_config, train, train_config


def _failing_write_shard(how, fail_rank, fail_step):
    """storage.write_shard that, on `fail_rank` for step `fail_step`, writes 100 bytes and then
    raises ENOSPC (a disk filling up mid-file) or gets a real SIGKILL."""
    real = storage.write_shard

    def write_shard(path, tensors, crash_after_bytes=None):
        if int(os.environ["RANK"]) != fail_rank or storage.step_dir_name(fail_step) not in str(path):
            return real(path, tensors, crash_after_bytes)
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
            f.flush()
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return write_shard


def _two_saves(root, async_save, inject=None, keep_last=0):
    """Train and save step 1 (good), then step 2 with `inject` applied; return (None or the
    message of the CheckpointWriteError this rank raised, whether it was a CheckpointWriteError)."""
    m = mesh.init_mesh(dp=2)
    cfg, model = train_config(dp=2, zero=1), model_config()
    chunks, optimizer = build(model, cfg, m)
    checkpointer = Checkpointer(root, m, async_save=async_save, keep_last=keep_last, log=lambda *_: None)
    for step in (1, 2):
        train(chunks, optimizer, m, cfg, [step])
        if step == 2 and inject is not None:
            inject()
        try:
            checkpointer.save(step, chunks, optimizer, consumed_samples=step * GLOBAL, model_config=model)
            checkpointer.finish()  # async: the background write's failure surfaces here
        except CheckpointWriteError as exc:
            assert "\n" not in str(exc)
            return str(exc)
    return None


def _assert_step_1_is_the_last_good_one(root):
    assert json.loads((root / "latest").read_text()) == {"step_dir": "step_000001"}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # nothing partial left
    m, cfg = single_process_mesh("cpu"), train_config(zero=1)
    chunks, optimizer = build(model_config(), cfg, m)
    assert load_checkpoint(root, chunks, optimizer, m, log=lambda *_: None).step == 1


def _shard_bytes(root, step=1):
    manifest = json.loads((root / storage.step_dir_name(step) / storage.MANIFEST).read_text())["files"]
    return sum(entry["bytes"] for name, entry in manifest.items() if name.startswith("shard_"))


def _enospc():
    storage.write_shard = _failing_write_shard("enospc", fail_rank=1, fail_step=2)


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_is_one_clear_error_on_every_rank_and_keeps_the_last_good_checkpoint(tmp_path, async_save):
    messages = run_distributed(_two_saves, 2, tmp_path, async_save, _enospc, 1, timeout_s=120)
    assert messages[0] == messages[1] is not None  # the same verdict on both ranks, no hang
    message = messages[0]
    for needle in ("checkpoint of step 2 not saved", "rank 1 could not write", "No space left on device",
                   "free space there or choose another --save directory", "step 1, is kept"):
        assert needle in message, message
    needed = int(re.search(r"needs [\d.]+ \w+ \((\d+) bytes\)", message).group(1))
    assert needed == _shard_bytes(tmp_path)  # what the checkpoint writes: every rank's shard file
    assert int(re.search(r"and [\d.]+ \w+ \((\d+) bytes\) were free", message).group(1)) > 0
    _assert_step_1_is_the_last_good_one(tmp_path)  # --keep-last 1 did not prune it either


def _unwritable():
    def refuse(root, step):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root))
    storage.prepare_tmp_dir = refuse


def _latest_not_replaced():
    real = storage.write_json_atomic

    def write_json_atomic(path, obj):
        if path.name == storage.LATEST and obj["step_dir"] == "step_000002":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, obj)
    storage.write_json_atomic = write_json_atomic


@pytest.mark.parametrize("inject,needles", [
    (_unwritable, ["rank 0 could not write", "Permission denied", "make it writable by every rank"]),
    (_latest_not_replaced, ["rank 0 could not write", "No space left on device"]),  # after the rename
])
def test_unwritable_directory_and_failed_publish(tmp_path, inject, needles):
    messages = run_distributed(_two_saves, 2, tmp_path, False, inject, timeout_s=120)
    assert messages[0] == messages[1] is not None
    assert all(needle in messages[0] for needle in needles), messages[0]
    _assert_step_1_is_the_last_good_one(tmp_path)


def _sigkill():
    storage.write_shard = _failing_write_shard("sigkill", fail_rank=1, fail_step=2)


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankFailed, match="rank 1: rank exited"):
        run_distributed(_two_saves, 2, tmp_path, True, _sigkill, timeout_s=120)
    assert (tmp_path / "step_000002.tmp" / "shard_r00001.bin").stat().st_size == 100  # died mid-file
    assert json.loads((tmp_path / "latest").read_text()) == {"step_dir": "step_000001"}
    m, cfg = single_process_mesh("cpu"), train_config(zero=1)
    chunks, optimizer = build(model_config(), cfg, m)
    assert load_checkpoint(tmp_path, chunks, optimizer, m, log=lambda *_: None).step == 1  # never the partial one
    logged = []
    Checkpointer(tmp_path, m, log=logged.append)  # the next run removes the leftover
    assert "step_000002.tmp" in logged[0]
    _assert_step_1_is_the_last_good_one(tmp_path)
