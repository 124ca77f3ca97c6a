"""Checkpointer: save a layout-free checkpoint, synchronously or in the background.

    checkpointer = Checkpointer("runs/ckpt", mesh, keep_last=3, keep_every=1000, async_save=True)
    checkpointer.save(step, chunks, optimizer, consumed_samples=..., model_config=..., train_config=...)
    ...
    checkpointer.finish()   # waits for a background write; every rank, before exiting

One save:
1. (every rank, training blocked) copy this rank's boxes to CPU memory (`snapshot.collect`);
   rank 0 creates `step_N.tmp/`; one all_gather_object of the per-rank index (names, boxes,
   byte offsets: no tensor data, and whether rank 0 could create the directory) so rank 0
   can write metadata.json.
2. (sync: now; async: a background thread) each rank writes its shard file, fsyncs it and
   drops a done marker; rank 0 then waits for every marker, writes metadata.json and the
   manifest, renames the directory and replaces `latest` (storage.publish), and prunes.
3. (sync: now; async: at the next save() or finish()) `settle()`: the ranks agree how their
   shard writes went (all_gather_object), then how the publish went; if any rank failed,
   every rank raises the same CheckpointWriteError (bytes needed, bytes free, the fix), rank 0
   removes the partial directory, and `latest` still names the last good checkpoint.
The background thread never communicates (gloo/NCCL collectives from two threads could
interleave); ranks meet through the markers, and agree in the main thread. A sync save
returns once the checkpoint is published for everyone.

Crash safety: a process killed at any moment leaves `latest` naming a complete checkpoint and
at most a `step_N.tmp/` directory that no load takes; the next Checkpointer removes it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import threading
import time
from pathlib import Path

import torch

from megalite.distributed import comm
from megalite.parameters import params
from megalite.checkpoint import snapshot, storage
from megalite.checkpoint.write_failure import failure_error, write_status
from megalite.distributed.mesh import Mesh

FORMAT_VERSION = storage.FORMAT_VERSION  # re-exported: tools import it from here
CRASH_ENV = "MEGALITE_CHECKPOINT_CRASH_AFTER_BYTES"  # fault injection: rank 0 dies mid-write
# A slow file system, simulated (tools/fault_drill.py): each rank's shard stays unpublished this
# many seconds longer, so a drill can reliably kill a worker while a background write is in flight.
WRITE_DELAY_ENV = "MEGALITE_CHECKPOINT_WRITE_DELAY_S"
# The drill's deterministic window (no timing): a directory. While DIR/arm exists, each rank that
# has started a background write (its training thread), or written its shard but not yet its done
# marker (the writer), says so in DIR/held_rN and waits for `arm` to go.
WRITE_HOLD_ENV = "MEGALITE_CHECKPOINT_WRITE_HOLD"
HOLD_LIMIT_S = 300.0  # a drill that died does not keep the run waiting for ever


def hold_if_armed(rank: int) -> bool:
    """Wait inside the write window while the drill's arm file exists; True if it held."""
    hold = os.environ.get(WRITE_HOLD_ENV)
    if not hold or not os.path.exists(os.path.join(hold, "arm")):
        return False
    with open(os.path.join(hold, f"held_r{rank}"), "w"):
        pass
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(os.path.join(hold, "arm")) and time.monotonic() < deadline:
        time.sleep(0.005)
    return True


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _megalite_version() -> str:
    try:
        return importlib.metadata.version("megalite")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


def layout_of(mesh: Mesh, chunks, optimizer) -> dict:
    return {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "cp": mesh.cp_size,
            **({"ep": mesh.ep_size} if mesh.ep_size > 1 else {}), "world_size": mesh.world_size,
            "virtual_stages": len(chunks), "zero_stage": getattr(optimizer, "zero_stage", None),
            "param_dtype": storage.DTYPE_NAMES[next(chunks[0].parameters()).dtype]}


@dataclasses.dataclass
class _Write:
    """One checkpoint on its way to disk: this rank's part, and how it went."""

    step: int
    tmp_dir: Path
    file: str
    tensors: list
    metadata: dict | None  # rank 0 only
    needed_bytes: int  # every rank's shard file together
    free_bytes: int  # free on this rank's file system when the writes began
    shard_done: threading.Event = dataclasses.field(default_factory=threading.Event)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)  # rank 0 stops waiting for markers
    shard_error: BaseException | None = None
    publish_error: BaseException | None = None
    thread: threading.Thread | None = None


