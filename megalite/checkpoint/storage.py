"""On-disk layout of a checkpoint directory, crash-safe writes and checksums.

    DIR/
      latest                    "step_000123": the newest complete checkpoint, replaced last
      step_000123/
        metadata.json           configs, step, data position, layout, versions, index of every box
        shard_r00000.bin ...    raw bytes of the boxes rank r wrote (little-endian, row-major)
        manifest.json           {file: {sha256, bytes}}: written last, before the rename
      step_000100/ ...          older checkpoints kept by --keep-last / --keep-every

Integrity: the manifest holds every file's sha256 and size (whole-file checks, `sha256sum`
compatible), and the index in metadata.json holds a CRC32 of every stored box, so a reader
verifies exactly the bytes it reads: a dp rank that needs the weights from rank 0's file
does not hash rank 0's share of the optimizer state too.

A checkpoint is written into `step_000123.tmp/`; each rank writes its shard file, fsyncs it
and drops a `done_rNNNNN.json` marker (its file's sha256 and size, each box's CRC32). Rank 0 waits for every
marker, writes manifest.json, fsyncs, renames the directory to `step_000123/` (atomic) and
only then replaces `latest` (write `latest.tmp`, fsync, os.replace). A crash at any point
leaves either the old `latest` or a complete new checkpoint; `*.tmp` directories are
never read, and the next run's Checkpointer removes them (`remove_unpublished`). A save that
fails (full disk, unwritable directory) removes its own (`discard_unpublished`).

Nothing here communicates: ranks meet through files (the checkpoint directory is on a file
system every rank sees, as it must be for a layout-free load anyway).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megalite.checkpoint.write_failure import human_bytes
from megalite.errors import UsageError

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST, METADATA, LATEST = "manifest.json", "metadata.json", "latest"
_CHUNK = 8 << 20  # bytes per write/read while hashing

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64", torch.uint8: "uint8", torch.int64: "int64"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


FORMAT_VERSION = 1  # of metadata.json and the shard files; a reader refuses newer ones


class CheckpointCorruptError(RuntimeError):
    """A checkpoint on disk is incomplete or damaged (the message names the file)."""


class NoIntactCheckpointError(UsageError, CheckpointCorruptError):
    """Every checkpoint of a --load directory is damaged: the person running the job chooses
    (another directory, or the damaged step directories moved away)."""


class CheckpointMismatchError(UsageError, ValueError):
    """A checkpoint this model or this megalite cannot load: saved from another model (a
    parameter's shape, or the architecture, differs) or in a newer format. Not damage: no
    fallback to an older checkpoint, the person running the job must choose."""


class CheckpointNotFoundError(UsageError, FileNotFoundError):
    """The checkpoint asked for (--load-step N, a step directory) does not exist."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def shard_file_name(rank: int) -> str:
    return f"shard_r{rank:05d}.bin"


def _done_marker(rank: int) -> str:
    return f"done_r{rank:05d}.json"


def check_save_dir(path: str, needed_bytes: int) -> list[str]:
    """What would stop the first checkpoint hours into a run, found before it starts: `path`
    cannot be created, is not writable from this process, or has less free space than
    `needed_bytes` (what this node's ranks will write). Creates `path`; leaves nothing else."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return [f"--save {path}: cannot create it ({exc.strerror or exc}); choose a directory every rank can write"]
    probe = directory / f".write_probe_{socket.gethostname()}_{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return [f"--save {path}: not writable from this rank ({exc.strerror or exc})"]
    finally:
        probe.unlink(missing_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        return [f"--save {path}: {human_bytes(free)} free, but this node's ranks write {human_bytes(needed_bytes)} "
                f"per checkpoint (weights + fp32 optimizer state); free space there or choose another directory"]
    return []


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj) -> str:
    """Write `obj` as JSON to path.tmp, fsync, rename over `path`; return the file's sha256."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bfloat16 included), without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_shard(path: Path, tensors: list[torch.Tensor], crash_after_bytes: int | None = None) -> dict:
    """Write tensors back to back into `path`, fsync; return {'sha256', 'bytes', 'crc32': [per tensor]}.

    The file's sha256 and each tensor's CRC32 are computed in two helper threads while this
    one writes the same chunk (hashlib, zlib and file writes release the GIL on large buffers),
    so a save costs about the slowest of the three, not their sum.
    `crash_after_bytes` is fault injection for tests: the process dies mid-file (os._exit).
    """
    digest, written, crcs = hashlib.sha256(), 0, []
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=2, thread_name_prefix="megalite-ckpt-hash") as pool:
        for tensor in tensors:
            data = tensor_bytes(tensor)
            crc = 0
            for start in range(0, len(data), _CHUNK):
                piece = data[start:start + _CHUNK]
                if crash_after_bytes is not None and written + len(piece) > crash_after_bytes:
                    f.write(piece[:max(0, crash_after_bytes - written)])
                    f.flush()
                    os._exit(17)
                sha_job = pool.submit(digest.update, piece)  # chunks reach each hash in file order
                crc_job = pool.submit(zlib.crc32, piece, crc)
                f.write(piece)
                sha_job.result()
                crc = crc_job.result()
                written += len(piece)
            crcs.append(crc)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": written, "crc32": crcs}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_done_marker(tmp_dir: Path, rank: int, record: dict) -> None:
    write_json_atomic(tmp_dir / _done_marker(rank), record)


