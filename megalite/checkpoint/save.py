"""Checkpointer: save a layout-free checkpoint, synchronously or in the background.

    checkpointer = Checkpointer("runs/ckpt", mesh, keep_last=3, keep_every=1000, async_save=True)
    checkpointer.save(step, chunks, optimizer, consumed_samples=..., model_config=..., train_config=...)
    ...
    checkpointer.finish()   # waits for a background write; every rank, before exiting

One save:
1. (every rank, training blocked) copy this rank's boxes to CPU memory (`snapshot.collect`);
   rank 0 creates `step_N.tmp/`; one all_gather_object of the per-rank index (names, boxes,
   byte offsets: no tensor data) so rank 0 can write metadata.json.
2. (sync: now; async: a background thread) each rank writes its shard file, fsyncs it and
   drops a done marker; rank 0 then writes metadata.json, waits for every marker, writes the
   manifest, renames the directory and replaces `latest` (storage.publish), and prunes.
The background thread never communicates (gloo/NCCL collectives from two threads could
interleave); ranks meet through the markers. A sync save ends with a barrier, so on return
the checkpoint is published for everyone.
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

from megalite import comm, params
from megalite.checkpoint import snapshot, storage
from megalite.mesh import Mesh

FORMAT_VERSION = 1
CRASH_ENV = "MEGALITE_CHECKPOINT_CRASH_AFTER_BYTES"  # fault injection: rank 0 dies mid-write


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
    return {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "world_size": mesh.world_size,
            "virtual_stages": len(chunks), "zero_stage": getattr(optimizer, "zero_stage", None),
            "param_dtype": storage.DTYPE_NAMES[next(chunks[0].parameters()).dtype]}


class Checkpointer:
    """Saves checkpoints into `save_dir` (see the module docstring for the protocol).

    keep_last: keep the newest N checkpoints (0: keep all); keep_every: also keep every
    step that is a multiple of M (milestones); async_save: write in a background thread,
    training blocks only for the copy to CPU memory. `log` prints on rank 0.
    """

    def __init__(self, save_dir: str | os.PathLike, mesh: Mesh, *, keep_last: int = 0, keep_every: int = 0,
                 async_save: bool = False, timeout_s: float = 1800.0, log=print):
        if keep_last < 0 or keep_every < 0:
            raise ValueError(f"--keep-last and --keep-every must be >= 0, got {keep_last} and {keep_every}")
        self.root, self.mesh = Path(save_dir), mesh
        self.keep_last, self.keep_every, self.async_save = keep_last, keep_every, async_save
        self.timeout_s, self._log = timeout_s, log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_blocked_s = 0.0  # training-blocked seconds of the last save()

    def log(self, message: str) -> None:
        if self.mesh.rank == 0:
            self._log(message)

    # ------------------------------------------------------------------ save

    def save(self, step: int, chunks, optimizer, *, consumed_samples: int, model_config, train_config=None,
             extra: dict | None = None) -> Path:
        """Checkpoint the state after `step` optimizer steps; returns the final directory path."""
        started = time.perf_counter()
        self.wait()  # one write in flight at a time (and surface a failed background write)
        items, optimizer_extras = snapshot.collect(chunks, optimizer, self.mesh, copy=self.async_save)
        file = storage.shard_file_name(self.mesh.rank)
        index, offset = [], 0
        for item in items:
            index.append(item.index_entry(file, offset))
            offset += item.tensor.numel() * item.tensor.element_size()
        tmp_dir = self.root / (storage.step_dir_name(step) + ".tmp")
        if self.mesh.rank == 0:
            storage.prepare_tmp_dir(self.root, step)
        # Also a barrier: after it, the tmp directory exists for every rank.
        shapes = {name: list(params.shard_spec(p).full_shape) for chunk in chunks for name, p in chunk.logical_parameters()}
        gathered = comm.all_gather_object({"items": index, "shapes": shapes}, comm.world_group())
        metadata = None
        if self.mesh.rank == 0:
            metadata = {
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
        tensors = [item.tensor for item in items]
        del items
        final = self.root / storage.step_dir_name(step)
        if self.async_save:
            self._thread = threading.Thread(target=self._write, args=(tmp_dir, file, tensors, metadata, step),
                                            name=f"megalite-checkpoint-{step}", daemon=True)
            self._thread.start()
            self.last_blocked_s = time.perf_counter() - started
            self.log(f"checkpoint: step {step} copied to memory in {self.last_blocked_s:.2f} s; writing to "
                     f"{final} in the background")
        else:
            self._write(tmp_dir, file, tensors, metadata, step)
            self._raise_pending()
            comm.barrier(comm.world_group())  # rank 0 has published before anyone goes on
            self.last_blocked_s = time.perf_counter() - started
            self.log(f"checkpoint: saved step {step} to {final} in {self.last_blocked_s:.2f} s")
        return final

    def _write(self, tmp_dir: Path, file: str, tensors, metadata, step: int) -> None:
        """Write this rank's file (and, on rank 0, publish); record any error for wait()."""
        rank = self.mesh.rank
        try:
            crash = os.environ.get(CRASH_ENV)
            crash_after = int(crash) if crash is not None and rank == 0 else None
            record = storage.write_shard(tmp_dir / file, tensors, crash_after_bytes=crash_after)
            storage.write_done_marker(tmp_dir, rank, {"file": file, **record})
            if rank != 0:
                return
            files = storage.collect_done_markers(tmp_dir, self.mesh.world_size, self.timeout_s)
            metadata["items"], files = storage.attach_crcs(metadata["items"], files)
            sha = storage.write_json_atomic(tmp_dir / storage.METADATA, metadata)
            files[storage.METADATA] = {"sha256": sha, "bytes": (tmp_dir / storage.METADATA).stat().st_size}
            final = storage.publish(tmp_dir, files)
            deleted = storage.prune(self.root, self.keep_last, self.keep_every)
            if deleted:
                self.log(f"checkpoint: removed old checkpoints {deleted} (--keep-last {self.keep_last}"
                         f"{f', --keep-every {self.keep_every}' if self.keep_every else ''})")
            if self.async_save:
                self.log(f"checkpoint: step {step} published at {final}")
        except BaseException as exc:  # noqa: BLE001 - a background failure must surface in wait()
            self._error = exc
            if rank != 0:
                try:
                    storage.write_done_marker(tmp_dir, rank, {"file": file, "error": repr(exc)})
                except OSError:
                    pass

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint write failed on rank {self.mesh.rank}: {error!r}") from error

    def wait(self) -> None:
        """Block until the background write (and, on rank 0, the publish) is done; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def finish(self) -> None:
        """Wait for the last write on every rank, then a barrier: call before the process exits."""
        self.wait()
        comm.barrier(comm.world_group())

    def abandon(self, timeout_s: float = 120.0) -> None:
        """The job failed: give a background write `timeout_s` to land (its ranks meet through files,
        not collectives, so it can finish without the others), then let it go. Never communicates."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                self.log(f"checkpoint: a background write is still running after {timeout_s:.0f} s; leaving it "
                         f"(the previous checkpoint stays `latest`)")
            self._thread = None