class Checkpointer:
    """Saves checkpoints into `save_dir` (see the module docstring for the protocol).

    keep_last: keep the newest N checkpoints (0: keep all); keep_every: also keep every
    step that is a multiple of M (milestones); async_save: write in a background thread,
    training blocks only for the copy to CPU memory. `log` prints on rank 0. Rank 0 removes
    what a killed earlier run left unpublished (`step_N.tmp/`) when the Checkpointer is made.
    """

    def __init__(self, save_dir: str | os.PathLike, mesh: Mesh, *, keep_last: int = 0, keep_every: int = 0,
                 async_save: bool = False, timeout_s: float = 1800.0, log=print):
        if keep_last < 0 or keep_every < 0:
            raise ValueError(f"--keep-last and --keep-every must be >= 0, got {keep_last} and {keep_every}")
        self.root, self.mesh = Path(save_dir), mesh
        self.keep_last, self.keep_every, self.async_save = keep_last, keep_every, async_save
        self.timeout_s, self._log = timeout_s, log
        self._pending: _Write | None = None
        self.last_blocked_s = 0.0  # training-blocked seconds of the last save()
        if mesh.rank == 0:
            removed = storage.remove_unpublished(self.root)
            if removed:
                self.log(f"checkpoint: removed {removed}, left unpublished by an interrupted earlier save")

    def log(self, message: str) -> None:
        if self.mesh.rank == 0:
            self._log(message)

    # ------------------------------------------------------------------ save

    def save(self, step: int, chunks, optimizer, *, consumed_samples: int, model_config, train_config=None,
             extra: dict | None = None) -> Path:
        """Checkpoint the state after `step` optimizer steps; returns the final directory path.

        Every rank must call it. Raises CheckpointWriteError on every rank when this save (sync)
        or the previous background one (async) could not be written.
        """
        started = time.perf_counter()
        self.settle()  # one write in flight at a time (and a failed background write raises here)
        items, optimizer_extras = snapshot.collect(chunks, optimizer, self.mesh, copy=self.async_save)
        file = storage.shard_file_name(self.mesh.rank)
        index, offset = [], 0
        for item in items:
            index.append(item.index_entry(file, offset))
            offset += item.tensor.numel() * item.tensor.element_size()
        tmp_dir = self.root / (storage.step_dir_name(step) + ".tmp")
        setup = write_status(None, 0)
        if self.mesh.rank == 0:
            try:
                storage.prepare_tmp_dir(self.root, step)
            except OSError as exc:  # told to every rank below: nobody waits for a directory that never comes
                setup = write_status(exc, storage.free_bytes(self.root))
        # Also a barrier: after it, the tmp directory exists for every rank.
        shapes = {name: list(params.shard_spec(p).full_shape) for chunk in chunks for name, p in chunk.logical_parameters()}
        gathered = comm.all_gather_object({"items": index, "shapes": shapes, "bytes": offset, "setup": setup},
                                          comm.world_group())
        needed = sum(g["bytes"] for g in gathered)
        if gathered[0]["setup"]["error"] is not None:
            raise failure_error(step, self.root, [(0, gathered[0]["setup"])], needed, storage.latest_step(self.root))
        metadata = None
        if self.mesh.rank == 0:
            metadata = self._metadata(step, chunks, optimizer, optimizer_extras, gathered,
                                      consumed_samples=consumed_samples, model_config=model_config,
                                      train_config=train_config, extra=extra)
        tensors = [item.tensor for item in items]
        del items
        final = self.root / storage.step_dir_name(step)
        write = _Write(step, tmp_dir, file, tensors, metadata, needed, storage.free_bytes(self.root))
        self._pending = write
        if self.async_save:
            write.thread = threading.Thread(target=self._write_in_background, args=(write,),
                                            name=f"megalite-checkpoint-{step}", daemon=True)
            write.thread.start()
            self.last_blocked_s = time.perf_counter() - started
            self.log(f"checkpoint: step {step} copied to memory in {self.last_blocked_s:.2f} s; writing to "
                     f"{final} in the background")
            hold_if_armed(self.mesh.rank)  # a drill's window: training waits too, the write stays in flight
        else:
            self._write_shard(write)
            self.settle()  # rank 0 publishes once every rank's shard is written; errors raise on every rank
            self.last_blocked_s = time.perf_counter() - started
            self.log(f"checkpoint: saved step {step} to {final} in {self.last_blocked_s:.2f} s")
        return final

    def _metadata(self, step: int, chunks, optimizer, optimizer_extras: dict, gathered: list[dict], *,
                  consumed_samples: int, model_config, train_config, extra: dict | None) -> dict:
        """The checkpoint's metadata.json (rank 0): the run's state and configs, the layout it was saved
        at, every rank's index rows (`gathered`: each rank's {"items", "shapes", ...}) and full shapes."""
        return {
            "format_version": FORMAT_VERSION, "step": step, "consumed_samples": int(consumed_samples),
            "optimizer_step": optimizer_extras["step"], "loss_scaler": optimizer_extras["loss_scaler"],
            "has_optimizer": optimizer is not None, "model_config": _jsonable(model_config),
            "train_config": _jsonable(train_config), "layout": layout_of(self.mesh, chunks, optimizer),
            "versions": {"megalite": _megalite_version(), "torch": torch.__version__,
                         "python": sys.version.split()[0]},
            "saved_at_unix": time.time(), "extra": _jsonable(extra or {}),
            "tensors": {name: shape for g in gathered for name, shape in g["shapes"].items()},
            "items": [row for g in gathered for row in g["items"]],
        }

    def _write_shard(self, write: _Write) -> None:
        """Write this rank's shard file and its done marker; record an error instead of raising."""
        rank = self.mesh.rank
        try:
            crash = os.environ.get(CRASH_ENV)
            crash_after = int(crash) if crash is not None and rank == 0 else None
            record = storage.write_shard(write.tmp_dir / write.file, write.tensors, crash_after_bytes=crash_after)
            time.sleep(float(os.environ.get(WRITE_DELAY_ENV) or 0))
            hold_if_armed(rank)
            storage.write_done_marker(write.tmp_dir, rank, {"file": write.file, **record})
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement in settle()
            write.shard_error = exc
            try:  # lets rank 0's background publish stop waiting at once (settle() aborts it anyway)
                storage.write_done_marker(write.tmp_dir, rank, {"file": write.file, "error": repr(exc)})
            except OSError:
                pass
        finally:
            write.tensors = []  # the CPU copy is no longer needed
            write.shard_done.set()

    def _publish(self, write: _Write) -> None:
        """Rank 0: wait for every marker, write metadata and manifest, rename, replace `latest`, prune."""
        try:
            files = storage.collect_done_markers(write.tmp_dir, self.mesh.world_size, self.timeout_s, write.abort)
            metadata = write.metadata
            metadata["items"], files = storage.attach_crcs(metadata["items"], files)
            sha = storage.write_json_atomic(write.tmp_dir / storage.METADATA, metadata)
            files[storage.METADATA] = {"sha256": sha, "bytes": (write.tmp_dir / storage.METADATA).stat().st_size}
            final = storage.publish(write.tmp_dir, files)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank in settle()
            write.publish_error = exc
            return
        try:
            deleted = storage.prune(self.root, self.keep_last, self.keep_every)
        except OSError as exc:  # the new checkpoint is published: an old one that stays is no failure
            self.log(f"megalite: warning: could not remove old checkpoints in {self.root}: {exc}")
            deleted = []
        if deleted:
            self.log(f"checkpoint: removed old checkpoints {deleted} (--keep-last {self.keep_last}"
                     f"{f', --keep-every {self.keep_every}' if self.keep_every else ''})")
        if self.async_save:
            self.log(f"checkpoint: step {write.step} published at {final}")

    def _write_in_background(self, write: _Write) -> None:
        self._write_shard(write)
        if self.mesh.rank == 0 and write.shard_error is None:
            self._publish(write)

    # ------------------------------------------------------------------ agreement

    def settle(self) -> None:
        """Finish the write in flight: published on return, or CheckpointWriteError on every rank.

        Collective (every rank calls it; save() and finish() do). Two small all_gather_objects:
        how each rank's shard write went, then how rank 0's publish went.
        """
        write, self._pending = self._pending, None
        if write is None:
            return
        world = comm.world_group()
        write.shard_done.wait()
        statuses = comm.all_gather_object(write_status(write.shard_error, write.free_bytes), world)
        failures = [(rank, status) for rank, status in enumerate(statuses) if status["error"] is not None]
        if failures:
            write.abort.set()
        elif self.mesh.rank == 0 and write.thread is None:
            self._publish(write)  # sync save: every shard is on disk
        if write.thread is not None:
            write.thread.join()
        if not failures:
            published = comm.all_gather_object(write_status(write.publish_error, write.free_bytes)
                                               if self.mesh.rank == 0 else None, world)[0]
            failures = [(0, published)] if published["error"] is not None else []
        if failures:
            if self.mesh.rank == 0:
                storage.discard_unpublished(self.root, write.step)
            comm.barrier(world)  # the partial directory is gone before anyone reads `latest`
            raise failure_error(write.step, self.root, failures, write.needed_bytes, storage.latest_step(self.root))

    def wait(self) -> None:
        """Same as settle() (collective): the write in flight is published, or every rank raises."""
        self.settle()

    def finish(self) -> None:
        """Settle the last write on every rank, then a barrier: call before the process exits."""
        self.settle()
        comm.barrier(comm.world_group())

    def abandon(self, timeout_s: float = 120.0) -> None:
        """The job failed: give this rank's background write `timeout_s` to land (ranks meet through
        files, not collectives, so it can finish without the others), then let it go. Never
        communicates; an unpublished write leaves the previous checkpoint `latest`."""
        write, self._pending = self._pending, None
        if write is None or write.thread is None:
            return
        write.thread.join(timeout=timeout_s)
        if write.thread.is_alive():
            write.abort.set()
            self.log(f"checkpoint: a background write is still running after {timeout_s:.0f} s; leaving it "
                     f"(the previous checkpoint stays `latest`)")