def collect_done_markers(tmp_dir: Path, world_size: int, timeout_s: float, abort=None) -> dict[str, dict]:
    """Wait until every rank's marker exists; return {file name: {'sha256', 'bytes', 'crc32'}}.

    `abort` (a threading.Event): stop waiting when it is set (another rank's write failed)."""
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict] = {}
    while len(records) < world_size:
        if abort is not None and abort.is_set():
            raise RuntimeError(f"checkpoint {tmp_dir}: abandoned (another rank's write failed)")
        for rank in range(world_size):
            marker = tmp_dir / _done_marker(rank)
            if rank not in records and marker.exists():
                records[rank] = json.loads(marker.read_text())
        if len(records) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(records))
                raise TimeoutError(f"checkpoint {tmp_dir}: ranks {missing[:8]} did not finish writing within "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.005)
    failed = {r: rec["error"] for r, rec in records.items() if "error" in rec}
    if failed:
        raise RuntimeError(f"checkpoint {tmp_dir}: ranks failed to write: {failed}")
    return {rec["file"]: {k: rec[k] for k in ("sha256", "bytes", "crc32")} for rec in records.values()}


def attach_crcs(rows: list[list], files: dict[str, dict]) -> tuple[list[list], dict[str, dict]]:
    """Index rows (in each file's write order) get their box's CRC32 appended; the manifest
    entries keep sha256 and size only."""
    position: dict[str, int] = {}
    out = []
    for row in rows:
        file = row[4]
        i = position.get(file, 0)
        position[file] = i + 1
        out.append(row + [files[file]["crc32"][i]])
    return out, {f: {"sha256": r["sha256"], "bytes": r["bytes"]} for f, r in files.items()}


def publish(tmp_dir: Path, files: dict[str, dict]) -> Path:
    """Manifest, then atomic rename of the directory, then `latest`: the commit of a checkpoint."""
    for rank_marker in tmp_dir.glob("done_r*.json"):
        rank_marker.unlink()
    write_json_atomic(tmp_dir / MANIFEST, {"files": files})
    fsync_dir(tmp_dir)
    final = tmp_dir.with_name(tmp_dir.name.removesuffix(".tmp"))
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        remove_dir(final)
    os.rename(tmp_dir, final)
    fsync_dir(final.parent)
    write_json_atomic(final.parent / LATEST, {"step_dir": final.name})
    fsync_dir(final.parent)
    return final


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def discard_unpublished(root: Path, step: int) -> None:
    """After a failed save of `step`: remove its partial directory, and its renamed directory
    too when `latest` does not name it (the rename happened, replacing `latest` failed)."""
    shutil.rmtree(root / (step_dir_name(step) + ".tmp"), ignore_errors=True)
    final = root / step_dir_name(step)
    if final.is_dir() and latest_step(root) != step:
        try:
            remove_dir(final)
        except OSError:
            pass


def remove_unpublished(root: Path) -> list[str]:
    """Remove what interrupted saves left in `root`: `step_N.tmp` directories (never loadable)
    and directories renamed for deletion. Only while no save is in flight (a new run, rank 0)."""
    if not root.is_dir():
        return []
    removed = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and re.match(r"^step_\d+(\.tmp|\.deleting\d+)$", child.name):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def remove_dir(path: Path) -> None:
    """Rename out of the step_* namespace first, so a crash mid-delete leaves nothing loadable."""
    doomed = path.with_name(path.name + f".deleting{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prepare_tmp_dir(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (step_dir_name(step) + ".tmp")
    if tmp.exists():  # left by a crash: never published, safe to drop
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def complete_steps(root: Path) -> list[int]:
    """Steps of published checkpoint directories (with a manifest), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MANIFEST).exists():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: Path) -> int | None:
    """The step `latest` names, or None when there is no (readable) pointer."""
    try:
        name = json.loads((root / LATEST).read_text())["step_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def prune(root: Path, keep_last: int, keep_every: int) -> list[int]:
    """Delete checkpoints beyond the newest `keep_last` except multiples of `keep_every`
    and the one `latest` names; return the deleted steps. keep_last=0 keeps everything.
    Also removes `step_N.tmp` directories older than `latest` (left by a crash)."""
    latest = latest_step(root)
    for child in root.iterdir():  # unpublished leftovers of a crashed earlier save: never loadable
        match = re.match(r"^step_(\d+)\.tmp$", child.name)
        if match and latest is not None and int(match.group(1)) < latest:
            shutil.rmtree(child, ignore_errors=True)
    if keep_last <= 0:
        return []
    steps = complete_steps(root)
    keep = set(steps[-keep_last:]) | {latest}
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    doomed = [s for s in steps if s not in keep]
    for step in doomed:
        remove_dir(root / step_dir_name(step))
    return doomed
